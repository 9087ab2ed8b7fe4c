package cudakv

import (
	"fmt"
	"hash/crc32"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// hostBackend keeps the "GPU" cache in an anonymous mapping and copies
// with Workers goroutines per batch.
type hostBackend struct {
	spec   *Spec
	cache  []byte
	segs   []int // offset of each (layer, K/V) region in cache
	update func(crc uint32, p []byte) uint32
	wg     sync.WaitGroup
}

// openHost maps the host "GPU" cache, populated at once so that no copy
// pays for first-touch page faults.
func openHost(spec *Spec) (*hostBackend, error) {
	l := spec.Layout
	region := l.Blocks * l.stride()
	cache, err := unix.Mmap(-1, 0, l.Segments()*region, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("cudakv: host cache of %d bytes: %w", l.Segments()*region, err)
	}
	h := &hostBackend{spec: spec, cache: cache, update: spec.CRC32C}
	if h.update == nil {
		h.update = func(crc uint32, p []byte) uint32 { return crc32.Update(crc, castagnoli, p) }
	}
	for s := range l.Segments() {
		h.segs = append(h.segs, s*region)
	}
	return h, nil
}

func (h *hostBackend) name() string                { return "host" }
func (h *hostBackend) registerTime() time.Duration { return 0 }

// gpu returns segment s of GPU block b.
func (h *hostBackend) gpu(b, s int) []byte {
	off := h.segs[s] + b*h.spec.Layout.stride()
	return h.cache[off : off+h.spec.Layout.SegmentBytes]
}

// cpu returns segment s of CPU slot c.
func (h *hostBackend) cpu(c, s int) []byte {
	off := c*h.spec.SlotStride + s*h.spec.Layout.SegmentBytes
	return h.spec.Arena[off : off+h.spec.Layout.SegmentBytes]
}

func (h *hostBackend) submit(pairs []Pair, toCPU, sum bool) (*Ticket, error) {
	t := newTicket()
	pairs = append([]Pair(nil), pairs...)
	if sum {
		t.sums = make([]uint32, len(pairs))
	}
	h.wg.Go(func() {
		h.copyPairs(pairs, toCPU, t.sums)
		t.finish(nil)
	})
	return t, nil
}

// copyPairs splits the pairs among the workers; each copies whole blocks.
// With sums, each segment's bytes update the block's CRC32C right after
// they were copied, while they are in cache.
func (h *hostBackend) copyPairs(pairs []Pair, toCPU bool, sums []uint32) {
	n := min(h.spec.Workers, len(pairs))
	var wg sync.WaitGroup
	for w := range n {
		wg.Go(func() {
			for i := w; i < len(pairs); i += n {
				p := pairs[i]
				var crc uint32
				for s := range h.spec.Layout.Segments() {
					dst, src := h.gpu(int(p.GPU), s), h.cpu(int(p.CPU), s)
					if toCPU {
						dst, src = src, dst
					}
					copy(dst, src)
					if sums != nil {
						crc = h.update(crc, dst)
					}
				}
				if sums != nil {
					sums[i] = crc
				}
			}
		})
	}
	wg.Wait()
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func (h *hostBackend) writeBlock(b int, src []byte) error {
	seg := h.spec.Layout.SegmentBytes
	for s := range h.spec.Layout.Segments() {
		copy(h.gpu(b, s), src[s*seg:])
	}
	return nil
}

func (h *hostBackend) readBlock(b int, dst []byte) error {
	seg := h.spec.Layout.SegmentBytes
	for s := range h.spec.Layout.Segments() {
		copy(dst[s*seg:(s+1)*seg], h.gpu(b, s))
	}
	return nil
}

func (h *hostBackend) close() error {
	h.wg.Wait()
	return unix.Munmap(h.cache)
}
