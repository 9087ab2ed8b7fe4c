// Package tiering tests the tiering manager against the rules of
// SEMANTICS.md §1–§2 with fake secondary tiers.
package tiering

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

type harness struct {
	t     *testing.T
	m     *offload.Manager
	tiers []*fake.Tier
}

// newHarness builds a manager with a tiny-geometry CPU tier of slots slots
// over the given fake tiers, named t0, t1, ….
func newHarness(t *testing.T, slots int, edit func(*offload.Config), tiers ...*fake.Tier) *harness {
	t.Helper()
	var specs []offload.TierSpec
	for i, ft := range tiers {
		specs = append(specs, ft.Spec(fmt.Sprintf("t%d", i)))
	}
	h := newHarnessSpecs(t, slots, edit, specs...)
	h.tiers = tiers
	return h
}

// newHarnessSpecs is newHarness over tiers of any kind.
func newHarnessSpecs(t *testing.T, slots int, edit func(*offload.Config), specs ...offload.TierSpec) *harness {
	t.Helper()
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(slots * cfg.Geometry.BlockBytes())
	if edit != nil {
		edit(&cfg)
	}
	m, err := offload.New(cfg, specs...)
	if err != nil {
		t.Fatalf("offload.New: %v", err)
	}
	if got := m.Arena().Slots(); got != slots {
		t.Fatalf("arena has %d slots, want %d", got, slots)
	}
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return &harness{t: t, m: m}
}

// step runs fn inside one engine step.
func (h *harness) step(fn func(s *offload.Step)) {
	s := h.m.Begin()
	defer s.OnScheduleEnd()
	fn(s)
}

// keys returns n chained block keys of a sequence named by seq.
func keys(seq, n int) []offload.Key {
	tokens := make([]uint32, 16*n)
	for i := range tokens {
		tokens[i] = uint32(seq*100000 + i)
	}
	return offload.BlockKeys(offload.DefaultHashSeed, 16, tokens)
}

// block returns the bytes the harness stores for k.
func (h *harness) block(k offload.Key) []byte {
	b := make([]byte, h.m.BlockBytes())
	for i := range b {
		b[i] = k[i%len(k)] ^ byte(i)
	}
	return b
}

func newReq(id string) *offload.Request { return &offload.Request{ID: id} }

// newRequest registers a request in its own Do call.
func (h *harness) newRequest(id string) *offload.Request {
	h.t.Helper()
	req := newReq(id)
	h.m.Do(func(s *offload.Step) {
		if _, err := s.OnNewRequest(req); err != nil {
			h.t.Fatalf("OnNewRequest(%s): %v", id, err)
		}
	})
	return req
}

// newRequestIn registers a request inside s.
func (h *harness) newRequestIn(s *offload.Step, id string) *offload.Request {
	h.t.Helper()
	req := newReq(id)
	if _, err := s.OnNewRequest(req); err != nil {
		h.t.Fatalf("OnNewRequest(%s): %v", id, err)
	}
	return req
}

// store prepares, fills and completes a store of ks for req inside s.
func (h *harness) store(s *offload.Step, req *offload.Request, ks []offload.Key) *offload.StorePlan {
	h.t.Helper()
	plan, err := s.PrepareStore(ks, req)
	if err != nil || plan == nil {
		h.t.Fatalf("PrepareStore: plan %v, err %v", plan, err)
	}
	for i, k := range plan.Keys {
		copy(h.m.Arena().Slot(int(plan.Slots[i])), h.block(k))
	}
	if err := s.CompleteStore(plan.Keys, req, true); err != nil {
		h.t.Fatalf("CompleteStore: %v", err)
	}
	return plan
}

// lookups answers every key in one step.
func (h *harness) lookups(req *offload.Request, ks []offload.Key) []offload.Result {
	var out []offload.Result
	h.step(func(s *offload.Step) {
		for _, k := range ks {
			out = append(out, s.Lookup(k, req))
		}
	})
	return out
}

// load pins, verifies and unpins ks for req; every key must be a Hit.
func (h *harness) load(req *offload.Request, ks []offload.Key) {
	h.t.Helper()
	h.m.Do(func(s *offload.Step) {
		slots, err := s.PrepareLoad(ks, req)
		if err != nil {
			h.t.Fatalf("PrepareLoad: %v", err)
		}
		for i, k := range ks {
			if !bytes.Equal(h.m.Arena().Slot(int(slots[i])), h.block(k)) {
				h.t.Errorf("slot %d of key %v holds the wrong bytes", slots[i], k)
			}
		}
		if err := s.CompleteLoad(ks, req); err != nil {
			h.t.Fatalf("CompleteLoad: %v", err)
		}
	})
}

func repeat(r offload.Result, n int) []offload.Result {
	out := make([]offload.Result, n)
	for i := range out {
		out[i] = r
	}
	return out
}
