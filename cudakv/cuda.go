//go:build cgo && linux

package cudakv

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "cuda_shim.h"
*/
import "C"

import (
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"
	"unsafe"
)

// fatbin holds the kernels of kernels/copy.cu for sm_80 and sm_90 plus
// compute_80 PTX; `make generate` rebuilds it.
//
//go:embed kernels/copy.fatbin
var fatbin []byte

// registerChunk is the size in which large arenas are registered.
const registerChunk = 1 << 30

// ringSlots is how many batches may be in flight at once; one more waits
// for the oldest to end.
const ringSlots = 16

// CUDAError is a failed CUDA driver call.
type CUDAError struct {
	Op   string // the driver call or step, e.g. "cuMemAlloc"
	Code int    // the CUresult
	Name string // e.g. CUDA_ERROR_OUT_OF_MEMORY
	Msg  string
}

func (e *CUDAError) Error() string {
	return fmt.Sprintf("cudakv: %s: %s (%d): %s", e.Op, e.Name, e.Code, e.Msg)
}

func cudaErr(op string, status C.int) error {
	if status == 0 {
		return nil
	}
	var name, msg *C.char
	C.kv_error(status, &name, &msg)
	e := &CUDAError{Op: op, Code: int(status), Name: C.GoString(name), Msg: C.GoString(msg)}
	if status == C.KV_CUDA_NO_DEVICE || status == C.KV_ERR_NOUVA {
		return fmt.Errorf("%w: %w", ErrUnavailable, e)
	}
	return e
}

var driver struct {
	once sync.Once
	err  error
}

// initDriver opens libcuda.so.1 and initialises it, once per process.
func initDriver() error {
	driver.once.Do(func() {
		var buf [512]C.char
		status := C.kv_init(&buf[0], C.size_t(len(buf)))
		switch status {
		case 0:
		case C.KV_ERR_DLOPEN, C.KV_ERR_DLSYM:
			driver.err = fmt.Errorf("%w: %s", ErrUnavailable, C.GoString(&buf[0]))
		default:
			driver.err = cudaErr("cuInit", status)
			if !errors.Is(driver.err, ErrUnavailable) {
				driver.err = fmt.Errorf("%w: %w", ErrUnavailable, driver.err)
			}
		}
	})
	return driver.err
}

