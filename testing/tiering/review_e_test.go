package tiering

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

// S4.1, S4.7: once a (request, key)'s deadline has passed, it answers Miss
// and no new promotion starts for it — also when the lookup comes before
// the poll goroutine's pass expired the deadline (the engine held the lock
// when the clock fired, or the timer is late) and the tier that answered
// Retry now has the block.
func TestNoPromotionAfterDeadlineBeforePollPass(t *testing.T) {
	var now atomic.Int64
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return base.Add(time.Duration(now.Load())) }
	tier := fake.NewTier(offload.ChunkLevel)
	// An hour of hit_pending_timeout: the poll goroutine's real timer does
	// not fire during the test, so only the lookup path sees the deadline.
	h := newHarness(t, 4, func(c *offload.Config) {
		c.Now = clock
		c.HitPendingTimeout = offload.Duration(time.Hour)
	}, tier)
	ks := keys(1, 1)
	tier.Answer(ks[0], offload.Retry)
	req := h.newRequest("r")
	if got := h.lookups(req, ks); got[0] != offload.Retry {
		t.Fatalf("first lookup = %v, want retry", got[0])
	}
	now.Store(int64(time.Hour)) // the deadline has passed
	tier.ClearAnswer(ks[0])
	tier.Put(ks[0], h.block(ks[0])) // the tier found the block after all
	if got := h.lookups(req, ks); got[0] != offload.Miss {
		t.Errorf("lookup after the deadline = %v, want miss (S4.7)", got[0])
	}
	if n := len(tier.Calls().Loads); n != 0 {
		t.Errorf("%d promotion(s) started after the deadline, want none (S4.1)", n)
	}
	if cpu := h.m.Metrics().CPU; cpu.Used != 0 {
		t.Errorf("CPU tier holds %d block(s) for a pair that answered miss, want 0", cpu.Used)
	}
	h.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
}
