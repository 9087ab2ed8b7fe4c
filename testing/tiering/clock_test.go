package tiering

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

// Issue 13, one clock (S3.1, S3.2, S4.1, S4.7): the poll goroutine's timer
// serves both what a tier asks for (TierEnv.WakeAt) and the manager's own
// deadlines. A tier's earlier time brings a service of that tier (or, with
// no poll goroutine servicing it, a progress signal so that the engine
// steps) and does not swallow the later Retry deadline; the deadline
// expires the lookup without servicing the tier; then the node is idle:
// an hour passes with no service.
func TestOneClock(t *testing.T) {
	for _, polled := range []bool{true, false} {
		name := "polled"
		if !polled {
			name = "no poll goroutine"
		}
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				tier := fake.NewTier(offload.ChunkLevel)
				edit := withPoll(0)
				if polled {
					tier.SetPolled(true)
					edit = withPoll(time.Millisecond)
				}
				h := newHarness(t, 4, edit, tier)
				k := keys(1, 1)
				tier.Answer(k[0], offload.Retry) // the 5 s Retry deadline starts
				req := h.newRequest("r")
				start := time.Now()
				if r := h.lookups(req, k); r[0] != offload.Retry {
					t.Fatalf("lookup = %v, want retry", r[0])
				}
				tier.WakeAt(start.Add(time.Second))
				synctest.Wait()
				drainProgress(h.m)
				serves := tier.Calls().Serves

				time.Sleep(time.Second)
				synctest.Wait()
				switch got := tier.Calls().Serves - serves; {
				case polled && got != 1:
					t.Errorf("the time the tier asked for brought %d services, want 1", got)
				case !polled && got != 0:
					t.Errorf("the poll goroutine serviced a tier it does not service %d times", got)
				case !polled && !progressed(h.m):
					t.Error("the time the tier asked for signalled no progress (the engine would not step)")
				}
				drainProgress(h.m)
				serves = tier.Calls().Serves

				<-h.m.Progress() // the Retry deadline wakes the engine
				if waited := time.Since(start); waited != 5*time.Second {
					t.Errorf("the deadline woke the engine after %v, want 5s", waited)
				}
				if got := tier.Calls().Serves - serves; got != 0 {
					t.Errorf("the manager's own deadline serviced the tier %d times, want 0", got)
				}
				if r := h.lookups(req, k); r[0] != offload.Miss {
					t.Errorf("lookup after the deadline = %v, want miss", r[0])
				}
				if m := h.m.Metrics(); m.RetryTimeouts != 1 {
					t.Errorf("retry timeouts %d, want 1", m.RetryTimeouts)
				}
				serves = tier.Calls().Serves
				time.Sleep(time.Hour)
				synctest.Wait()
				if got := tier.Calls().Serves - serves; got != 0 {
					t.Errorf("an idle manager serviced its tier %d times in an hour, want 0", got)
				}
				if progressed(h.m) {
					t.Error("an idle manager signalled progress")
				}
			})
		})
	}
}
