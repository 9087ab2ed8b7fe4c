package tiering

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

// S4.8: a lookup for a request never registered with OnNewRequest answers
// Miss — also for a block the CPU tier holds — asks no tier, starts no
// promotion or deadline, and is counted as misuse; the same through a
// tier's Parent facade.
func TestLookupUnregistered(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tier := fake.NewTier(offload.ChunkLevel)
		h := newHarness(t, 4, nil, tier)
		ks := keys(1, 3)
		w := h.newRequest("w")
		h.m.Do(func(s *offload.Step) { h.store(s, w, ks[:1]) }) // a CPU hit
		h.m.Do(func(s *offload.Step) { s.OnRequestFinished(w) })
		tier.Put(ks[1], h.block(ks[1]))   // a secondary hit
		tier.Answer(ks[2], offload.Retry) // unsettled
		before := h.m.Metrics().Errors["unknown_request"]
		stranger := newReq("stranger")
		var remote []offload.Result
		tier.OnServe(func(p offload.Parent) error {
			tier.OnServe(nil)
			for _, k := range ks {
				remote = append(remote, p.Lookup(k, newReq("peer")))
			}
			return nil
		})
		var hits int
		var settled bool
		h.step(func(s *offload.Step) {
			for i, k := range ks {
				if r := s.Lookup(k, stranger); r != offload.Miss {
					t.Errorf("lookup %d of an unregistered request = %v, want miss", i, r)
				}
			}
			hits, settled = s.LookupPrefix(ks, stranger)
		})
		if hits != 0 || !settled {
			t.Errorf("LookupPrefix = %d, %v; want 0, true", hits, settled)
		}
		if diff := cmp.Diff(repeat(offload.Miss, 3), remote); diff != "" {
			t.Errorf("Parent lookups of an unregistered request (-want +got):\n%s", diff)
		}
		time.Sleep(time.Minute) // no deadline was started
		synctest.Wait()
		m := h.m.Metrics()
		if got := m.Errors["unknown_request"] - before; got != 3+1+3 {
			t.Errorf("unknown_request counted %d times, want 7 (3 lookups, 1 prefix, 3 via Parent)", got)
		}
		c := tier.Calls()
		if c.Lookups != 0 || len(c.Loads) != 0 {
			t.Errorf("the tier was asked %d times and given %d loads, want none", c.Lookups, len(c.Loads))
		}
		if m.Requests != 0 || m.CPU.Writing != 0 || m.RetryTimeouts+m.HitPendingTimeouts != 0 {
			t.Errorf("state left: %d requests, %d slots writing, %d timeouts; want none",
				m.Requests, m.CPU.Writing, m.RetryTimeouts+m.HitPendingTimeouts)
		}
	})
}

