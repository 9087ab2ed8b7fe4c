package tiering

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

// S2.11: a tier that panics in any method, called on the engine's step
// (Lookup, SubmitLoad, SubmitStore, Finished, the request hooks, Touch,
// Serve, OnScheduleEnd), by HasPendingWork, Metrics, a cache reset or the
// poll goroutine, crashes nothing: each panic is that tier's error, logged
// once (then rate-limited) and counted, and once the tier stops panicking
// requests are served in full again — promotions land, stores cascade.
func TestTierPanics(t *testing.T) {
	for _, polled := range []bool{false, true} {
		for _, method := range fake.PanicMethods {
			if method == "New" || method == "Close" {
				continue // TestTierPanicsNewClose
			}
			t.Run(fmt.Sprintf("%s/polled=%v", method, polled), func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					var logs logBuffer
					tier := fake.NewPanicTier(offload.ChunkLevel)
					tier.SetPolled(polled)
					h := newHarnessSpecs(t, 16, func(c *offload.Config) {
						c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
					}, tier.Spec("t0"))
					tier.PanicIn(method)
					exercise(t, h, tier, 1, false)
					synctest.Wait()       // the poll goroutine's retry at the reset's deadline too
					snap := h.m.Metrics() // with Stats panicking, this counts one more
					panics := snap.Tiers[1].Panics
					if panics == 0 {
						t.Errorf("a tier panicking in %s: no panic counted", method)
					}
					if n := logs.count("treated as the tier's error"); n != 1 {
						t.Errorf("panics logged %d times, want 1 (then rate-limited)", n)
					}
					var text bytes.Buffer
					snap.WritePrometheus(&text)
					if want := fmt.Sprintf("kv_offload_tiering_tier_panics_total{tier=\"t0\"} %d\n", panics); !strings.Contains(text.String(), want) {
						t.Errorf("metrics lack %q", want)
					}
					tier.PanicIn()
					exercise(t, h, tier, 2, true)
					if got := h.m.Metrics().Tiers[1].Panics; got != panics {
						t.Errorf("%d panics counted while the tier behaved", got-panics)
					}
				})
			})
		}
	}
}

// exercise drives one request through every call the manager makes into
// a tier: it registers, looks up a block the tier holds until the
// promotion settles, stores and touches a computed block (a cascade),
// reads metrics, finishes and resets the cache. With check, every step
// must have worked.
func exercise(t *testing.T, h *harness, tier *fake.PanicTier, round int, check bool) {
	t.Helper()
	ks := keys(100+round, 2)
	tier.Put(ks[0], h.block(ks[0]))
	req := h.newRequest(fmt.Sprintf("r%d", round))
	var r offload.Result
	for range 10 { // bounded: a broken tier may never settle
		if r = h.lookups(req, ks[:1])[0]; r == offload.Hit || r == offload.Miss {
			break
		}
		synctest.Wait() // the poll goroutine applies the result
	}
	if check {
		if r != offload.Hit {
			t.Fatalf("round %d: promoted block = %v, want hit", round, r)
		}
		h.load(req, ks[:1])
	}
	h.m.HasPendingWork()
	h.step(func(s *offload.Step) {
		h.store(s, req, ks[1:])
		s.Touch(ks, req)
	})
	synctest.Wait()
	h.step(func(*offload.Step) {}) // collects the cascade
	synctest.Wait()
	h.m.Metrics()
	if check {
		if r := h.lookups(req, ks[1:])[0]; r != offload.Hit {
			t.Errorf("round %d: stored block = %v, want hit", round, r)
		}
		if !tier.Has(ks[1]) {
			t.Errorf("round %d: the stored block did not cascade to the tier", round)
		}
	}
	h.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	resets := tier.Calls().Resets
	if err := h.m.ResetCache(ctx); err != nil {
		t.Errorf("round %d: ResetCache: %v", round, err)
	}
	if check {
		c := tier.Calls()
		if c.Resets != resets+1 || !slices.Contains(c.Finished, req) {
			t.Errorf("round %d: the tier saw %d resets and finished %v; want one more reset and %s finished",
				round, c.Resets-resets, c.Finished, req.ID)
		}
		if n := h.m.Metrics().Requests; n != 0 {
			t.Errorf("round %d: %d requests left", round, n)
		}
	}
}

// S2.11: a panic in a tier's constructor is an error of New, and a panic
// in Close is an error of Close (the arena stays mapped, as for any
// failed close); neither crashes.
func TestTierPanicsNewClose(t *testing.T) {
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(4 * cfg.Geometry.BlockBytes())
	tier := fake.NewPanicTier(offload.ChunkLevel)
	tier.PanicIn("New")
	if m, err := offload.New(cfg, tier.Spec("t0")); !errors.Is(err, offload.ErrTierPanic) {
		if m != nil {
			m.Close()
		}
		t.Errorf("New with a panicking constructor: %v, want ErrTierPanic", err)
	}
	tier = fake.NewPanicTier(offload.ChunkLevel)
	m, err := offload.New(cfg, tier.Spec("t0"))
	if err != nil {
		t.Fatal(err)
	}
	tier.PanicIn("Close")
	if err := m.Close(); !errors.Is(err, offload.ErrTierPanic) {
		t.Errorf("Close with a panicking tier: %v, want ErrTierPanic", err)
	}
	if got := m.Metrics().Tiers[1].Panics; got != 1 {
		t.Errorf("panics counted %d, want 1", got)
	}
	if err := m.Close(); err != nil {
		t.Errorf("second Close: %v, want nil", err)
	}
}
