package engine

import (
	"testing"
	"time"

	"github.com/kvtier/kvtier/cudakv"
	"github.com/kvtier/kvtier/offload"
)

// BenchmarkLoadSums times the reference executor's CPU → GPU load of 64
// qwen3-0.6b blocks (112 MiB) on the host backend three ways, alternately
// in one run: without checksums (the baseline), with each block's CRC32C
// computed after each segment's copy by offload/crc32c (what the engine
// asks for under a crc32c kv_digest), and the same with hash/crc32's
// (cudakv's own when Spec.CRC32C is nil). x-load is each summed load's
// rate over the plain one's.
func BenchmarkLoadSums(b *testing.B) {
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["qwen3-0.6b"]
	cfg.CPUHugePages = false
	const blocks = 64
	cfg.CPUBytes = int64(blocks * cfg.Geometry.BlockBytes())
	m, err := offload.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	x, err := NewReference(m, blocks, "host", nil)
	if err != nil {
		b.Fatal(err)
	}
	defer x.Close()
	g := cfg.Geometry
	mv, err := cudakv.Open(cudakv.Spec{
		Layout: cudakv.Layout{Layers: g.Layers, Fused: g.Fused, SegmentBytes: g.SegmentBytes(), Blocks: blocks},
		Arena:  m.Arena().Bytes(), SlotStride: m.Arena().Stride(), Backend: "host",
	})
	if err != nil {
		b.Fatal(err)
	}
	std := &reference{mv: mv}
	defer std.Close()
	pairs := make([]Pair, blocks)
	for i := range pairs {
		pairs[i] = Pair{GPU: int32(blocks - 1 - i), CPU: int32(i)}
	}
	for i := range m.Arena().Bytes() {
		m.Arena().Bytes()[i] = byte(i * 13)
	}
	load := func(x Executor, sums bool) time.Duration {
		t0 := time.Now()
		c, err := x.Load(pairs, sums)
		if err == nil {
			err = c.Wait()
		}
		if err != nil {
			b.Fatal(err)
		}
		if sums && len(c.Sums()) != blocks {
			b.Fatalf("%d sums of %d blocks", len(c.Sums()), blocks)
		}
		return time.Since(t0)
	}
	var plain, fast, slow time.Duration
	for b.Loop() {
		plain += load(x, false)
		fast += load(x, true)
		slow += load(std, true)
	}
	bytes := float64(b.N) * blocks * float64(g.BlockBytes())
	b.ReportMetric(bytes/plain.Seconds()/1e9, "GB/s-plain")
	b.ReportMetric(bytes/fast.Seconds()/1e9, "GB/s-crc32c")
	b.ReportMetric(bytes/slow.Seconds()/1e9, "GB/s-hashcrc32")
	b.ReportMetric(plain.Seconds()/fast.Seconds(), "x-load-crc32c")
	b.ReportMetric(plain.Seconds()/slow.Seconds(), "x-load-hashcrc32")
}
