package offload

import (
	"context"
	"slices"
	"testing"
)

// S1.2: a read pin that records no use (a cascade's, a lease's, a scrub's:
// Pin with access false) leaves the policy's recency as it was. With LRU,
// pinning took the key off the evictable list and unpinning put it back at
// the most recent end, so a block a cascade or a scrub merely read
// outlived blocks used after it.
func TestReadPinKeepsRecency(t *testing.T) {
	for _, policy := range []string{"lru", "arc"} {
		t.Run(policy, func(t *testing.T) {
			c := newTestCPU(t, 2, policy)
			ks := testKeys(3)
			for _, k := range ks[:2] { // ks[0] least recently used
				if _, _, _, ok := c.Reserve([]Key{k}, writer); !ok {
					t.Fatal("Reserve failed")
				}
				c.Commit([]Key{k}, writer, true, nil)
			}
			reader := JobOwner(7)
			if _, err := c.Pin(ks[:1], reader, false); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Unpin(ks[:1], reader); err != nil {
				t.Fatal(err)
			}
			_, _, ev, ok := c.Reserve(ks[2:], writer)
			if !ok || len(ev) != 1 || ev[0] != ks[0] {
				t.Errorf("evicted %v, want the least recently used key %v (a read pin is no use)", ev, ks[0])
			}
		})
	}
}

// S1.2, S7.2: a scrub reads every block; it must not reorder the CPU
// tier's recency. Here a block stored while the scrub read the older one
// was evicted before it, because the scrub's unpin made the older block
// the most recent.
func TestScrubKeepsRecency(t *testing.T) {
	m := testManager(t, 2)
	ks := testKeys(3)
	w := &Request{ID: "w"}
	m.Do(func(s *Step) {
		s.OnNewRequest(w)
		p, _ := s.PrepareStore(ks[:1], w)
		fill(m.Arena().Slot(int(p.Slots[0])), ks[0])
		s.CompleteStore(p.Keys, w, true)
	})
	var later *StorePlan
	m.Do(func(s *Step) { later, _ = s.PrepareStore(ks[1:2], w) })
	testHookScrubRead = func() { // while the scrub reads ks[0], ks[1] lands
		testHookScrubRead = nil
		fill(m.Arena().Slot(int(later.Slots[0])), ks[1])
		m.Do(func(s *Step) { s.CompleteStore(later.Keys, w, true) })
	}
	t.Cleanup(func() { testHookScrubRead = nil })
	if res, err := m.Scrub(context.Background()); err != nil || res.Checked != 1 {
		t.Fatalf("Scrub = %+v, %v; want one block checked", res, err)
	}
	r := &Request{ID: "r"}
	m.Do(func(s *Step) {
		s.OnNewRequest(r)
		p, err := s.PrepareStore(ks[2:], r)
		if err != nil || p == nil {
			t.Fatalf("PrepareStore: %v %v", p, err)
		}
		if len(p.Evicted) != 1 || p.Evicted[0] != ks[0] {
			t.Errorf("evicted %v, want %v, stored before the block that landed during the scrub", p.Evicted, ks[0])
		}
		s.CompleteStore(p.Keys, r, false)
		s.OnRequestFinished(r)
		s.OnRequestFinished(w)
	})
}

// S2.9: a request that ends — aborted, or finished — in the step that
// queued its Retry answers has them dropped: no Prober tier is handed a
// probe for a request it was already told has finished.
func TestNoProbeAfterEnd(t *testing.T) {
	for _, end := range []string{"abort", "finish"} {
		t.Run(end, func(t *testing.T) {
			pt := &probeTier{}
			m := testManager(t, 4, TierSpec{Name: "peer", Locality: Remote, New: func(TierEnv) (Tier, error) { return pt, nil }})
			ks := testKeys(2)
			a, b := &Request{ID: "a"}, &Request{ID: "b"}
			m.Do(func(s *Step) {
				s.OnNewRequest(a)
				s.OnNewRequest(b)
				s.Lookup(ks[0], a)
				s.Lookup(ks[1], b)
				if end == "abort" {
					s.Abort(a)
				} else {
					s.OnRequestFinished(a)
				}
			})
			if !slices.Equal(pt.reqs, []string{"b"}) {
				t.Errorf("probed for %v, want only [b] (a ended before the step's end)", pt.reqs)
			}
		})
	}
}

// servingTier registers a request of its own in Serve, as the P2P tier
// does for a peer's lookup, and keeps the EngineBusy it was given.
type servingTier struct {
	nullTier
	busy  func() bool
	serve *Request // registered at the next Serve
}

func (t *servingTier) Serve(p Parent) error {
	if t.serve != nil {
		p.OnNewRequest(t.serve)
		t.serve = nil
	}
	return nil
}

// Issue 12: EngineBusy (the P2P tier's bulk_concurrency default) says
// whether the engine has requests of its own in flight: from a step's
// OnNewRequest until the request is finalized — finished with no store
// pending, or aborted — and never for a request a tier registered.
func TestEngineBusy(t *testing.T) {
	st := &servingTier{}
	m := testManager(t, 4, TierSpec{Name: "peer", Locality: Remote, New: func(env TierEnv) (Tier, error) {
		st.busy = env.EngineBusy
		return st, nil
	}})
	check := func(when string, want bool) {
		t.Helper()
		if got := st.busy(); got != want || m.EngineBusy() != want {
			t.Errorf("%s: EngineBusy %v (the tier's %v), want %v", when, m.EngineBusy(), got, want)
		}
	}
	check("new", false)
	st.serve = &Request{ID: "peer-lookup"}
	m.Do(func(s *Step) {}) // a step services the tier
	if st.serve != nil {
		t.Fatal("the tier was not served")
	}
	check("a tier's request registered", false)

	a, b := &Request{ID: "a"}, &Request{ID: "b"}
	m.Do(func(s *Step) { s.OnNewRequest(a); s.OnNewRequest(b) })
	check("two requests", true)
	m.Do(func(s *Step) { s.Abort(a) })
	check("one aborted", true)
	var plan *StorePlan
	m.Do(func(s *Step) {
		var err error
		if plan, err = s.PrepareStore(testKeys(1), b); err != nil {
			t.Fatal(err)
		}
		s.OnRequestFinished(b)
	})
	check("finished with a store pending", true)
	m.Do(func(s *Step) { s.CompleteStore(plan.Keys, b, true) })
	check("its store completed", false)
	m.Do(func(s *Step) { s.Abort(a) })
	check("aborted twice", false)
}
