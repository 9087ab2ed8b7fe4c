package offload

import (
	"slices"
	"testing"
)

// probeTier answers Retry for every key and records what it is asked to
// find out (Prober).
type probeTier struct {
	nullTier
	probed [][]Key
	reqs   []string
}

func (p *probeTier) Lookup(Key, *Request) Result { return Retry }
func (p *probeTier) Probe(req *Request, keys []Key) {
	p.probed = append(p.probed, slices.Clone(keys))
	p.reqs = append(p.reqs, req.ID)
}

// Issue 13: lookups are pure; a Prober tier learns what to find out in
// one batch per request, in lookup order, when the step ends — not while
// the engine still looks keys up.
func TestProbesAtStepEnd(t *testing.T) {
	pt := &probeTier{}
	m := testManager(t, 4, TierSpec{Name: "peer", Locality: Remote, New: func(TierEnv) (Tier, error) { return pt, nil }})
	ks := testKeys(3)
	a, b := &Request{ID: "a"}, &Request{ID: "b"}
	m.Do(func(s *Step) {
		s.OnNewRequest(a)
		s.OnNewRequest(b)
	})
	s := m.Begin()
	s.Lookup(ks[0], a)
	s.Lookup(ks[1], a)
	s.Lookup(ks[2], b)
	if len(pt.probed) != 0 {
		t.Fatalf("probed %v while the step still looks up", pt.probed)
	}
	s.OnScheduleEnd()
	if want := [][]Key{ks[:2], ks[2:]}; !slices.EqualFunc(pt.probed, want, slices.Equal) || !slices.Equal(pt.reqs, []string{"a", "b"}) {
		t.Errorf("probes %v for %v, want %v for [a b]", pt.probed, pt.reqs, want)
	}
	m.Begin().OnScheduleEnd()
	if len(pt.probed) != 2 {
		t.Errorf("an empty step probed again: %v", pt.probed[2:])
	}
}
