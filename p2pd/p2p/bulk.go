package p2p

import (
	"encoding/binary"
	"net"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// lowered runs fn on an OS thread of its own at nice, so bulk block I/O
// yields the CPU to control frames, the engine and the admin API (issue
// 12: bulk must not starve control). The thread stays locked: when fn
// returns, the runtime ends it, and the nice value goes with it, never
// reaching another goroutine. The process's main thread cannot end, so
// fn never runs there: a caller on it holds it while fn runs on a new
// goroutine, which the runtime must then place on another thread. A nice
// of 0 or less runs fn as it is. Failures (a sandbox that forbids it) are
// ignored: the I/O works as before, at the normal priority. A niced thread
// still takes the plane's lock and the runtime's per block, so on a
// saturated machine a preempted one can delay others waiting on those
// (priority inversion); B2 showed no change either way (docs/benchmarks.md).
func lowered(nice int, fn func()) {
	if nice <= 0 {
		fn()
		return
	}
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		done := make(chan struct{})
		go func() {
			defer close(done)
			lowered(nice, fn)
		}()
		<-done
		runtime.UnlockOSThread()
		return
	}
	unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), nice)
	fn()
}

// Bulk writes across peers (issue 12: bulk transfer concurrency is
// bounded): a block write holds one of the plane's bulk_concurrency
// tokens while this node's CPU works on it, and none while it waits for
// the peer to read. Reads take none: a reader holding one while it waited
// for the peer's bytes serialized the fetches (B1 0.69 – 0.73 against
// 0.95, docs/benchmarks.md); what a node reads is bounded by its peers'
// writes.

// bulkSlice is how long a write that cannot tell a wait from work (TLS,
// in-memory connections) holds its token at most: past it, the write is
// waiting for a slow or stalled peer, not for a CPU, and gives the token
// back so that it holds back no other peer's blocks.
const bulkSlice = 10 * time.Millisecond

// takeBulk waits for a bulk token. The wait is bounded: every holder
// gives its token back once the kernel stops taking its bytes, or after
// bulkSlice (takeBulkFor), whichever comes first.
func (p *TCPPlane) takeBulk() {
	select {
	case p.bulk <- struct{}{}:
	default:
		p.bulkWaits.Add(1)
		p.bulk <- struct{}{}
	}
}

func (p *TCPPlane) giveBulk() { <-p.bulk }

// takeBulkFor takes a token for at most bulkSlice and returns the func
// that gives it back if the slice has not.
func (p *TCPPlane) takeBulkFor() (give func()) {
	p.takeBulk()
	var held atomic.Bool
	held.Store(true)
	back := func() bool {
		if held.CompareAndSwap(true, false) {
			p.giveBulk()
			return true
		}
		return false
	}
	t := time.AfterFunc(bulkSlice, func() {
		if back() {
			p.bulkYields.Add(1)
		}
	})
	return func() {
		t.Stop()
		back()
	}
}

// writeBlock writes hdr, the block and its CRC32C after it. On a TCP
// socket it writes (writev) for as long as the kernel takes the bytes,
// holding a token for that; when the socket is full it gives the token
// back and waits for room (the peer reading, up to the write deadline),
// then for a token again. It never waits for a token inside the socket's
// write lock, which a Close of the connection would wait behind. Other
// connections write through net.Buffers with a token held for the write
// or bulkSlice.
func (p *TCPPlane) writeBlock(c net.Conn, hdr, block []byte, crc uint32) error {
	var trailer [wire.DataTrailerSize]byte
	binary.BigEndian.PutUint32(trailer[:], crc)
	bufs := [][]byte{hdr, block, trailer[:]}
	sc, ok := c.(syscall.Conn)
	var raw syscall.RawConn
	if ok {
		var err error
		if raw, err = sc.SyscallConn(); err != nil {
			return err
		}
	}
	if raw == nil {
		give := p.takeBulkFor()
		defer give()
		nb := net.Buffers(bufs)
		_, err := nb.WriteTo(c)
		return err
	}
	var werr error
	waited := false
	for len(bufs) > 0 && werr == nil {
		p.takeBulk()
		held := true
		err := raw.Write(func(fd uintptr) bool {
			if !held {
				select {
				case p.bulk <- struct{}{}:
					held = true
				default:
					return true // to wait for one outside the write lock
				}
			}
			for len(bufs) > 0 {
				n, err := unix.Writev(int(fd), bufs)
				switch {
				case err == unix.EINTR:
					continue
				case err == unix.EAGAIN:
					if !waited {
						waited = true
						p.bulkYields.Add(1)
					}
					p.giveBulk()
					held = false
					return false // the poller waits for room, without a token
				case err != nil:
					werr = err
					return true
				}
				bufs = consumed(bufs, n)
			}
			return true
		})
		if held {
			p.giveBulk()
		}
		if err != nil {
			return err
		}
	}
	return werr
}

// consumed is bufs without their first n bytes.
func consumed(bufs [][]byte, n int) [][]byte {
	for len(bufs) > 0 && n >= len(bufs[0]) {
		n -= len(bufs[0])
		bufs = bufs[1:]
	}
	if len(bufs) > 0 {
		bufs[0] = bufs[0][n:]
	}
	return bufs
}
