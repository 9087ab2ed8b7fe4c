// Package cudakv moves KV blocks between a paged GPU KV cache and the CPU
// tier's slots: Store gathers blocks from the GPU cache into CPU slots,
// Load scatters them back, a whole batch of (GPU block, CPU slot) pairs
// across all layers per call, asynchronously.
//
// Two backends share the API. The CUDA backend launches a copy kernel
// (embedded as a fatbin) through the CUDA driver API, which it opens with
// dlopen at run time: the binary links no CUDA library and uses a GPU when
// one is present. The host backend keeps the "GPU" cache in host memory
// and copies with goroutines, for machines without a GPU. Open picks one.
package cudakv

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"time"
)

// Errors.
var (
	// ErrUnavailable: no usable GPU (no driver, no device, or a build
	// without cgo). The host backend works everywhere.
	ErrUnavailable = errors.New("cudakv: GPU unavailable")
	ErrBadSpec     = errors.New("cudakv: bad spec")
	ErrBadPair     = errors.New("cudakv: block or slot out of range")
	ErrClosed      = errors.New("cudakv: mover closed")
)

// Layout describes the paged GPU KV cache: for each layer a K and a V
// region (one region if Fused, as in MLA), each holding Blocks blocks
// BlockStride bytes apart, a block's data being SegmentBytes long (tokens
// per block × KV heads × head dim × dtype size).
type Layout struct {
	Layers       int
	Fused        bool
	SegmentBytes int
	Blocks       int
	// BlockStride defaults to SegmentBytes.
	BlockStride int
}

// Segments is the number of (layer, K or V) segments of a block.
func (l Layout) Segments() int {
	if l.Fused {
		return l.Layers
	}
	return 2 * l.Layers
}

// BlockBytes is the size of one block across all layers: what one CPU
// slot holds, block-major ([layer][K, V][segment]).
func (l Layout) BlockBytes() int { return l.Segments() * l.SegmentBytes }

func (l Layout) stride() int {
	if l.BlockStride == 0 {
		return l.SegmentBytes
	}
	return l.BlockStride
}

// Spec configures a Mover.
type Spec struct {
	Layout Layout
	// Arena is the CPU tier's memory: Slots slots SlotStride bytes apart,
	// each holding one block (Layout.BlockBytes) block-major. It must not
	// be Go-heap memory (the CPU tier maps it with mmap): the GPU reads and
	// writes it asynchronously.
	Arena      []byte
	SlotStride int
	// Backend is "auto" (the GPU when one is usable, else the host),
	// "cuda" or "host".
	Backend string
	// Device is the CUDA device ordinal.
	Device int
	// CTAs caps the copy kernel's grid (default 8): model compute keeps
	// the other SMs. Threads is the CTA size (default 256).
	CTAs, Threads int
	// Workers is the host backend's parallelism (default GOMAXPROCS).
	Workers int
	// Checksums asks stores to compute each block's CRC32C (Castagnoli)
	// as they copy it, while it is hot (Ticket.Sums): the host backend
	// right after each segment's copy, the CUDA backend in the store
	// kernel from the values it copies (kernels/copy.cu, kv_store_sum).
	Checksums bool
	// CRC32C, when set, is what the host backend's checksums use to add a
	// segment's bytes to a CRC32C (crc32.Update with the Castagnoli table
	// when nil): a caller with a faster one passes it (p2pd passes
	// offload/crc32c's, several times hash/crc32's speed with AVX-512).
	CRC32C func(crc uint32, p []byte) uint32
	Logger *slog.Logger
}

// Pair names a GPU cache block and a CPU slot.
type Pair struct{ GPU, CPU int32 }

