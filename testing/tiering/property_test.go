package tiering

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

// A property test of the manager against a naive model under random
// operation sequences (S1.2, S2.3, S2.4, S2.9): the pins the model says
// requests hold are exactly the pins the CPU tier reports (so pinned blocks
// are never evicted), blocks being stored stay hit_pending, slot counts add
// up, and at the end every pin is released and nothing is left pending.
func TestManagerProperty(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { runManagerProperty(t, seed) })
	}
}

type pinRec struct {
	Owner string
	Key   offload.Key
}

func runManagerProperty(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 99))
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 8, nil, tier)
	universe := keys(7, 20)
	type store struct {
		req  *offload.Request
		keys []offload.Key
	}
	type load store
	var (
		reqs   []*offload.Request
		stores []store
		loads  []load
		nextID int
	)
	newRequest := func() {
		reqs = append(reqs, h.newRequest(fmt.Sprintf("r%d", nextID)))
		nextID++
	}
	for range 3 {
		newRequest()
	}
	pick := func() []offload.Key {
		n := 1 + rng.IntN(3)
		var ks []offload.Key
		for range n {
			if k := universe[rng.IntN(len(universe))]; !slices.Contains(ks, k) {
				ks = append(ks, k)
			}
		}
		return ks
	}
	for i, k := range universe {
		if i%3 == 0 {
			tier.Put(k, h.block(k))
		}
	}
	for step := range 3000 {
		req := reqs[rng.IntN(len(reqs))]
		switch op := rng.IntN(9); op {
		case 0: // prepare a store
			ks := pick()
			h.m.Do(func(s *offload.Step) {
				plan, err := s.PrepareStore(ks, req)
				if err != nil {
					t.Fatalf("step %d: PrepareStore: %v", step, err)
				}
				if plan != nil && len(plan.Keys) > 0 {
					for i, k := range plan.Keys {
						copy(h.m.Arena().Slot(int(plan.Slots[i])), h.block(k))
					}
					stores = append(stores, store{req, plan.Keys})
				}
			})
		case 1: // complete a store
			if len(stores) == 0 {
				continue
			}
			i := rng.IntN(len(stores))
			st := stores[i]
			stores = slices.Delete(stores, i, i+1)
			h.m.Do(func(s *offload.Step) {
				if err := s.CompleteStore(st.keys, st.req, rng.IntN(5) > 0); err != nil {
					t.Fatalf("step %d: CompleteStore: %v", step, err)
				}
			})
		case 2: // look up, and load the leading hits in the same step
			ks := pick()
			h.step(func(s *offload.Step) {
				var hits []offload.Key
				for _, k := range ks {
					if s.Lookup(k, req) != offload.Hit {
						break
					}
					hits = append(hits, k)
				}
				if len(hits) == 0 {
					return
				}
				if _, err := s.PrepareLoad(hits, req); err != nil {
					t.Fatalf("step %d: PrepareLoad of hits: %v", step, err)
				}
				loads = append(loads, load{req, hits})
			})
		case 3: // complete a load
			if len(loads) == 0 {
				continue
			}
			i := rng.IntN(len(loads))
			l := loads[i]
			loads = slices.Delete(loads, i, i+1)
			h.load2(t, step, l.req, l.keys)
		case 4: // abort: the request's pins go at once
			h.m.Do(func(s *offload.Step) { s.Abort(req) })
			loads = slices.DeleteFunc(loads, func(l load) bool { return l.req == req })
			reqs = slices.DeleteFunc(reqs, func(r *offload.Request) bool { return r == req })
			newRequest()
		case 5: // finish: loads and stores may still complete afterwards
			h.m.Do(func(s *offload.Step) {
				if err := s.OnRequestFinished(req); err != nil {
					t.Fatalf("step %d: OnRequestFinished: %v", step, err)
				}
			})
			reqs = slices.DeleteFunc(reqs, func(r *offload.Request) bool { return r == req })
			newRequest()
		case 6:
			tier.Hold(rng.IntN(2) == 0)
		case 7:
			if held := tier.Held(); len(held) > 0 {
				tier.Release(held[rng.IntN(len(held))], rng.IntN(4) > 0)
			}
		case 8:
			h.step(func(s *offload.Step) {})
		}
		checkModel(t, h, step, loads2pins(loads, func(l load) (string, []offload.Key) { return l.req.ID, l.keys }), storeKeys(stores, func(s store) []offload.Key { return s.keys }))
	}
	// Drain everything.
	for _, l := range loads {
		h.load2(t, -1, l.req, l.keys)
	}
	for _, st := range stores {
		h.m.Do(func(s *offload.Step) { s.CompleteStore(st.keys, st.req, true) })
	}
	tier.Hold(false)
	for _, id := range tier.Held() {
		tier.Release(id, true)
	}
	for _, r := range reqs {
		h.m.Do(func(s *offload.Step) { s.OnRequestFinished(r) })
	}
	h.step(func(s *offload.Step) {})
	h.step(func(s *offload.Step) {})
	if p := h.m.Audit(0); len(p) != 0 {
		t.Errorf("pins left at the end: %v", p)
	}
	m := h.m.Metrics()
	if m.CPU.Writing != 0 || m.CPU.Pinned != 0 || m.Requests != 0 || h.m.HasPendingWork() {
		t.Errorf("at the end: writing %d, pinned %d, requests %d, pending work %v; want all zero",
			m.CPU.Writing, m.CPU.Pinned, m.Requests, h.m.HasPendingWork())
	}
	if n := m.Errors["not_ready"] + m.Errors["not_pinned"] + m.Errors["unknown_job"]; n != 0 {
		t.Errorf("errors counted: %v", m.Errors)
	}
}

