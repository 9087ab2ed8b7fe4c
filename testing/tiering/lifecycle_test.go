package tiering

import (
	"context"
	"sync/atomic"
	"testing"
	"testing/synctest"
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

// S2.7, §9: the backpressure drop counters are Prometheus counters
// (…_dropped_stores_total, …_dropped_blocks_total): a cache reset forgets
// what the detector learned (its estimate, its pressure) but must not
// take back what was counted.
func TestBackpressureCountersSurviveReset(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tier := fake.NewTier(offload.ChunkLevel)
		h := newHarness(t, 16, withBackpressure, tier)
		tier.Hold(true)
		req := h.newRequest("r")
		for i := range 4 { // three warm-up samples and one more, all slow
			storeTook(h, tier, req, keys(10+i, 1), time.Second)
		}
		h.m.Do(func(s *offload.Step) { h.store(s, req, keys(20, 2)) }) // dropped
		before := backpressureOf(h)
		if !before.Pressured || before.DroppedStores != 1 || before.DroppedBlocks != 2 {
			t.Fatalf("before the reset: %+v; want pressured, 1 store of 2 blocks dropped", before)
		}
		h.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
		if err := h.m.ResetCache(context.Background()); err != nil {
			t.Fatal(err)
		}
		after := backpressureOf(h)
		if after.Pressured {
			t.Errorf("after the reset the tier is still pressured: %+v", after)
		}
		if after.DroppedStores != before.DroppedStores || after.DroppedBlocks != before.DroppedBlocks {
			t.Errorf("a cache reset took counted drops back: %d stores / %d blocks before, %d / %d after",
				before.DroppedStores, before.DroppedBlocks, after.DroppedStores, after.DroppedBlocks)
		}
	})
}

// Tier contract (RequestHooks: OnRequestFinished comes after the last
// submit for the request), S2.9: a request that finishes in the step that
// queued a promotion for it gets no load submitted after its tiers were
// told it finished; its reserved slot is freed, not left to a load nobody
// will use.
func TestNoPromotionSubmittedAfterFinish(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, nil, tier)
	ks := keys(1, 1)
	tier.Put(ks[0], h.block(ks[0]))
	req := h.newRequest("r")
	h.step(func(s *offload.Step) {
		if r := s.Lookup(ks[0], req); r != offload.HitPending {
			t.Fatalf("lookup = %v, want hit_pending (a promotion queued)", r)
		}
		if err := s.OnRequestFinished(req); err != nil {
			t.Fatal(err)
		}
	})
	calls := tier.Calls()
	if len(calls.Finished) != 1 {
		t.Fatalf("tier saw %d finishes, want 1", len(calls.Finished))
	}
	for _, j := range calls.Loads {
		if j.Req == req {
			t.Errorf("load job %d submitted for request %s after the tier was told it finished", j.ID, req.ID)
		}
	}
	if cpu := h.m.Metrics().CPU; cpu.Used != 0 || cpu.Writing != 0 {
		t.Errorf("CPU tier: %d used, %d writing after the finished request's promotion; want 0, 0", cpu.Used, cpu.Writing)
	}
}
