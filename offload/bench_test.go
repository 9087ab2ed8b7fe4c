package offload

import (
	"strconv"
	"testing"
	"time"
)

var sink int32

// BenchmarkLookup is B5: Manager.Lookup per key, for hits and for misses
// that also ask one secondary tier (an empty one), beside a plain map lookup of the same keys
// in the same run. It reports ns per lookup for both and their ratio
// (x-map, target ≤ 3). Each iteration is one step of 1024 lookups, so
// allocs/op counts the step's one allocation (the Step); TestLookupAllocs
// checks that a lookup itself allocates nothing.
func BenchmarkLookup(b *testing.B) {
	for _, hit := range []bool{true, false} {
		name := map[bool]string{true: "hit", false: "miss"}[hit]
		b.Run(name, func(b *testing.B) {
			const n = 1024
			cfg := DefaultConfig()
			cfg.Geometry = Geometries["tiny"]
			cfg.CPUBytes = int64(2 * n * cfg.slotStride())
			m, err := New(cfg, nullSpec("null", Local))
			if err != nil {
				b.Fatal(err)
			}
			defer m.Close()
			// Both the CPU tier and the map hold n keys; misses look up n
			// other keys.
			all := testKeys(2 * n)
			stored, ks := all[:n], all[:n]
			if !hit {
				ks = all[n:]
			}
			req := &Request{ID: "bench"}
			m.Do(func(s *Step) {
				s.OnNewRequest(req)
				p, _ := s.PrepareStore(stored, req)
				s.CompleteStore(p.Keys, req, true)
			})
			baseline := make(map[Key]int32, n)
			for i, k := range stored {
				baseline[k] = int32(i)
			}
			var mgr, base time.Duration
			b.ReportAllocs()
			for b.Loop() {
				// One engine step looks every key up once; only the
				// lookups are timed.
				s := m.Begin()
				t0 := time.Now()
				for _, k := range ks {
					if s.Lookup(k, req) == Hit {
						sink++
					}
				}
				mgr += time.Since(t0)
				s.OnScheduleEnd()
				t1 := time.Now()
				for _, k := range ks {
					if _, ok := baseline[k]; ok {
						sink++
					}
				}
				base += time.Since(t1)
			}
			per := float64(b.N * n)
			b.ReportMetric(float64(mgr.Nanoseconds())/per, "ns/lookup")
			b.ReportMetric(float64(base.Nanoseconds())/per, "ns/map")
			b.ReportMetric(float64(mgr)/float64(base), "x-map")
		})
	}
}

// BenchmarkEventsCost is issue 14's events cost: the store path
// (PrepareStore and CompleteStore of a 16-block prompt with its chain,
// into a full CPU tier, so every store also evicts and emits a removal)
// and B5's hit path (Lookup of 1024 ready keys), each on two managers in
// the same run — one with no subscriber, one with a subscriber drained
// after every iteration as a follower would — timed alternately, the two
// managers swapping roles every iteration. It reports ns
// per store and per lookup for both and the ratios (x-store, x-hit;
// targets ≤ 1.03 and ≤ 1.05).
func BenchmarkEventsCost(b *testing.B) {
	const (
		blocks = 16
		hits   = 1024
	)
	newM := func() *Manager {
		cfg := DefaultConfig()
		cfg.Geometry = Geometries["tiny"]
		cfg.CPUHugePages = false
		cfg.CPUBytes = int64(2 * hits * cfg.slotStride())
		m, err := New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { m.Close() })
		return m
	}
	ms := [2]*Manager{newM(), newM()}
	tokens := make([]uint32, 1<<16*blocks)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	hitKeys := testKeys(hits)
	hitReq := &Request{ID: "hits"}
	for _, m := range ms {
		m.Do(func(s *Step) {
			s.OnNewRequest(hitReq)
			p, _ := s.PrepareStore(hitKeys, hitReq)
			s.CompleteStore(p.Keys, hitReq, true)
		})
	}
	// Chains of distinct prompts, built before timing.
	chains := make([]*Chain, 256)
	for i := range chains {
		chains[i] = NewChain(KeyScheme{Seed: DefaultHashSeed}, 16, tokens[i*16*blocks:(i+1)*16*blocks])
	}
	var store, hit [2]time.Duration
	n := 0
	storeOnce := func(m *Manager, c *Chain, id string) time.Duration {
		req := &Request{ID: id, Chain: c}
		t0 := time.Now()
		m.Do(func(s *Step) {
			s.OnNewRequest(req)
			p, _ := s.PrepareStore(c.Keys, req)
			if p != nil {
				s.CompleteStore(p.Keys, req, true)
			}
			s.OnRequestFinished(req)
		})
		return time.Since(t0)
	}
	lookupOnce := func(m *Manager) time.Duration {
		s := m.Begin()
		t0 := time.Now()
		for _, k := range hitKeys {
			if s.Lookup(k, hitReq) == Hit {
				sink++
			}
		}
		d := time.Since(t0)
		s.OnScheduleEnd()
		return d
	}
	var sub *Subscription
	for b.Loop() {
		// The managers swap roles each iteration (the subscription moves,
		// untimed), so neither's own layout biases the ratio.
		plain, followed := ms[n%2], ms[1-n%2]
		if sub != nil {
			sub.Close()
		}
		sub = followed.Subscribe(0)
		c := chains[n%len(chains)]
		id := "s" + strconv.Itoa(n)
		if n%4 < 2 {
			store[0] += storeOnce(plain, c, id)
			store[1] += storeOnce(followed, c, id)
			hit[0] += lookupOnce(plain)
			hit[1] += lookupOnce(followed)
		} else {
			store[1] += storeOnce(followed, c, id)
			store[0] += storeOnce(plain, c, id)
			hit[1] += lookupOnce(followed)
			hit[0] += lookupOnce(plain)
		}
		sub.Take()
		n++
	}
	sub.Close()
	b.ReportMetric(float64(store[0].Nanoseconds())/float64(n), "ns/store")
	b.ReportMetric(float64(store[1].Nanoseconds())/float64(n), "ns/store-followed")
	b.ReportMetric(float64(store[1])/float64(store[0]), "x-store")
	b.ReportMetric(float64(hit[0].Nanoseconds())/float64(n*hits), "ns/hit")
	b.ReportMetric(float64(hit[1].Nanoseconds())/float64(n*hits), "ns/hit-followed")
	b.ReportMetric(float64(hit[1])/float64(hit[0]), "x-hit")
}
