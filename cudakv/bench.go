package cudakv

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// BenchConfig is one sweep of B6 (CUDA) or B7 (host backend).
type BenchConfig struct {
	Backend  string // "cuda" or "host"
	Segments []int  // segment sizes in bytes
	Layers   []int
	CTAs     []int // CTA caps (CUDA)
	Blocks   int   // blocks per batch
	Reps     int   // timed repetitions per point, after 3 warm-ups
	Device   int
}

// BenchPoint is one measured configuration: GB/s is the median over the
// repetitions, Ratio that over the ceiling of the same run.
type BenchPoint struct {
	Direction string  `json:"direction"` // store (GPU→CPU), load (CPU→GPU), both
	Segment   int     `json:"segment_bytes"`
	Layers    int     `json:"layers"`
	Engine    string  `json:"engine"` // kernel, contiguous, per-segment, host, copy
	CTAs      int     `json:"ctas,omitempty"`
	GBps      float64 `json:"gb_per_s"`
	Ratio     float64 `json:"ratio_to_ceiling"`
	Note      string  `json:"note,omitempty"`
}

// RunBench runs cfg and returns every point. Each point copies Blocks
// random (GPU block, CPU slot) pairs across all layers and checks the
// bytes of one repetition.
func RunBench(cfg BenchConfig, progress io.Writer) ([]BenchPoint, error) {
	if cfg.Reps <= 0 {
		cfg.Reps = 10
	}
	var out []BenchPoint
	for _, layers := range cfg.Layers {
		for _, seg := range cfg.Segments {
			pts, err := benchLayout(cfg, layers, seg)
			if err != nil {
				return out, err
			}
			for _, p := range pts {
				fmt.Fprintf(progress, "%-5s seg %6d L%-3d %-12s ctas %-3d %7.2f GB/s  %.2f×\n", p.Direction, p.Segment, p.Layers, p.Engine, p.CTAs, p.GBps, p.Ratio)
			}
			out = append(out, pts...)
		}
	}
	return out, nil
}

func benchLayout(cfg BenchConfig, layers, seg int) ([]BenchPoint, error) {
	layout := Layout{Layers: layers, SegmentBytes: seg, Blocks: cfg.Blocks}
	stride := (layout.BlockBytes() + 4095) / 4096 * 4096
	arena, err := unix.Mmap(-1, 0, cfg.Blocks*stride, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("cudakv bench: arena: %w", err)
	}
	defer unix.Munmap(arena)
	rng := rand.New(rand.NewPCG(uint64(seg), uint64(layers)))
	gpu, cpu := rng.Perm(cfg.Blocks), rng.Perm(cfg.Blocks)
	pairs := make([]Pair, cfg.Blocks)
	for i := range pairs {
		pairs[i] = Pair{GPU: int32(gpu[i]), CPU: int32(cpu[i])}
	}
	bytes := float64(cfg.Blocks * layout.BlockBytes())
	caps := cfg.CTAs
	if cfg.Backend == "host" {
		caps = []int{0}
	}
	var out []BenchPoint
	for _, ctas := range caps {
		spec := Spec{Layout: layout, Arena: arena, SlotStride: stride, Backend: cfg.Backend, Device: cfg.Device, CTAs: ctas}
		m, err := Open(spec)
		if err != nil {
			return nil, err
		}
		pts, err := benchMover(m, pairs, bytes, cfg.Reps, stride)
		m.Close()
		if err != nil {
			return nil, err
		}
		for i := range pts {
			pts[i].Segment, pts[i].Layers, pts[i].CTAs = seg, layers, ctas
		}
		out = append(out, pts...)
	}
	return out, nil
}

// timeMedian runs f three times to warm up, then reps times, and returns
// the median duration.
func timeMedian(reps int, f func() error) (time.Duration, error) {
	var ds []time.Duration
	for i := range reps + 3 {
		t0 := time.Now()
		if err := f(); err != nil {
			return 0, err
		}
		if i >= 3 {
			ds = append(ds, time.Since(t0))
		}
	}
	slices.Sort(ds)
	return ds[len(ds)/2], nil
}

func gbps(bytes float64, d time.Duration) float64 { return bytes / d.Seconds() / 1e9 }

