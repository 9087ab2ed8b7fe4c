package offload

import (
	"slices"
	"testing"
	"testing/synctest"
	"time"
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

// nopProber answers Retry for every key and counts its Probe calls.
type nopProber struct {
	nullTier
	calls, keys int
}

func (p *nopProber) Lookup(Key, *Request) Result { return Retry }
func (p *nopProber) Probe(req *Request, keys []Key) {
	p.calls++
	p.keys += len(keys)
}

func proberSpec(name string, p *nopProber) TierSpec {
	return TierSpec{Name: name, Locality: Remote, New: func(TierEnv) (Tier, error) { return p, nil }}
}

// B5 (found in review): a step whose lookups a Prober tier answers Retry
// allocates nothing per key once warm — also past a few thousand such
// answers (100 requests of 64 blocks waiting on their peer).
func TestProbeStepAllocs(t *testing.T) {
	for _, n := range []int{1024, 5000} {
		p := &nopProber{}
		m := testManager(t, 4, proberSpec("peer", p))
		ks := testKeys(n)
		req := &Request{ID: "r"}
		m.Do(func(s *Step) { s.OnNewRequest(req) })
		step := func() {
			s := m.Begin()
			for _, k := range ks {
				s.Lookup(k, req)
			}
			s.OnScheduleEnd()
		}
		step() // warm: deadlines, the probe list
		if a := testing.AllocsPerRun(20, step); a > 1 {
			t.Errorf("a warm step of %d Retry lookups allocates %v times, want at most 1 (the Step)", n, a)
		}
	}
}

// One Probe per (tier, request) in a pass (found in review): with two
// Prober tiers, and with two requests' lookups interleaved.
func TestProbeCallsPerRequest(t *testing.T) {
	p0, p1 := &nopProber{}, &nopProber{}
	m := testManager(t, 4, proberSpec("peer0", p0), proberSpec("peer1", p1))
	ks := testKeys(8)
	a, b := &Request{ID: "a"}, &Request{ID: "b"}
	m.Do(func(s *Step) {
		s.OnNewRequest(a)
		s.OnNewRequest(b)
		for _, k := range ks {
			s.Lookup(k, a)
			s.Lookup(k, b)
		}
	})
	if p0.calls != 2 || p1.calls != 2 || p0.keys != 16 || p1.keys != 16 {
		t.Errorf("Probe calls %d and %d with %d and %d keys, want 2 and 2 with 16 each", p0.calls, p1.calls, p0.keys, p1.keys)
	}
}

// serverTier looks keys up through its Parent once, as a peer's lookup
// would, and finishes that request at its next Serve (a request finished
// in the pass that looked up has its probes dropped, S2.9).
type serverTier struct {
	nullTier
	keys []Key
	open *Request
}

func (s *serverTier) Serve(p Parent) error {
	if s.open != nil {
		p.OnRequestFinished(s.open)
		s.open = nil
	}
	if s.keys == nil {
		return nil
	}
	s.open = &Request{ID: "outside"}
	p.OnNewRequest(s.open)
	for _, k := range s.keys {
		p.Lookup(k, s.open)
	}
	s.keys = nil
	return nil
}

// Retry answers of lookups made in a poll pass's Serve, for a Prober tier
// the poll goroutine does not service (found in review): they wait for
// the next step, which hands them over, and the pass signals progress so
// that a sleeping engine steps (HasPendingWork counts them too; here the
// two-tier keep-alive of S3.4 would say true anyway).
func TestProbesFromServe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := &nopProber{}
		srv := &serverTier{keys: testKeys(3)}
		var wake func()
		m := testManager(t, 4,
			TierSpec{Name: "server", Locality: Remote, Polled: true, New: func(env TierEnv) (Tier, error) { wake = env.Wake; return srv, nil }},
			proberSpec("peer", p))
		for len(m.Progress()) > 0 {
			<-m.Progress()
		}
		wake()
		synctest.Wait()
		m.mu.Lock()
		held := len(m.mu.probes)
		m.mu.Unlock()
		if p.calls != 0 || held != 3 || len(m.Progress()) == 0 {
			t.Fatalf("after the poll pass: %d Probe calls, %d probes held, progress %v; want 0, 3, signalled", p.calls, held, len(m.Progress()) > 0)
		}
		m.Begin().OnScheduleEnd()
		m.mu.Lock()
		held = len(m.mu.probes)
		m.mu.Unlock()
		if p.calls != 1 || p.keys != 3 || held != 0 {
			t.Errorf("after a step: %d Probe calls with %d keys, %d held; want 1, 3, 0", p.calls, p.keys, held)
		}
	})
}

// S3.1 (found in review): when the last request with a HitPending/Retry
// deadline finishes, the clock is no longer armed for it.
func TestNoDeadlineAfterFinish(t *testing.T) {
	m := testManager(t, 4, proberSpec("peer", &nopProber{}))
	req := &Request{ID: "r"}
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		s.Lookup(testKeys(1)[0], req)
	})
	if m.NextDeadline().IsZero() {
		t.Fatal("no deadline armed for an unsettled lookup")
	}
	m.Do(func(s *Step) { s.OnRequestFinished(req) })
	if d := m.NextDeadline(); !d.IsZero() {
		t.Errorf("idle manager, no request: clock armed for %v from now", time.Until(d).Round(time.Second))
	}
}
