package offload

import (
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
