package offload

import (
	"slices"
	"strconv"
)

// Histogram counts observations into buckets, as a Prometheus histogram:
// Counts[i] the observations ≤ Bounds[i] and above the bound before, the
// last count those above every bound. It is not safe for concurrent use:
// its owner guards it (the manager's lock, a tier's).
type Histogram struct {
	Bounds []float64 `json:"bounds"` // ascending
	Counts []uint64  `json:"counts"` // len(Bounds)+1
	Sum    float64   `json:"sum"`
	Count  uint64    `json:"count"`
}

// NewHistogram returns an empty histogram with the given upper bounds.
func NewHistogram(bounds ...float64) *Histogram {
	return &Histogram{Bounds: bounds, Counts: make([]uint64, len(bounds)+1)}
}

// Observe adds one observation.
func (h *Histogram) Observe(v float64) {
	i, _ := slices.BinarySearch(h.Bounds, v)
	h.Counts[i]++
	h.Sum += v
	h.Count++
}

// Clone returns a copy, for a snapshot.
func (h *Histogram) Clone() *Histogram {
	c := *h
	c.Counts = slices.Clone(h.Counts)
	return &c
}

// LatencyBounds are the buckets of round-trip and round latencies, in
// seconds: 100 µs to 10 s.
var LatencyBounds = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// FractionBounds are the buckets of a fraction (0 … 1).
var FractionBounds = []float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1}

// histogram writes h as the current family's samples: cumulative
// _bucket{le=…} samples, _sum and _count.
func (p *promWriter) histogram(h *Histogram, labels ...string) {
	name := p.name
	p.name = name + "_bucket"
	var cum uint64
	for i, b := range h.Bounds {
		cum += h.Counts[i]
		p.sample(float64(cum), append(slices.Clip(labels), "le", strconv.FormatFloat(b, 'g', -1, 64))...)
	}
	p.sample(float64(h.Count), append(slices.Clip(labels), "le", "+Inf")...)
	p.name = name + "_sum"
	p.sample(h.Sum, labels...)
	p.name = name + "_count"
	p.sample(float64(h.Count), labels...)
	p.name = name
}