// DeviceCount returns the number of CUDA devices, or ErrUnavailable.
func DeviceCount() (int, error) {
	if err := initDriver(); err != nil {
		return 0, err
	}
	var n C.int
	if err := cudaErr("cuDeviceGetCount", C.kv_device_count(&n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

type ringSlot struct {
	host  unsafe.Pointer // pinned: 2 × int32 per pair
	dev   uint64
	event unsafe.Pointer
	t     *Ticket
	// sums (pinned, mapped, sumsCap words, grown by sumsFor) receives
	// kv_store_sum's or kv_load_sum's raw CRC per (pair, segment) when
	// summed; n is the batch's pair count.
	sums    unsafe.Pointer
	sumsCap int
	summed  bool
	n       int
}

type cudaBackend struct {
	spec      *Spec
	ctx       *C.kv_ctx
	cache     uint64 // the GPU cache, when the mover allocated it
	bases     uint64 // device table of segment region addresses
	regBases  []unsafe.Pointer
	regTime   time.Duration
	maxPairs  int
	crc       blockCRC
	log       *slog.Logger
	mu        sync.Mutex
	free      []*ringSlot
	inflight  []*ringSlot
	allocated []*ringSlot
}

func openCUDA(spec *Spec, log *slog.Logger) (backend, error) {
	if err := initDriver(); err != nil {
		return nil, err
	}
	n, err := DeviceCount()
	if err != nil {
		return nil, err
	}
	if n == 0 || spec.Device >= n {
		return nil, fmt.Errorf("%w: device %d of %d", ErrUnavailable, spec.Device, n)
	}
	b := &cudaBackend{spec: spec, log: log, maxPairs: spec.Layout.Blocks}
	if err := cudaErr("open device", C.kv_open(C.int(spec.Device), unsafe.Pointer(unsafe.SliceData(fatbin)), &b.ctx)); err != nil {
		return nil, err
	}
	if err := b.setup(); err != nil {
		b.close()
		return nil, err
	}
	log.Info("cudakv: CUDA backend", "device", b.name(), "sms", int(C.kv_sms(b.ctx)), "register_time", b.regTime)
	return b, nil
}

func (b *cudaBackend) setup() error {
	// Register the arena, in chunks so large arenas stay within driver
	// limits; with unified addressing host addresses are device addresses.
	start := time.Now()
	arena := b.spec.Arena
	for off := 0; off < len(arena); off += registerChunk {
		p := unsafe.Pointer(&arena[off])
		n := min(registerChunk, len(arena)-off)
		if err := cudaErr("cuMemHostRegister", C.kv_host_register(b.ctx, p, C.size_t(n))); err != nil {
			return err
		}
		b.regBases = append(b.regBases, p)
	}
	b.regTime = time.Since(start)
	l := b.spec.Layout
	b.crc = newBlockCRC(l.SegmentBytes, l.Segments())
	region := uint64(l.Blocks) * uint64(l.stride())
	var cache C.uint64_t
	if err := cudaErr("cuMemAlloc (GPU cache)", C.kv_malloc(b.ctx, C.size_t(region*uint64(l.Segments())), &cache)); err != nil {
		return err
	}
	b.cache = uint64(cache)
	table := make([]uint64, l.Segments())
	for s := range table {
		table[s] = b.cache + uint64(s)*region
	}
	var bases C.uint64_t
	if err := cudaErr("cuMemAlloc (segment table)", C.kv_malloc(b.ctx, C.size_t(8*len(table)), &bases)); err != nil {
		return err
	}
	b.bases = uint64(bases)
	if err := cudaErr("cuMemcpyHtoD (segment table)", C.kv_htod(b.ctx, bases, unsafe.Pointer(&table[0]), C.size_t(8*len(table)))); err != nil {
		return err
	}
	for range ringSlots {
		r := &ringSlot{}
		b.allocated = append(b.allocated, r)
		if err := cudaErr("cuMemHostAlloc (pairs)", C.kv_pinned(b.ctx, C.size_t(8*b.maxPairs), &r.host)); err != nil {
			return err
		}
		var dev C.uint64_t
		if err := cudaErr("cuMemAlloc (pairs)", C.kv_malloc(b.ctx, C.size_t(8*b.maxPairs), &dev)); err != nil {
			return err
		}
		r.dev = uint64(dev)
		if err := cudaErr("cuEventCreate", C.kv_event_new(b.ctx, 0, &r.event)); err != nil {
			return err
		}
		b.free = append(b.free, r)
	}
	return nil
}

func (b *cudaBackend) name() string                { return "cuda: " + C.GoString(C.kv_name(b.ctx)) }
func (b *cudaBackend) registerTime() time.Duration { return b.regTime }

// slotLocked returns a free ring slot, first waiting for the oldest batch
// in flight when all are taken.
func (b *cudaBackend) slotLocked() *ringSlot {
	if len(b.free) == 0 {
		oldest := b.inflight[0]
		t := oldest.t
		t.finish(b.endLocked(oldest, cudaErr("cuEventSynchronize", C.kv_event_sync(b.ctx, oldest.event))))
	}
	r := b.free[len(b.free)-1]
	b.free = b.free[:len(b.free)-1]
	return r
}

// sumsFor makes r.sums hold n words: it grows to the largest batch with
// checksums that r has carried.
func (b *cudaBackend) sumsFor(r *ringSlot, n int) error {
	if n <= r.sumsCap {
		return nil
	}
	if r.sums != nil {
		if err := cudaErr("cuMemFreeHost (checksums)", C.kv_pinned_free(b.ctx, r.sums)); err != nil {
			return err
		}
		r.sums, r.sumsCap = nil, 0
	}
	if err := cudaErr("cuMemHostAlloc (checksums)", C.kv_pinned(b.ctx, C.size_t(4*n), &r.sums)); err != nil {
		return err
	}
	r.sumsCap = n
	return nil
}

// endLocked releases r, whose batch ended with err, after handing its
// ticket the blocks' checksums if the kernel computed them.
func (b *cudaBackend) endLocked(r *ringSlot, err error) error {
	if err == nil && r.summed {
		nseg := b.spec.Layout.Segments()
		raw := unsafe.Slice((*uint32)(r.sums), r.n*nseg)
		r.t.sums = make([]uint32, r.n)
		for p := range r.t.sums {
			r.t.sums[p] = b.crc.join(raw[p*nseg : (p+1)*nseg])
		}
	}
	b.releaseLocked(r)
	return err
}

func (b *cudaBackend) releaseLocked(r *ringSlot) {
	for i, x := range b.inflight {
		if x == r {
			b.inflight = append(b.inflight[:i], b.inflight[i+1:]...)
			r.t = nil
			b.free = append(b.free, r)
			return
		}
	}
}

func (b *cudaBackend) submit(pairs []Pair, toCPU, sum bool) (*Ticket, error) {
	if len(pairs) > b.maxPairs {
		return nil, fmt.Errorf("%w: a batch of %d pairs is larger than the GPU cache (%d blocks)", ErrBadPair, len(pairs), b.maxPairs)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.slotLocked()
	// The pairs go into C-owned pinned memory: no Go pointer reaches the
	// asynchronous copy.
	dst := unsafe.Slice((*int32)(r.host), 2*len(pairs))
	for i, p := range pairs {
		dst[2*i], dst[2*i+1] = p.GPU, p.CPU
	}
	l := b.spec.Layout
	r.n, r.summed = len(pairs), sum
	var sums C.uint64_t
	if r.summed {
		if err := b.sumsFor(r, len(pairs)*l.Segments()); err != nil {
			b.free = append(b.free, r)
			return nil, err
		}
		sums = C.uint64_t(uintptr(r.sums))
	}
	status := C.kv_copy(b.ctx, dirOf(toCPU), C.uint64_t(b.bases), r.host, C.uint64_t(r.dev), C.int(len(pairs)),
		C.int(l.Segments()), C.uint64_t(l.SegmentBytes), C.uint64_t(l.stride()),
		C.uint64_t(uintptr(unsafe.Pointer(unsafe.SliceData(b.spec.Arena)))), C.uint64_t(b.spec.SlotStride),
		C.int(b.spec.CTAs), C.int(b.spec.Threads), sums, r.event)
	if err := cudaErr("kernel launch", status); err != nil {
		b.free = append(b.free, r)
		return nil, err
	}
	t := newTicket()
	r.t = t
	b.inflight = append(b.inflight, r)
	t.poll = func() (bool, error) {
		b.mu.Lock()
		defer b.mu.Unlock()
		if r.t != t {
			return true, t.err // already released, and t finished, under b.mu
		}
		switch s := C.kv_event_query(b.ctx, r.event); s {
		case C.KV_CUDA_NOT_READY:
			return false, nil
		default:
			t.finish(b.endLocked(r, cudaErr("cuEventQuery", s)))
			return true, t.err
		}
	}
	// Each path that releases r finishes t before it lets go of b.mu, so
	// a Done that finds r released cannot finish t first with no error.
	t.wait = func() error {
		b.mu.Lock()
		defer b.mu.Unlock()
		if r.t == t {
			t.finish(b.endLocked(r, cudaErr("cuEventSynchronize", C.kv_event_sync(b.ctx, r.event))))
		}
		return t.err
	}
	return t, nil
}

func (b *cudaBackend) segAddr(block, s int) C.uint64_t {
	l := b.spec.Layout
	return C.uint64_t(b.cache + uint64(s)*uint64(l.Blocks)*uint64(l.stride()) + uint64(block)*uint64(l.stride()))
}

func (b *cudaBackend) writeBlock(block int, src []byte) error {
	seg := b.spec.Layout.SegmentBytes
	for s := range b.spec.Layout.Segments() {
		if err := cudaErr("cuMemcpyHtoD", C.kv_htod(b.ctx, b.segAddr(block, s), unsafe.Pointer(&src[s*seg]), C.size_t(seg))); err != nil {
			return err
		}
	}
	return nil
}

func (b *cudaBackend) readBlock(block int, dst []byte) error {
	seg := b.spec.Layout.SegmentBytes
	for s := range b.spec.Layout.Segments() {
		if err := cudaErr("cuMemcpyDtoH", C.kv_dtoh(b.ctx, unsafe.Pointer(&dst[s*seg]), b.segAddr(block, s), C.size_t(seg))); err != nil {
			return err
		}
	}
	return nil
}

func (b *cudaBackend) close() error {
	var errs []error
	b.mu.Lock()
	defer b.mu.Unlock()
	var synced error // a batch still in flight reports a failed sync: its copy may not have happened
	for _, dir := range []C.int{0, 1} {
		synced = errors.Join(synced, cudaErr("cuStreamSynchronize", C.kv_stream_sync(b.ctx, dir)))
	}
	errs = append(errs, synced)
	for _, r := range slices.Clone(b.inflight) {
		t := r.t
		t.finish(b.endLocked(r, synced))
	}
	b.inflight, b.free = nil, nil
	for _, r := range b.allocated {
		if r.event != nil {
			C.kv_event_free(b.ctx, r.event)
		}
		for _, p := range []unsafe.Pointer{r.host, r.sums} {
			if p != nil {
				errs = append(errs, cudaErr("cuMemFreeHost", C.kv_pinned_free(b.ctx, p)))
			}
		}
		if r.dev != 0 {
			errs = append(errs, cudaErr("cuMemFree", C.kv_free(b.ctx, C.uint64_t(r.dev))))
		}
	}
	for _, p := range []uint64{b.bases, b.cache} {
		if p != 0 {
			errs = append(errs, cudaErr("cuMemFree", C.kv_free(b.ctx, C.uint64_t(p))))
		}
	}
	for _, p := range b.regBases {
		errs = append(errs, cudaErr("cuMemHostUnregister", C.kv_host_unregister(b.ctx, p)))
	}
	C.kv_close(b.ctx)
	return errors.Join(errs...)
}

func (b *cudaBackend) setGrid(ctas, threads int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.spec.CTAs, b.spec.Threads = ctas, threads
}

func (b *cudaBackend) baseline(engine string, store bool, pairs []Pair, reps int) (time.Duration, error) {
	switch engine {
	case "contiguous":
		return b.contiguous(store, len(pairs)*b.spec.Layout.BlockBytes(), reps)
	case "per-segment", "batched":
		return b.copyEngines(engine, store, pairs, reps)
	}
	return 0, fmt.Errorf("cudakv: no baseline %q", engine)
}

// contiguous times the ceiling of the benchmarks: one copy-engine transfer
// of n bytes between the GPU cache and the arena, split only where the
// arena's registration is (a copy across two registrations would be staged
// through pageable memory by the driver).
func (b *cudaBackend) contiguous(store bool, n, reps int) (time.Duration, error) {
	return timeMedian(reps, func() error {
		if err := b.enqueueContiguous(store, 0, n); err != nil {
			return err
		}
		return b.sync(store)
	})
}

// duplex times a contiguous store of the first half of n bytes and a
// contiguous load of the second half, at once on the two streams.
func (b *cudaBackend) duplex(blocks, reps int) (time.Duration, error) {
	n := blocks * b.spec.Layout.BlockBytes()
	return timeMedian(reps, func() error {
		if err := b.enqueueContiguous(true, 0, n/2); err != nil {
			return err
		}
		if err := b.enqueueContiguous(false, n/2, n-n/2); err != nil {
			return err
		}
		return errors.Join(b.sync(true), b.sync(false))
	})
}

// enqueueContiguous queues copies of bytes [off, off+n) between the GPU
// cache and the arena, split where the arena's registrations meet.
func (b *cudaBackend) enqueueContiguous(store bool, off, n int) error {
	host := unsafe.Pointer(unsafe.SliceData(b.spec.Arena))
	for end := off + n; off < end; {
		m := min(end, (off/registerChunk+1)*registerChunk) - off
		if err := cudaErr("cuMemcpyAsync", C.kv_memcpy_async(b.ctx, dirOf(store), unsafe.Add(host, off), C.uint64_t(b.cache+uint64(off)), C.size_t(m))); err != nil {
			return err
		}
		off += m
	}
	return nil
}

func (b *cudaBackend) sync(store bool) error {
	return cudaErr("cuStreamSynchronize", C.kv_stream_sync(b.ctx, dirOf(store)))
}

// dirOf is the shim's direction: 1 to the host (store), 0 to the GPU.
func dirOf(store bool) C.int {
	if store {
		return 1
	}
	return 0
}

// segmentCopies calls f with the host and device address of every
// (pair, segment) of a batch.
func (b *cudaBackend) segmentCopies(pairs []Pair, f func(host unsafe.Pointer, dev C.uint64_t) error) error {
	l := b.spec.Layout
	arena := unsafe.Pointer(unsafe.SliceData(b.spec.Arena))
	for _, p := range pairs {
		for s := range l.Segments() {
			if err := f(unsafe.Add(arena, int(p.CPU)*b.spec.SlotStride+s*l.SegmentBytes), b.segAddr(int(p.GPU), s)); err != nil {
				return err
			}
		}
	}
	return nil
}

// ceCopies returns a function that queues the copy engines' transfer of
// every (pair, segment) of a batch on a direction's stream — engine
// "per-segment" (one cuMemcpyAsync each) or "batched" (the driver's batched
// copy in one call; ErrUnavailable before CUDA 12.8) — and one that frees
// what it holds (the batched copy's address arrays, in C memory).
func (b *cudaBackend) ceCopies(engine string, store bool, pairs []Pair) (enqueue func() error, release func(), err error) {
	dir := dirOf(store)
	seg := b.spec.Layout.SegmentBytes
	switch engine {
	case "per-segment":
		return func() error {
			return b.segmentCopies(pairs, func(host unsafe.Pointer, dev C.uint64_t) error {
				return cudaErr("cuMemcpyAsync", C.kv_memcpy_async(b.ctx, dir, host, dev, C.size_t(seg)))
			})
		}, func() {}, nil
	case "batched":
	default:
		return nil, nil, fmt.Errorf("cudakv: no copy-engine baseline %q", engine)
	}
	n := len(pairs) * b.spec.Layout.Segments()
	arrays := C.malloc(C.size_t(3 * 8 * n))
	if arrays == nil {
		return nil, nil, errors.New("cudakv: malloc failed")
	}
	dsts := unsafe.Slice((*C.uint64_t)(arrays), 3*n)
	srcs, sizes := dsts[n:2*n], unsafe.Slice((*C.size_t)(unsafe.Pointer(&dsts[2*n])), n)
	i := 0
	b.segmentCopies(pairs, func(host unsafe.Pointer, dev C.uint64_t) error {
		h := C.uint64_t(uintptr(host))
		if store {
			dsts[i], srcs[i] = h, dev
		} else {
			dsts[i], srcs[i] = dev, h
		}
		sizes[i] = C.size_t(seg)
		i++
		return nil
	})
	return func() error {
		status := C.kv_memcpy_batch(b.ctx, dir, &dsts[0], &srcs[0], &sizes[0], C.size_t(n))
		if status == C.KV_ERR_DLSYM {
			return fmt.Errorf("%w: the driver has no cuMemcpyBatchAsync", ErrUnavailable)
		}
		return cudaErr("cuMemcpyBatchAsync", status)
	}, func() { C.free(arrays) }, nil
}

// copyEngines times engine's transfer of every (pair, segment) of a batch.
func (b *cudaBackend) copyEngines(engine string, store bool, pairs []Pair, reps int) (time.Duration, error) {
	enqueue, release, err := b.ceCopies(engine, store, pairs)
	if err != nil {
		return 0, err
	}
	defer release()
	return timeMedian(reps, func() error {
		if err := enqueue(); err != nil {
			return err
		}
		return b.sync(store)
	})
}

// hybrid times a store of the first half of the pairs and a load of the
// second half at once: one direction by m's kernel, the other by the copy
// engines (engine as in ceCopies) on the other stream.
func (b *cudaBackend) hybrid(m *Mover, pairs []Pair, kernelStores bool, engine string, reps int) (time.Duration, error) {
	half := len(pairs) / 2
	ce := pairs[half:] // the copy engines load the second half
	if !kernelStores {
		ce = pairs[:half] // or store the first
	}
	enqueue, release, err := b.ceCopies(engine, !kernelStores, ce)
	if err != nil {
		return 0, err
	}
	defer release()
	return timeMedian(reps, func() error {
		var t *Ticket
		var err error
		if kernelStores {
			t, err = m.Store(pairs[:half])
		} else {
			t, err = m.Load(pairs[half:])
		}
		if err != nil {
			return err
		}
		if err := enqueue(); err != nil {
			return errors.Join(err, t.Wait())
		}
		return errors.Join(b.sync(!kernelStores), t.Wait())
	})
}
