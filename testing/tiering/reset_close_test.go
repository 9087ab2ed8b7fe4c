package tiering

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

// S5.1, issue 13 (found in review): Close during a reset's phase 2 stops
// the poll goroutine, which drives the wait; the reset must then end at
// once with ErrClosed, not wait for its ctx.
func TestResetEndsOnClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tier := fake.NewTier(offload.ChunkLevel)
		tier.SetPolled(true)
		h := newHarness(t, 8, withPoll(time.Millisecond), tier)
		ks := keys(1, 2)
		w := h.newRequest("w")
		tier.Hold(true)
		h.m.Do(func(s *offload.Step) { h.store(s, w, ks) }) // a held cascade
		cascade := tier.Held()[0]
		ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- h.m.ResetCache(ctx) }()
		synctest.Wait()
		h.m.Close()
		start := time.Now()
		tier.Release(cascade, false) // the transfer ends (failed, touches no slot)
		err := <-done
		if waited := time.Since(start); waited > time.Second {
			t.Errorf("ResetCache returned %v after %v, once its ctx ended; the transfer ended at once", err, waited)
		}
		if !errors.Is(err, offload.ErrClosed) {
			t.Errorf("ResetCache after Close = %v, want ErrClosed", err)
		}
	})
}

// S3.2, S3.3, issue 13 (found in review): while a polled tier's passes
// fail (the poll goroutine backs off), a time another, non-polled tier
// asked for (TierEnv.WakeAt) still signals progress when it is due.
func TestBackoffKeepsWakeAt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		bad := fake.NewTier(offload.ChunkLevel)
		bad.SetPolled(true)
		other := fake.NewTier(offload.ChunkLevel) // not polled, a Server
		h := newHarness(t, 4, withPoll(time.Millisecond), bad, other)
		bad.OnServe(func(offload.Parent) error { return errors.New("broken") })
		bad.Wake()
		synctest.Wait() // first failure: backing off 1 s
		if h.m.Metrics().PollErrors == 0 {
			t.Fatal("no failure")
		}
		drainProgress(h.m)
		other.WakeAt(time.Now().Add(100 * time.Millisecond))
		time.Sleep(3 * time.Second)
		synctest.Wait()
		if !progressed(h.m) {
			t.Error("the non-polled tier's WakeAt signalled no progress in 3 s (lost while backing off)")
		}
	})
}