func (s *Spec) validate() error {
	l := s.Layout
	switch {
	case l.Layers <= 0 || l.Layers > 1024:
		return fmt.Errorf("%w: layers %d not in [1, 1024]", ErrBadSpec, l.Layers)
	case l.SegmentBytes <= 0:
		return fmt.Errorf("%w: segment bytes %d", ErrBadSpec, l.SegmentBytes)
	case l.Blocks <= 0:
		return fmt.Errorf("%w: %d GPU blocks", ErrBadSpec, l.Blocks)
	case l.stride() < l.SegmentBytes:
		return fmt.Errorf("%w: block stride %d is less than a segment (%d)", ErrBadSpec, l.BlockStride, l.SegmentBytes)
	case s.SlotStride < l.BlockBytes():
		return fmt.Errorf("%w: slot stride %d is less than a block (%d)", ErrBadSpec, s.SlotStride, l.BlockBytes())
	case len(s.Arena) < s.SlotStride:
		return fmt.Errorf("%w: an arena of %d bytes holds no slot of %d", ErrBadSpec, len(s.Arena), s.SlotStride)
	case s.CTAs < 0 || s.CTAs > 1024 || s.Threads < 0 || s.Threads > 1024 || s.Threads%32 != 0:
		return fmt.Errorf("%w: CTAs %d, threads %d (want ≤ 1024, threads a multiple of 32)", ErrBadSpec, s.CTAs, s.Threads)
	}
	return nil
}

// slots is the number of CPU slots in the arena.
func (s *Spec) slots() int { return len(s.Arena) / s.SlotStride }

// Mover copies KV blocks between the GPU cache and CPU slots.
type Mover struct {
	spec    Spec
	backend backend
	name    string // backend.name() at Open: the CUDA one reads a context Close frees
	log     *slog.Logger

	mu     sync.Mutex
	closed bool
}

// backend is what the CUDA and host backends implement.
type backend interface {
	name() string
	// submit starts copying pairs in one direction and returns at once;
	// with sum, the ticket gets each pair's CRC32C of the bytes copied
	// (Ticket.Sums).
	submit(pairs []Pair, toCPU, sum bool) (*Ticket, error)
	writeBlock(block int, src []byte) error
	readBlock(block int, dst []byte) error
	registerTime() time.Duration
	close() error
}

// Open returns a Mover over spec's layout and arena, on the backend spec
// asks for. With "auto" it uses the GPU when one is usable and otherwise
// the host backend, logging why.
func Open(spec Spec) (*Mover, error) {
	if spec.CTAs == 0 {
		spec.CTAs = 8
	}
	if spec.Threads == 0 {
		spec.Threads = 256
	}
	if spec.Workers <= 0 {
		spec.Workers = runtime.GOMAXPROCS(0)
	}
	if spec.Backend == "" {
		spec.Backend = "auto"
	}
	if err := spec.validate(); err != nil {
		return nil, err
	}
	log := spec.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &Mover{spec: spec, log: log}
	var err error
	switch spec.Backend {
	case "cuda":
		m.backend, err = openCUDA(&spec, log)
	case "host":
		m.backend, err = openHost(&spec)
	case "auto":
		m.backend, err = openCUDA(&spec, log)
		if errors.Is(err, ErrUnavailable) {
			log.Info("cudakv: using the host backend", "reason", err)
			m.backend, err = openHost(&spec)
		}
	default:
		return nil, fmt.Errorf("%w: backend %q (want auto, cuda or host)", ErrBadSpec, spec.Backend)
	}
	if err != nil {
		return nil, err
	}
	m.name = m.backend.name()
	return m, nil
}

// Backend names the backend in use ("host", or "cuda: <device name>"),
// also after Close: the CUDA backend's name lives in its context, which
// Close frees, and GET /v0/status asks for it while the node shuts down.
func (m *Mover) Backend() string { return m.name }

// RegisterTime is how long registering the arena for device access took
// (zero for the host backend).
func (m *Mover) RegisterTime() time.Duration { return m.backend.registerTime() }

// Layout returns the GPU cache layout.
func (m *Mover) Layout() Layout { return m.spec.Layout }

func (m *Mover) check(pairs []Pair) error {
	m.mu.Lock()
	closed := m.closed
	m.mu.Unlock()
	if closed {
		return ErrClosed
	}
	blocks, slots := int32(m.spec.Layout.Blocks), int32(m.spec.slots())
	for i, p := range pairs {
		if p.GPU < 0 || p.GPU >= blocks || p.CPU < 0 || p.CPU >= slots {
			return fmt.Errorf("%w: pair %d is (GPU block %d, CPU slot %d); the cache has %d blocks and the arena %d slots",
				ErrBadPair, i, p.GPU, p.CPU, blocks, slots)
		}
	}
	return nil
}

// Store starts copying each pair's GPU block into its CPU slot (GPU →
// CPU) across all layers and returns a ticket at once. Out-of-range pairs
// are an error and nothing is copied.
func (m *Mover) Store(pairs []Pair) (*Ticket, error) {
	if err := m.check(pairs); err != nil {
		return nil, err
	}
	return m.backend.submit(pairs, true, m.spec.Checksums)
}

