package offload

import (
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvtier/kvtier/offload/crc32c"
)

// ArenaOptions say how the CPU arena's memory is prepared.
type ArenaOptions struct {
	// Lock asks for the arena to be locked in RAM (mlock). Failure, for
	// example from a small RLIMIT_MEMLOCK, is reported in Arena.LockErr and
	// is not fatal (S1.2).
	Lock bool
	// HugePages asks for transparent huge pages (madvise MADV_HUGEPAGE).
	// Failure is reported in Arena.HugePagesErr and is not fatal.
	HugePages bool
}

// Arena is the CPU tier's memory: N equal slots in one anonymous mapping
// outside the Go heap, so its address can be registered for GPU or NIXL
// access and handed to asynchronous copies. The slot stride is a multiple
// of the page size.
type Arena struct {
	// sums holds each slot's block CRC32C (S7.2) in the low 32 bits, with
	// bit 32 set when it is valid; written by whoever filled the slot.
	sums       []atomic.Uint64
	mem        []byte
	stride     int
	slots      int
	slotBytes  int
	lockWanted bool

	// LockedBytes is how many bytes mlock actually locked (0 or Len()).
	LockedBytes int64
	// LockErr is why mlock failed, when Lock was asked for.
	LockErr error
	// HugePagesErr is why madvise(MADV_HUGEPAGE) failed, when asked for.
	HugePagesErr error
}

// SlotStride is the distance between two slots of slotBytes bytes in an
// arena: slotBytes rounded up to the page size. The one place it is
// computed.
func SlotStride(slotBytes int) int {
	page := os.Getpagesize()
	return (slotBytes + page - 1) / page * page
}

// NewArena maps slots slots of at least slotBytes bytes each.
func NewArena(slots, slotBytes int, opt ArenaOptions) (*Arena, error) {
	if slots <= 0 || slotBytes <= 0 {
		return nil, fmt.Errorf("offload: arena of %d slots × %d bytes: both must be positive", slots, slotBytes)
	}
	stride := SlotStride(slotBytes)
	if int64(slots) > (1<<46)/int64(stride) {
		return nil, fmt.Errorf("offload: arena of %d slots × %d bytes is too large", slots, stride)
	}
	// Every page is faulted in now, once, rather than on the first copy
	// into each slot (a stall in the middle of a transfer): by
	// MAP_POPULATE, or, for huge pages, after the madvise — pages faulted
	// before it are small ones and stay so (the arena once asked for huge
	// pages after MAP_POPULATE and got none).
	flags := unix.MAP_PRIVATE | unix.MAP_ANONYMOUS
	if !opt.HugePages {
		flags |= unix.MAP_POPULATE
	}
	mem, err := unix.Mmap(-1, 0, slots*stride, unix.PROT_READ|unix.PROT_WRITE, flags)
	if err != nil {
		return nil, fmt.Errorf("offload: mmap of %d bytes for the CPU arena: %w", slots*stride, err)
	}
	a := &Arena{mem: mem, stride: stride, slots: slots, slotBytes: slotBytes, lockWanted: opt.Lock,
		sums: make([]atomic.Uint64, slots)}
	if opt.HugePages {
		if err := unix.Madvise(mem, unix.MADV_HUGEPAGE); err != nil {
			a.HugePagesErr = fmt.Errorf("madvise(MADV_HUGEPAGE): %w", err)
		}
		populate(mem)
	}
	if opt.Lock {
		if err := unix.Mlock(mem); err != nil {
			a.LockErr = fmt.Errorf("mlock of %d bytes: %w (raise RLIMIT_MEMLOCK, ulimit -l, to lock the arena)", len(mem), err)
		} else {
			a.LockedBytes = int64(len(mem))
		}
	}
	return a, nil
}

// populate faults in every page of mem, a fresh anonymous mapping, as
// MAP_POPULATE would have: with MADV_POPULATE_WRITE (Linux 5.14), or by
// writing a zero to each page where the kernel lacks it. Like
// MAP_POPULATE it does not fail: pages it could not fault in (memory
// short) fault on first use.
func populate(mem []byte) {
	err := unix.Madvise(mem, unix.MADV_POPULATE_WRITE)
	if err != unix.EINVAL {
		return
	}
	page := os.Getpagesize()
	for i := 0; i < len(mem); i += page {
		mem[i] = 0
	}
}

// Slots is the number of slots.
func (a *Arena) Slots() int { return a.slots }

// Stride is the distance in bytes between the starts of two slots.
func (a *Arena) Stride() int { return a.stride }

// SlotBytes is the number of bytes of a slot that hold a block.
func (a *Arena) SlotBytes() int { return a.slotBytes }

// Len is the size of the mapping in bytes.
func (a *Arena) Len() int { return len(a.mem) }

// RequestedLockBytes is how many bytes were asked to be locked.
func (a *Arena) RequestedLockBytes() int64 {
	if a.lockWanted {
		return int64(len(a.mem))
	}
	return 0
}

// Base is the address of the first slot, for registering the arena with a
// GPU driver or NIXL. The memory is not on the Go heap and stays mapped
// until Close.
func (a *Arena) Base() uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(a.mem))) }

// Slot returns the block bytes of slot i (SlotBytes long).
func (a *Arena) Slot(i int) []byte {
	off := i * a.stride
	return a.mem[off : off+a.slotBytes : off+a.slotBytes]
}

// SetSum records the CRC32C of slot i's block, computed by the copy that
// filled it (S7.2): the GPU store, the disk read, the P2P receive.
func (a *Arena) SetSum(i int, crc uint32) { a.sums[i].Store(1<<32 | uint64(crc)) }

// Sum returns slot i's recorded CRC32C; ok is false when none was
// recorded since the slot was last reserved.
func (a *Arena) Sum(i int) (crc uint32, ok bool) {
	v := a.sums[i].Load()
	return uint32(v), v>>32 == 1
}

// ClearSum forgets slot i's checksum: the slot is about to be written.
func (a *Arena) ClearSum(i int) { a.sums[i].Store(0) }

// SumOf returns slot i's recorded CRC32C, computing (and recording) it
// from the bytes when none was recorded.
func (a *Arena) SumOf(i int) uint32 {
	if crc, ok := a.Sum(i); ok {
		return crc
	}
	crc := crc32c.Checksum(a.Slot(i))
	a.SetSum(i, crc)
	return crc
}

// Bytes returns the whole mapping.
func (a *Arena) Bytes() []byte { return a.mem }

// Close unmaps the arena. It is idempotent. No slot slice may be used
// afterwards.
func (a *Arena) Close() error {
	if a.mem == nil {
		return nil
	}
	mem := a.mem
	a.mem = nil
	if err := unix.Munmap(mem); err != nil {
		return fmt.Errorf("offload: munmap of the CPU arena: %w", err)
	}
	return nil
}