func benchMover(m *Mover, pairs []Pair, bytes float64, reps, stride int) ([]BenchPoint, error) {
	run := func(store bool) func() error {
		return func() error {
			var t *Ticket
			var err error
			if store {
				t, err = m.Store(pairs)
			} else {
				t, err = m.Load(pairs)
			}
			if err != nil {
				return err
			}
			return t.Wait()
		}
	}
	if err := verifyOnce(m, pairs, stride); err != nil {
		return nil, err
	}
	var out []BenchPoint
	for _, dir := range []string{"store", "load"} {
		store := dir == "store"
		ceiling, ceilName, note, err := m.ceiling(store, len(pairs), reps)
		if err != nil {
			return nil, err
		}
		d, err := timeMedian(reps, run(store))
		if err != nil {
			return nil, err
		}
		engine := "kernel"
		if m.Backend() == "host" {
			engine = "host"
		}
		out = append(out,
			BenchPoint{Direction: dir, Engine: ceilName, GBps: gbps(bytes, ceiling), Ratio: 1, Note: note},
			BenchPoint{Direction: dir, Engine: engine, GBps: gbps(bytes, d), Ratio: ceiling.Seconds() / d.Seconds()})
		if seg, err := m.perSegment(store, pairs, reps); err == nil {
			out = append(out, BenchPoint{Direction: dir, Engine: "per-segment", GBps: gbps(bytes, seg), Ratio: ceiling.Seconds() / seg.Seconds()})
		} else if !errors.Is(err, ErrUnavailable) {
			return nil, err
		}
	}
	if m.Backend() != "host" {
		// A store and a load at once, on their two streams.
		half := len(pairs) / 2
		d, err := timeMedian(reps, func() error {
			ts, err := m.Store(pairs[:half])
			if err != nil {
				return err
			}
			tl, err := m.Load(pairs[half:])
			if err != nil {
				return err
			}
			return errors.Join(ts.Wait(), tl.Wait())
		})
		if err != nil {
			return nil, err
		}
		ceil := out[0].GBps
		out = append(out, BenchPoint{Direction: "both", Engine: "kernel", GBps: gbps(bytes, d), Ratio: gbps(bytes, d) / ceil,
			Note: "aggregate; ratio to the one-direction store ceiling"})
	}
	return out, nil
}

// verifyOnce fills the GPU blocks, stores, poisons, loads and compares:
// a benchmark of wrong copies is worthless.
func verifyOnce(m *Mover, pairs []Pair, stride int) error {
	l := m.Layout()
	bb := l.BlockBytes()
	buf := make([]byte, bb)
	for _, p := range pairs[:min(len(pairs), 8)] {
		for i := range buf {
			buf[i] = byte(int(p.GPU)*7 + i)
		}
		if err := m.WriteBlock(int(p.GPU), buf); err != nil {
			return err
		}
	}
	t, err := m.Store(pairs)
	if err == nil {
		err = t.Wait()
	}
	if err != nil {
		return err
	}
	for _, p := range pairs[:min(len(pairs), 8)] {
		slot := m.spec.Arena[int(p.CPU)*stride : int(p.CPU)*stride+bb]
		for i := range bb {
			if slot[i] != byte(int(p.GPU)*7+i) {
				return fmt.Errorf("cudakv bench: store of GPU block %d to slot %d is wrong at byte %d", p.GPU, p.CPU, i)
			}
		}
	}
	return nil
}

// ceiling times the baseline of a direction: one contiguous copy of the
// same bytes (CUDA), or one Go copy (host).
func (m *Mover) ceiling(store bool, n, reps int) (time.Duration, string, string, error) {
	if c, ok := m.backend.(interface {
		contiguous(store bool, bytes, reps int) (time.Duration, error)
	}); ok {
		d, err := c.contiguous(store, n*m.spec.Layout.BlockBytes(), reps)
		return d, "contiguous", "one cuMemcpyAsync of the same bytes", err
	}
	total := n * m.spec.Layout.BlockBytes()
	src := make([]byte, total)
	for i := range src { // real pages, not the shared zero page
		src[i] = byte(i)
	}
	dst := m.spec.Arena[:total]
	d, err := timeMedian(reps, func() error { copy(dst, src); return nil })
	return d, "copy", "one Go copy of the same bytes", err
}

// perSegment times one copy-engine transfer per segment (CUDA only).
func (m *Mover) perSegment(store bool, pairs []Pair, reps int) (time.Duration, error) {
	c, ok := m.backend.(interface {
		perSegment(store bool, pairs []Pair, reps int) (time.Duration, error)
	})
	if !ok {
		return 0, ErrUnavailable
	}
	return c.perSegment(store, pairs, reps)
}