func loads2pins[L any](ls []L, f func(L) (string, []offload.Key)) []pinRec {
	var out []pinRec
	for _, l := range ls {
		id, ks := f(l)
		for _, k := range ks {
			out = append(out, pinRec{"request " + id, k})
		}
	}
	return out
}

func storeKeys[S any](ss []S, f func(S) []offload.Key) []offload.Key {
	var out []offload.Key
	for _, s := range ss {
		out = append(out, f(s)...)
	}
	return out
}

func sortPins(p []pinRec) {
	slices.SortFunc(p, func(a, b pinRec) int {
		if a.Owner != b.Owner {
			return map[bool]int{true: -1, false: 1}[a.Owner < b.Owner]
		}
		return slices.Compare(a.Key[:], b.Key[:])
	})
}

func checkModel(t *testing.T, h *harness, step int, wantPins []pinRec, writing []offload.Key) {
	t.Helper()
	var got []pinRec
	for _, p := range h.m.Audit(0) {
		if p.Owner.Req != "" {
			got = append(got, pinRec{p.Owner.String(), p.Key})
		}
	}
	sortPins(got)
	sortPins(wantPins)
	if diff := cmp.Diff(wantPins, got); diff != "" {
		t.Fatalf("step %d: request pins (-model +manager):\n%s", step, diff)
	}
	m := h.m.Metrics().CPU
	if m.Used > m.Slots || m.Writing < len(writing) || m.Pinned > m.Used-m.Writing {
		t.Fatalf("step %d: counts do not add up: %+v with %d keys being stored", step, m, len(writing))
	}
	h.m.Do(func(s *offload.Step) {
		probe := h.newRequestIn(s, "probe")
		defer s.Abort(probe)
		for _, k := range writing {
			if r := s.Lookup(k, probe); r != offload.HitPending {
				t.Fatalf("step %d: key %v being stored answers %v", step, k, r)
			}
		}
	})
}

// load2 verifies and completes a load prepared earlier.
func (h *harness) load2(t *testing.T, step int, req *offload.Request, ks []offload.Key) {
	h.m.Do(func(s *offload.Step) {
		if err := s.CompleteLoad(ks, req); err != nil {
			t.Fatalf("step %d: CompleteLoad: %v", step, err)
		}
	})
}
