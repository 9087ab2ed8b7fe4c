package cudakv

import (
	"errors"
	"fmt"
	"hash/crc32"
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
	Threads  []int // CTA sizes (CUDA); default 256
	Blocks   int   // blocks per batch
	Reps     int   // timed repetitions per point, after 3 warm-ups
	Device   int
	// Baselines beside the ceiling (CUDA): "per-segment", "batched".
	Baselines []string
	// Checksums has stores compute each block's CRC32C (Spec.Checksums),
	// as the engine's do.
	Checksums bool
}

// BenchPoint is one measured configuration: GB/s is the median over the
// repetitions, Ratio that over the ceiling of the same run.
type BenchPoint struct {
	Direction string  `json:"direction"` // store (GPU→CPU), load (CPU→GPU), both
	Segment   int     `json:"segment_bytes"`
	Layers    int     `json:"layers"`
	Engine    string  `json:"engine"` // kernel, contiguous, per-segment, host, copy
	CTAs      int     `json:"ctas,omitempty"`
	Threads   int     `json:"threads,omitempty"`
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
			pts, err := benchLayout(cfg, layers, seg, progress)
			if err != nil {
				return out, err
			}
			for _, p := range pts {
				fmt.Fprintf(progress, "%-5s seg %6d L%-3d %-12s ctas %-3d threads %-4d %7.2f GB/s  %.2f×\n", p.Direction, p.Segment, p.Layers, p.Engine, p.CTAs, p.Threads, p.GBps, p.Ratio)
			}
			out = append(out, pts...)
		}
	}
	return out, nil
}

func benchLayout(cfg BenchConfig, layers, seg int, progress io.Writer) ([]BenchPoint, error) {
	layout := Layout{Layers: layers, SegmentBytes: seg, Blocks: cfg.Blocks}
	stride := (layout.BlockBytes() + unix.Getpagesize() - 1) / unix.Getpagesize() * unix.Getpagesize() // as offload.SlotStride (cudakv may not import offload)
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
	threads := cfg.Threads
	if len(threads) == 0 {
		threads = []int{256}
	}
	var grids []grid
	for _, ctas := range cfg.CTAs {
		for _, t := range threads {
			grids = append(grids, grid{ctas, t})
		}
	}
	if cfg.Backend == "host" || len(grids) == 0 {
		grids = []grid{{}}
	}
	m, err := Open(Spec{Layout: layout, Arena: arena, SlotStride: stride, Backend: cfg.Backend, Device: cfg.Device, CTAs: grids[0].ctas, Threads: grids[0].threads, Checksums: cfg.Checksums})
	if err != nil {
		return nil, err
	}
	defer m.Close()
	fmt.Fprintf(progress, "seg %d L%d: %s, registered %d MiB in %v\n", seg, layers, m.Backend(), len(arena)>>20, m.RegisterTime())
	out, err := benchMover(m, pairs, grids, cfg.Baselines, cfg.Reps, stride)
	for i := range out {
		out[i].Segment, out[i].Layers = seg, layers
	}
	return out, err
}

// grid is a kernel launch shape: CTAs × threads.
type grid struct{ ctas, threads int }