// Load starts copying each pair's CPU slot into its GPU block (CPU → GPU).
func (m *Mover) Load(pairs []Pair) (*Ticket, error) {
	if err := m.check(pairs); err != nil {
		return nil, err
	}
	return m.backend.submit(pairs, false, false)
}

// LoadSummed is Load that also computes each block's CRC32C (Castagnoli)
// from the bytes it writes into the GPU cache, while they are hot
// (Ticket.Sums): the host backend right after each segment's copy, the
// CUDA backend in the load kernel (kv_load_sum). A kv_digest of the
// loaded blocks then needs no second read of the cache.
func (m *Mover) LoadSummed(pairs []Pair) (*Ticket, error) {
	if err := m.check(pairs); err != nil {
		return nil, err
	}
	return m.backend.submit(pairs, false, true)
}

// WriteBlock writes a block-major block (BlockBytes long) into GPU block
// b, synchronously: how an engine's "compute" fills the cache in tests and
// in the reference executor.
func (m *Mover) WriteBlock(b int, src []byte) error {
	if err := m.blockArgs(b, len(src)); err != nil {
		return err
	}
	return m.backend.writeBlock(b, src)
}

// ReadBlock reads GPU block b, block-major, into dst, synchronously.
func (m *Mover) ReadBlock(b int, dst []byte) error {
	if err := m.blockArgs(b, len(dst)); err != nil {
		return err
	}
	return m.backend.readBlock(b, dst)
}

// VisitBlock passes GPU block b's bytes, block-major, to fn in consecutive
// pieces, synchronously: how a digest reads the cache. On the host
// backend the pieces are the cache's own memory, with no copy (fn must not
// keep or change them); on the GPU, b is first read into buf (BlockBytes
// long, used only there).
func (m *Mover) VisitBlock(b int, buf []byte, fn func([]byte)) error {
	if err := m.blockArgs(b, len(buf)); err != nil {
		return err
	}
	if h, ok := m.backend.(*hostBackend); ok {
		for s := range m.spec.Layout.Segments() {
			fn(h.gpu(b, s))
		}
		return nil
	}
	if err := m.backend.readBlock(b, buf); err != nil {
		return err
	}
	fn(buf)
	return nil
}

func (m *Mover) blockArgs(b, n int) error {
	if err := m.check([]Pair{{GPU: int32(b)}}); err != nil {
		return err
	}
	if n != m.spec.Layout.BlockBytes() {
		return fmt.Errorf("%w: buffer of %d bytes for a block of %d", ErrBadSpec, n, m.spec.Layout.BlockBytes())
	}
	return nil
}

// Close waits for copies in flight and releases the backend. It is
// idempotent.
func (m *Mover) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	m.mu.Unlock()
	return m.backend.close()
}

// Ticket is a batch in flight.
type Ticket struct {
	done chan struct{}
	err  error
	sums []uint32 // per pair, when the backend computed them
	// poll, for the CUDA backend, asks the device whether the batch ended
	// and finishes the ticket if so; wait blocks until it did.
	poll func() (bool, error)
	wait func() error
	once sync.Once
}

func newTicket() *Ticket { return &Ticket{done: make(chan struct{})} }

func (t *Ticket) finish(err error) {
	t.once.Do(func() {
		t.err = err
		close(t.done)
	})
}

// Done reports whether the batch ended, and its error if it failed.
func (t *Ticket) Done() (bool, error) {
	select {
	case <-t.done:
		return true, t.err
	default:
	}
	if t.poll != nil {
		if ok, err := t.poll(); ok {
			t.finish(err)
			return true, t.err
		}
	}
	return false, nil
}

// Sums returns the CRC32C of each pair's block as copied, parallel to the
// pairs, once the ticket is done and only when the backend computed them
// while copying (a store with Spec.Checksums, a LoadSummed); else nil.
func (t *Ticket) Sums() []uint32 {
	select {
	case <-t.done:
		return t.sums
	default:
		return nil
	}
}

// Wait blocks until the batch ended and returns its error.
func (t *Ticket) Wait() error {
	select {
	case <-t.done:
		return t.err
	default:
	}
	if t.wait != nil {
		t.finish(t.wait())
	}
	<-t.done
	return t.err
}
