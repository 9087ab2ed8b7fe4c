package offload

import (
	"fmt"
	"math"
	"time"
)

// Admission decides which transfers to secondary tiers start (S2.7). It is
// asked before any pin, slot or job id is taken, so a refusal costs nothing.
// now is the manager's time (Config.Now, read once per hold of its lock):
// an Admission reads no clock of its own.
type Admission interface {
	// Admit says whether a transfer of n blocks to or from tier may start.
	Admit(tier, n int, promotion bool, now time.Time) bool
	// Completed sees every finished job, before the CPU tier is updated.
	Completed(job *Job, res JobResult, blockBytes int, now time.Time)
	// Reset forgets everything learned (cache reset).
	Reset()
	// Stats reports tier's detector, if it has one.
	Stats(tier int, now time.Time) (AdmissionStats, bool)
}

// AdmissionStats is the state of one tier's backpressure detector.
type AdmissionStats struct {
	EMA           float64 // store latency, seconds per MiB
	Pressured     bool
	DroppedStores uint64
	DroppedBlocks uint64
}

// Always admits every transfer.
type Always struct{}

func (Always) Admit(int, int, bool, time.Time) bool        { return true }
func (Always) Completed(*Job, JobResult, int, time.Time)   {}
func (Always) Reset()                                      {}
func (Always) Stats(int, time.Time) (AdmissionStats, bool) { return AdmissionStats{}, false }

// Backpressure drops cascades to a tier whose store latency (an EMA of
// seconds per MiB) rose above its high-water mark, until it falls below the
// low-water mark. Promotions and leases are always admitted, and only
// cascades feed the estimate. The estimate decays with time: it halves for
// every DecayHalfLife without a sample and never exceeds EstimateCap times
// the high-water mark, so a pressured tier that gets no stores (it is
// refused them) is admitted again within log2(EstimateCap·high/low) half
// lives, and pressure never lasts for good (S2.7).
type Backpressure struct {
	detectors []*detector
}

// Default water marks in seconds per MiB (S2.7).
const (
	LocalHighWater   = 0.005
	LocalLowWater    = 0.001
	NetworkHighWater = 0.020
	NetworkLowWater  = 0.005
)

// The decay of the backpressure estimate (S2.7): with the default marks a
// pressured tier without new samples recovers within
// log2(10 × 0.005 / 0.001) ≈ 5.6 s (local) or log2(10 × 0.020 / 0.005)
// ≈ 5.3 s (network).
const (
	// DecayHalfLife is the time in which the estimate halves without a
	// sample.
	DecayHalfLife = time.Second
	// EstimateCap bounds a sample, and so the estimate, to this many times
	// the tier's high-water mark.
	EstimateCap = 10
)

const (
	emaAlpha  = 0.3
	emaWarmup = 3
)

type detector struct {
	high, low float64
	ema       float64
	at        time.Time // when ema was last brought up to date
	samples   []float64 // during warm-up
	pressured bool
	dropped   [2]uint64 // stores, blocks
}

// NewBackpressure returns the backpressure policy for specs, with each
// tier's water marks (or the defaults for its locality).
func NewBackpressure(specs []TierSpec) (*Backpressure, error) {
	b := &Backpressure{}
	for i, s := range specs {
		high, low := LocalHighWater, LocalLowWater
		if s.Locality == Remote {
			high, low = NetworkHighWater, NetworkLowWater
		}
		if s.HighWater != 0 {
			high = s.HighWater
		}
		if s.LowWater != 0 {
			low = s.LowWater
		}
		if low <= 0 || low > high {
			return nil, fmt.Errorf("%w: tier %d (%s): backpressure marks low %g, high %g: want 0 < low ≤ high", ErrConfig, i, s.Name, low, high)
		}
		b.detectors = append(b.detectors, &detector{high: high, low: low})
	}
	return b, nil
}

func (b *Backpressure) Admit(tier, n int, promotion bool, now time.Time) bool {
	if promotion || tier >= len(b.detectors) {
		return true
	}
	d := b.detectors[tier]
	d.decay(now)
	if d.pressured {
		d.dropped[0]++
		d.dropped[1] += uint64(n)
		return false
	}
	return true
}

func (b *Backpressure) Completed(job *Job, res JobResult, blockBytes int, now time.Time) {
	if job.Promotion || job.Lease || !res.OK || job.Tier >= len(b.detectors) {
		return
	}
	bytes := res.Bytes
	if bytes <= 0 {
		bytes = int64(len(job.Keys) * blockBytes)
	}
	elapsed := res.Duration
	if elapsed <= 0 {
		elapsed = now.Sub(job.Submitted)
	}
	if bytes <= 0 {
		return
	}
	b.detectors[job.Tier].observe(elapsed.Seconds()/(float64(bytes)/(1<<20)), now)
}

// decay brings the estimate to now: it halves for every DecayHalfLife
// since it was last updated, and pressure ends once it is below the
// low-water mark.
func (d *detector) decay(now time.Time) {
	if d.at.IsZero() {
		return // warming up
	}
	if dt := now.Sub(d.at); dt > 0 {
		d.ema *= math.Exp2(-dt.Seconds() / DecayHalfLife.Seconds())
		d.at = now
	}
	if d.ema < d.low {
		d.pressured = false
	}
}

func (d *detector) observe(sample float64, now time.Time) {
	sample = min(sample, EstimateCap*d.high)
	if len(d.samples) < emaWarmup {
		d.samples = append(d.samples, sample)
		if len(d.samples) == emaWarmup {
			for _, s := range d.samples {
				d.ema += s
			}
			d.ema /= emaWarmup
			d.at = now
		}
		return
	}
	d.decay(now)
	d.ema = emaAlpha*sample + (1-emaAlpha)*d.ema
	switch {
	case d.ema > d.high:
		d.pressured = true
	case d.ema < d.low:
		d.pressured = false
	}
}

// Reset forgets what the detectors learned; the drop counts are counters
// (…_dropped_stores_total) and stay.
func (b *Backpressure) Reset() {
	for _, d := range b.detectors {
		*d = detector{high: d.high, low: d.low, dropped: d.dropped}
	}
}

// Stats returns tier's detector state.
func (b *Backpressure) Stats(tier int, now time.Time) (AdmissionStats, bool) {
	if tier >= len(b.detectors) {
		return AdmissionStats{}, false
	}
	d := b.detectors[tier]
	d.decay(now)
	return AdmissionStats{EMA: d.ema, Pressured: d.pressured, DroppedStores: d.dropped[0], DroppedBlocks: d.dropped[1]}, true
}
