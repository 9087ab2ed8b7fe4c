package engine

import (
	"encoding/binary"
	"log/slog"
	"sync"

	"github.com/kvtier/kvtier/cudakv"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/crc32c"
)

// Executor is the part of an engine that a real one replaces: the GPU
// side. The scheduler loop asks it to compute blocks into the GPU cache
// and to copy blocks between that cache and the CPU tier's slots; the
// reference executor (NewReference) computes them deterministically from
// their keys (Fill) and copies with cudakv.
type Executor interface {
	// Compute writes block k's KV into GPU cache block gpu: the prefill.
	// The engine loop calls it, one block at a time.
	Compute(gpu int32, k offload.Key) error
	// Load starts copying CPU slots into GPU blocks, with sums also
	// computing the loaded blocks' CRC32C if it can (Copy.Sums: a crc32c
	// kv_digest then reads no block again); Store the other way, always
	// computing the stored blocks' CRC32C if it can.
	Load(pairs []Pair, sums bool) (Copy, error)
	Store(pairs []Pair) (Copy, error)
	// Visit calls fn with the bytes of GPU block gpu, in order, in one or
	// more pieces (kv_digest). Digest goroutines call it concurrently.
	Visit(gpu int32, fn func([]byte)) error
	// Backend names where the GPU cache lives ("host", "cuda: <device>").
	// New asks once; the engine never asks a closed executor.
	Backend() string
	// Close releases the executor once no copy is in flight.
	Close() error
}

// Pair is a GPU cache block and a CPU slot.
type Pair = cudakv.Pair

// Copy is a copy in flight (a cudakv.Ticket is one).
type Copy interface {
	// Done reports whether the copy ended, and its error.
	Done() (bool, error)
	// Wait blocks until the copy ended and returns its error.
	Wait() error
	// Sums is, after a copy that computed them, each pair's CRC32C;
	// else nil (the engine then computes them).
	Sums() []uint32
}

// reference is the reference executor.
type reference struct {
	mv   *cudakv.Mover
	buf  []byte    // one block, for Compute (the loop's)
	bufs sync.Pool // *[]byte of one block, for Visit
}

// NewReference returns the reference executor: a GPU cache of gpuBlocks
// blocks of m's geometry (cudakv device memory when backend finds a GPU,
// host memory otherwise) copied to and from m's CPU arena by cudakv.
func NewReference(m *offload.Manager, gpuBlocks int, backend string, log *slog.Logger) (Executor, error) {
	g := m.Config().Geometry
	mv, err := cudakv.Open(cudakv.Spec{
		Layout:     cudakv.Layout{Layers: g.Layers, Fused: g.Fused, SegmentBytes: g.SegmentBytes(), Blocks: gpuBlocks},
		Arena:      m.Arena().Bytes(),
		SlotStride: m.Arena().Stride(),
		Backend:    backend,
		Checksums:  true, // each stored block's CRC32C, kept with its slot (S7.2)
		CRC32C:     crc32c.Update,
		Logger:     log,
	})
	if err != nil {
		return nil, err
	}
	bb := g.BlockBytes()
	x := &reference{mv: mv, buf: make([]byte, bb)}
	x.bufs.New = func() any { b := make([]byte, bb); return &b }
	return x, nil
}

func (x *reference) Compute(gpu int32, k offload.Key) error {
	Fill(x.buf, k)
	return x.mv.WriteBlock(int(gpu), x.buf)
}

func (x *reference) Load(pairs []Pair, sums bool) (Copy, error) {
	load := x.mv.Load
	if sums {
		load = x.mv.LoadSummed
	}
	t, err := load(pairs)
	if err != nil {
		return nil, err
	}
	return t, nil
}

func (x *reference) Store(pairs []Pair) (Copy, error) {
	t, err := x.mv.Store(pairs)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// Visit reads the host cache in place; a CUDA cache through a buffer.
func (x *reference) Visit(gpu int32, fn func([]byte)) error {
	buf := x.bufs.Get().(*[]byte)
	defer x.bufs.Put(buf)
	return x.mv.VisitBlock(int(gpu), *buf, fn)
}

func (x *reference) Backend() string { return x.mv.Backend() }
func (x *reference) Close() error    { return x.mv.Close() }

// Fill writes the deterministic contents of block k: what "computing" the
// block produces on every node.
func Fill(b []byte, k offload.Key) {
	x := binary.LittleEndian.Uint64(k[:8]) | 1
	i := 0
	for ; i+8 <= len(b); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b[i:], x)
	}
	for ; i < len(b); i++ {
		b[i] = byte(x >> (8 * (i % 8)))
	}
}
