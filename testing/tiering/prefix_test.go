package tiering

import (
	"testing"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

// LookupPrefix counts leading Hits, scans past Retry and HitPending to the
// first Miss, and reports the prefix unsettled while any of them remain.
func TestLookupPrefix(t *testing.T) {
	ks := keys(7, 5)
	tests := []struct {
		name        string
		cpu         []int // keys stored in the CPU tier
		retry, tier []int // keys the secondary tier answers Retry for, or holds
		hits        int
		settled     bool
	}{
		{name: "all hits", cpu: []int{0, 1, 2, 3, 4}, hits: 5, settled: true},
		{name: "stops at the first miss", cpu: []int{0, 1, 3}, hits: 2, settled: true},
		{name: "nothing", hits: 0, settled: true},
		{name: "retry leaves it unsettled and ends the count", cpu: []int{0, 1, 3}, retry: []int{2}, hits: 2},
		{name: "a promotion leaves it unsettled", cpu: []int{0, 2}, tier: []int{1}, hits: 1},
		{name: "retry before the miss still waits", cpu: []int{0}, retry: []int{1}, hits: 1},
		{name: "retry after the miss is not reached", cpu: []int{0}, retry: []int{2}, hits: 1, settled: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tier := fake.NewTier(offload.ChunkLevel)
			h := newHarness(t, 8, nil, tier)
			w := h.newRequest("w")
			for _, i := range tt.cpu {
				h.m.Do(func(s *offload.Step) { h.store(s, w, ks[i:i+1]) })
			}
			for _, i := range tt.retry {
				tier.Answer(ks[i], offload.Retry)
			}
			for _, i := range tt.tier {
				tier.Put(ks[i], h.block(ks[i]))
			}
			req := h.newRequest("r")
			var hits int
			var settled bool
			h.step(func(s *offload.Step) { hits, settled = s.LookupPrefix(ks, req) })
			if hits != tt.hits || settled != tt.settled {
				t.Errorf("LookupPrefix = %d, %v; want %d, %v", hits, settled, tt.hits, tt.settled)
			}
		})
	}
}