// baseliner is a backend with baselines beside its kernel (CUDA).
type baseliner interface {
	// baseline times engine ("contiguous", "per-segment", "batched")
	// moving the pairs' bytes; ErrUnavailable when the driver lacks it.
	baseline(engine string, store bool, pairs []Pair, reps int) (time.Duration, error)
	// duplex times two contiguous copies at once, half the bytes of n
	// blocks each way.
	duplex(n, reps int) (time.Duration, error)
	// hybrid times a store of half the pairs and a load of the other half
	// at once, one direction by m's kernel and the other by the copy
	// engines (engine: "per-segment" or "batched").
	hybrid(m *Mover, pairs []Pair, kernelStores bool, engine string, reps int) (time.Duration, error)
	setGrid(ctas, threads int)
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

// measured records a timing of bytes in p, as a rate and a ratio to
// ceiling, or notes that the engine is unavailable; other errors it
// returns.
func (p *BenchPoint) measured(d time.Duration, err error, bytes float64, ceiling time.Duration) error {
	switch {
	case errors.Is(err, ErrUnavailable):
		p.Note = err.Error()
	case err != nil:
		return err
	default:
		p.GBps, p.Ratio = gbps(bytes, d), ceiling.Seconds()/d.Seconds()
	}
	return nil
}

// benchMover measures both directions: the ceiling and the other
// baselines once, the mover at every CTA cap (the host backend has one),
// then a store and a load at once.
func benchMover(m *Mover, pairs []Pair, grids []grid, baselines []string, reps, stride int) ([]BenchPoint, error) {
	if err := verifyOnce(m, pairs, stride); err != nil {
		return nil, err
	}
	bl, isCUDA := m.backend.(baseliner)
	bytes := float64(len(pairs) * m.spec.Layout.BlockBytes())
	ratio := func(ceiling, d time.Duration) float64 { return ceiling.Seconds() / d.Seconds() }
	var out []BenchPoint
	var storeCeiling time.Duration
	for _, dir := range []string{"store", "load"} {
		store := dir == "store"
		var ceiling time.Duration
		var err error
		if isCUDA {
			ceiling, err = bl.baseline("contiguous", store, pairs, reps)
			out = append(out, BenchPoint{Direction: dir, Engine: "contiguous", Note: "one cuMemcpyAsync of the same bytes per registered GiB"})
		} else {
			ceiling, err = m.goCopy(len(pairs), reps)
			out = append(out, BenchPoint{Direction: dir, Engine: "copy", Note: "one Go copy of the same bytes"})
		}
		if err != nil {
			return nil, err
		}
		out[len(out)-1].GBps, out[len(out)-1].Ratio = gbps(bytes, ceiling), 1
		if store {
			storeCeiling = ceiling
		}
		for _, engine := range baselines {
			if !isCUDA {
				break
			}
			p := BenchPoint{Direction: dir, Engine: engine}
			d, err := bl.baseline(engine, store, pairs, reps)
			if err := p.measured(d, err, bytes, ceiling); err != nil {
				return nil, err
			}
			out = append(out, p)
		}
		for _, g := range grids {
			if isCUDA {
				bl.setGrid(g.ctas, g.threads)
			}
			if !isCUDA {
				d, err := timeMedian(reps, func() error { return m.move(store, false, pairs) })
				if err != nil {
					return nil, err
				}
				out = append(out, BenchPoint{Direction: dir, Engine: "host", GBps: gbps(bytes, d), Ratio: ratio(ceiling, d)})
				continue
			}
			// The kernel without and with its checksums, side by side at
			// each grid.
			for _, sum := range []bool{false, true} {
				d, err := timeMedian(reps, func() error { return m.move(store, sum, pairs) })
				if err != nil {
					return nil, err
				}
				p := BenchPoint{Direction: dir, Engine: "kernel", CTAs: g.ctas, Threads: g.threads, GBps: gbps(bytes, d), Ratio: ratio(ceiling, d)}
				if sum {
					p.Engine, p.Note = "kernel+crc", "kv_store_sum: the block checksums computed while copying"
					if !store {
						p.Note = "kv_load_sum: the block checksums computed while copying (a kv_digest off the load)"
					}
				}
				out = append(out, p)
			}
		}
	}
	if !isCUDA {
		return out, nil
	}
	// A store and a load at once, on their two streams (PCIe is full
	// duplex), ratios to the one-direction store ceiling; the copy engines
	// doing the same show what the link allows.
	const both = "aggregate; ratio to the one-direction store ceiling"
	d, err := bl.duplex(len(pairs), reps)
	if err != nil {
		return nil, err
	}
	out = append(out, BenchPoint{Direction: "both", Engine: "contiguous", GBps: gbps(bytes, d), Ratio: ratio(storeCeiling, d), Note: both})
	half := len(pairs) / 2
	var best grid
	var bestD time.Duration
	for _, g := range grids {
		bl.setGrid(g.ctas, g.threads)
		d, err := timeMedian(reps, func() error {
			ts, err := m.Store(pairs[:half])
			if err != nil {
				return err
			}
			tl, err := m.Load(pairs[half:])
			if err != nil {
				return errors.Join(err, ts.Wait())
			}
			return errors.Join(ts.Wait(), tl.Wait())
		})
		if err != nil {
			return nil, err
		}
		out = append(out, BenchPoint{Direction: "both", Engine: "kernel", CTAs: g.ctas, Threads: g.threads, GBps: gbps(bytes, d), Ratio: ratio(storeCeiling, d), Note: both})
		if d < bestD || bestD == 0 {
			best, bestD = g, d
		}
	}
	// Hybrids, at the grid of the fastest kernel pair: the kernel one way,
	// the copy engines the other.
	bl.setGrid(best.ctas, best.threads)
	for _, engine := range baselines {
		for _, kernelStores := range []bool{true, false} {
			name := "hyb-kst-" + engine // the kernel stores, the copy engines load
			if !kernelStores {
				name = "hyb-kld-" + engine
			}
			p := BenchPoint{Direction: "both", Engine: name, CTAs: best.ctas, Threads: best.threads, Note: both}
			d, err := bl.hybrid(m, pairs, kernelStores, engine, reps)
			if err := p.measured(d, err, bytes, storeCeiling); err != nil {
				return nil, err
			}
			out = append(out, p)
		}
	}
	return out, nil
}

// move stores or loads the pairs, with or without the blocks' checksums,
// and waits.
func (m *Mover) move(store, sum bool, pairs []Pair) error {
	var t *Ticket
	var err error
	switch {
	case store:
		on := m.spec.Checksums
		m.spec.Checksums = sum
		t, err = m.Store(pairs)
		m.spec.Checksums = on
	case sum:
		t, err = m.LoadSummed(pairs)
	default:
		t, err = m.Load(pairs)
	}
	if err != nil {
		return err
	}
	return t.Wait()
}

// verifyOnce fills the GPU blocks, stores (with checksums), and compares
// the slots and their checksums, then loads them back with checksums and
// compares those: a benchmark of wrong copies is worthless.
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
	on := m.spec.Checksums
	m.spec.Checksums = true
	t, err := m.Store(pairs)
	m.spec.Checksums = on
	if err == nil {
		err = t.Wait()
	}
	if err != nil {
		return err
	}
	stored := t.Sums()
	if t, err = m.LoadSummed(pairs); err == nil { // the same bytes back
		err = t.Wait()
	}
	if err != nil {
		return err
	}
	for _, c := range []struct {
		what string
		sums []uint32
	}{{"store", stored}, {"load", t.Sums()}} {
		if c.sums == nil {
			return fmt.Errorf("cudakv bench: the %s computed no checksums", c.what)
		}
		for i, p := range pairs {
			slot := m.spec.Arena[int(p.CPU)*stride : int(p.CPU)*stride+bb]
			if want := crc32.Checksum(slot, castagnoli); c.sums[i] != want {
				return fmt.Errorf("cudakv bench: the %s's checksum of slot %d is %08x, its bytes' %08x", c.what, p.CPU, c.sums[i], want)
			}
		}
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

// goCopy times the host backend's baseline: one Go copy of the bytes of n
// blocks.
func (m *Mover) goCopy(n, reps int) (time.Duration, error) {
	total := n * m.spec.Layout.BlockBytes()
	src := make([]byte, total)
	for i := range src { // real pages, not the shared zero page
		src[i] = byte(i)
	}
	dst := m.spec.Arena[:total]
	return timeMedian(reps, func() error { copy(dst, src); return nil })
}