// S4.1, S2.4, S2.2, S5.1 (issue 11, item 12): a request whose promotion
// stalled past hit_pending_timeout recomputes the block and stores it: the
// store supersedes the promotion's reserved slot, the computed block
// becomes readable, and the stalled promotion, when it finally ends, never
// makes its stale slot readable nor overwrites the new one; its slot is
// freed then.
func TestStalledPromotionRecomputed(t *testing.T) {
	tests := []struct {
		name  string
		ok    bool // how the stalled promotion ends
		reset bool // a cache reset (epoch bump) before it ends
	}{
		{"promotion succeeds late", true, false},
		{"promotion fails late", false, false},
		{"reset, then promotion succeeds", true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				tier := fake.NewTier(offload.ChunkLevel)
				h := newHarness(t, 4, nil, tier)
				k := keys(1, 1)
				stale := bytes.Repeat([]byte{0xee}, h.m.BlockBytes())
				tier.Put(k[0], stale) // what the stalled promotion would write
				tier.Hold(true)
				req := h.newRequest("r")
				if r := h.lookups(req, k); r[0] != offload.HitPending {
					t.Fatalf("lookup = %v, want hit_pending", r[0])
				}
				promotion := tier.Held()[0]
				time.Sleep(5 * time.Second)
				if r := h.lookups(req, k); r[0] != offload.Miss {
					t.Fatalf("lookup after the deadline = %v, want miss", r[0])
				}
				// The engine recomputed the block; it must be stored.
				var plan *offload.StorePlan
				h.m.Do(func(s *offload.Step) {
					var err error
					plan, err = s.PrepareStore(k, req)
					if err != nil || plan == nil || len(plan.Keys) != 1 {
						t.Fatalf("PrepareStore of the recomputed block: plan %+v, err %v; want it reserved", plan, err)
					}
				})
				other := h.newRequest("other")
				if r := h.lookups(other, k); r[0] != offload.HitPending {
					t.Errorf("lookup while the recomputed block is written = %v, want hit_pending", r[0])
				}
				copy(h.m.Arena().Slot(int(plan.Slots[0])), h.block(k[0]))
				h.m.Do(func(s *offload.Step) {
					if err := s.CompleteStore(plan.Keys, req, true); err != nil {
						t.Fatalf("CompleteStore: %v", err)
					}
				})
				if r := h.lookups(other, k); r[0] != offload.Hit {
					t.Fatalf("lookup of the stored block = %v, want hit", r[0])
				}
				h.load(other, k) // the computed bytes
				if n := len(tier.Calls().Loads); n != 1 {
					t.Errorf("%d promotions submitted, want 1 (no duplicate)", n)
				}
				for _, id := range tier.Held() {
					if id != promotion {
						tier.Release(id, true) // the computed block's cascade
					}
				}
				if tt.reset {
					tier.Answer(k[0], offload.Miss) // nothing to promote again after the reset
					ctx, cancel := context.WithTimeout(context.Background(), time.Second)
					err := h.m.ResetCache(ctx) // proceeds with the promotion in flight
					cancel()
					if err != nil {
						t.Fatalf("ResetCache: %v", err)
					}
				}
				if !tier.Release(promotion, tt.ok) {
					t.Fatal("the stalled promotion was not held")
				}
				h.step(func(*offload.Step) {}) // the late result is applied
				late := h.newRequest("late")
				want := offload.Hit
				if tt.reset {
					want = offload.Miss
				}
				if r := h.lookups(late, k); r[0] != want {
					t.Fatalf("lookup after the stalled promotion ended = %v, want %v", r[0], want)
				}
				if want == offload.Hit {
					h.load(late, k) // still the computed bytes, not the stale ones
				}
				cpu := h.m.Metrics().CPU
				wantUsed := map[bool]int{true: 0, false: 1}[tt.reset]
				if cpu.Detached != 0 || cpu.Writing != 0 || cpu.Used != wantUsed {
					t.Errorf("CPU tier after the late result: %d detached, %d writing, %d used; want 0, 0, %d",
						cpu.Detached, cpu.Writing, cpu.Used, wantUsed)
				}
			})
		})
	}
}

// Issue 13, time is an input: the manager reads only Config.Now, so a test
// that moves that clock by hand drives the Retry bound (S4.7) without
// sleeping and without synctest. With a wall-clock read anywhere in the
// lookup path the pair would stay Retry: no real time passes here.
func TestManagerTakesTime(t *testing.T) {
	var now atomic.Int64 // nanoseconds past base
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return base.Add(time.Duration(now.Load())) }
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, func(c *offload.Config) {
		c.Now = clock
		c.HitPendingTimeout = offload.Duration(5 * time.Second)
	}, tier)
	ks := keys(1, 1)
	tier.Answer(ks[0], offload.Retry)
	req := h.newRequest("r")
	if got := h.lookups(req, ks); got[0] != offload.Retry {
		t.Fatalf("first lookup = %v, want retry", got[0])
	}
	if d := h.m.NextDeadline(); !d.Equal(base.Add(5 * time.Second)) {
		t.Errorf("NextDeadline = %v, want the bound at %v (the manager's time plus hit_pending_timeout)", d, base.Add(5*time.Second))
	}
	now.Store(int64(4 * time.Second))
	if got := h.lookups(req, ks); got[0] != offload.Retry {
		t.Fatalf("lookup 4 s later = %v, want retry (the bound is 5 s)", got[0])
	}
	now.Store(int64(5 * time.Second))
	if got := h.lookups(req, ks); got[0] != offload.Miss {
		t.Fatalf("lookup 5 s later = %v, want miss (S4.7)", got[0])
	}
	if n := h.m.Metrics().RetryTimeouts; n != 1 {
		t.Errorf("retry timeouts = %d, want 1", n)
	}
	h.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	if d := h.m.NextDeadline(); !d.IsZero() {
		t.Errorf("NextDeadline after the request = %v, want zero (nothing armed)", d)
	}
}
