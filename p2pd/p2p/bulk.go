package p2p

import (
	"encoding/binary"
	"net"
	"os"
	"runtime"
	"sync"
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
// bounded): a block write holds one of the plane's bulk tokens while this
// node's CPU works on it, and none while it waits for the peer to read.
// Reads take none: a reader holding one while it waited for the peer's
// bytes serialized the fetches (B1 0.69 – 0.73 against 0.95,
// docs/benchmarks.md); what a node reads is bounded by its peers' writes.

// bulkGate is the plane's bulk tokens: n of them (bulk_concurrency), one
// fewer (at least one) while busy reports true — the default leaves the
// engine a CPU while it has requests of its own, and lets bulk writes
// take every CPU while it has none (docs/benchmarks.md, issue 12,
// eleventh steps). Takes wait in line: a given-back token goes to the
// oldest waiting take, so a writer that gives and takes again for its
// next block cannot keep another peer's block waiting. A limit that
// drops leaves the tokens already held with their writes, each given
// back at its write's end or when its socket fills; one that rises is
// seen at the next take or give, so a waiter may wait with a token free
// until a holder gives back (no longer than a holder's write: take).
type bulkGate struct {
	mu    sync.Mutex
	line  []chan struct{} // takes waiting, oldest first; each is closed when handed its token
	held  int
	n     int
	busy  func() bool   // nil: never busy
	waits atomic.Uint64 // takes that waited for a token, counted as they start to
}

func newBulkGate(n int, busy func() bool) *bulkGate { return &bulkGate{n: n, busy: busy} }

// limitLocked is how many tokens may be held now.
func (g *bulkGate) limitLocked() int {
	if g.n > 1 && g.busy != nil && g.busy() {
		return g.n - 1
	}
	return g.n
}

// handLocked hands the free tokens to the oldest waiting takes and says
// whether one is free after them. The line shrinks by each take handed
// one; it holds at most one take a writing goroutine.
func (g *bulkGate) handLocked() (free bool) {
	for g.held < g.limitLocked() {
		if len(g.line) == 0 {
			return true
		}
		g.held++
		close(g.line[0])
		g.line[0] = nil
		g.line = g.line[1:]
	}
	return false
}

// tryTake takes a token if one is free after the waiting takes; it never
// waits.
func (g *bulkGate) tryTake() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.handLocked() {
		return false
	}
	g.held++
	return true
}

// take waits for a token, after the takes already waiting. The wait is
// bounded: every holder gives its token back once the kernel stops
// taking its bytes, or after bulkSlice (takeBulkFor), whichever comes
// first.
func (g *bulkGate) take() {
	g.mu.Lock()
	if g.handLocked() {
		g.held++
		g.mu.Unlock()
		return
	}
	g.waits.Add(1)
	handed := make(chan struct{})
	g.line = append(g.line, handed)
	g.mu.Unlock()
	<-handed
}

func (g *bulkGate) give() {
	g.mu.Lock()
	g.held--
	g.handLocked()
	g.mu.Unlock()
}

// holding is how many tokens are held.
func (g *bulkGate) holding() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.held
}

// bulkSlice is how long a write that cannot tell a wait from work (a
// connection that is no socket nor TLS over one: the tests' in-memory
// ones) holds its token at most: past it, the write is
// waiting for a slow or stalled peer, not for a CPU, and gives the token
// back so that it holds back no other peer's blocks. A variable so a
// test can tell the exact give-back of sockets from it; a plane reads it
// when it is made.
var bulkSlice = 10 * time.Millisecond

// takeBulkFor takes a token for at most bulkSlice and returns the func
// that gives it back if the slice has not.
func (p *TCPPlane) takeBulkFor() (give func()) {
	p.bulk.take()
	var held atomic.Bool
	held.Store(true)
	back := func() bool {
		if held.CompareAndSwap(true, false) {
			p.bulk.give()
			return true
		}
		return false
	}
	t := time.AfterFunc(p.slice, func() {
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
// socket, and on TLS over one (where the encryption runs under the token
// too), it holds a token while the kernel takes the bytes and gives it
// back to wait for room when the socket is full (writeRaw). Other
// connections hold a token for the write, or bulkSlice at most.
func (p *TCPPlane) writeBlock(c net.Conn, hdr, block []byte, crc uint32) error {
	var trailer [wire.DataTrailerSize]byte
	binary.BigEndian.PutUint32(trailer[:], crc)
	bufs := [][]byte{hdr, block, trailer[:]}
	if raw := rawConn(c); raw != nil {
		var st rawWrite
		_, err := p.writeRaw(raw, bufs, &st)
		if st.held {
			p.bulk.give()
		}
		return err
	}
	if tc, ok := c.(*tlsConn); ok && tc.sock.raw != nil {
		p.bulk.take()
		h := &bulkHold{p: p, st: rawWrite{held: true}}
		tc.sock.hold.Store(h)
		nb := net.Buffers(bufs)
		_, err := nb.WriteTo(c)
		tc.sock.hold.Store(nil)
		h.mu.Lock()
		h.done = true // a Write that loaded h late writes without it
		held := h.st.held
		h.mu.Unlock()
		if held {
			p.bulk.give()
		}
		return err
	}
	give := p.takeBulkFor()
	defer give()
	nb := net.Buffers(bufs)
	_, err := nb.WriteTo(c)
	return err
}

// rawConn is c's socket, nil when c is not one.
func rawConn(c net.Conn) syscall.RawConn {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return raw
}

// rawWrite is the state of one block's write through writeRaw, over
// however many calls (TLS makes one a record).
type rawWrite struct {
	held   bool // it holds a token
	waited bool // it gave one back to wait for room (counted once a block)
}

// writeRaw writes bufs to the socket raw, holding a token (st.held says
// whether it holds one) while the kernel takes bytes: when the socket is
// full it gives the token back and the poller waits for room without
// one. It never waits for a token inside the socket's write lock, which a
// Close of the connection would wait behind. It returns the bytes
// written.
func (p *TCPPlane) writeRaw(raw syscall.RawConn, bufs [][]byte, st *rawWrite) (int, error) {
	var werr error
	written := 0
	for len(bufs) > 0 && werr == nil {
		if !st.held {
			p.bulk.take()
			st.held = true
		}
		err := raw.Write(func(fd uintptr) bool {
			if !st.held {
				if !p.bulk.tryTake() {
					return true // to wait for one outside the write lock
				}
				st.held = true
			}
			for len(bufs) > 0 {
				n, err := unix.Writev(int(fd), bufs)
				switch {
				case err == unix.EINTR:
					continue
				case err == unix.EAGAIN:
					if !st.waited {
						st.waited = true
						p.bulkYields.Add(1)
					}
					p.bulk.give()
					st.held = false
					return false // the poller waits for room, without a token
				case err != nil:
					werr = os.NewSyscallError("writev", err)
					return true
				}
				written += n
				bufs = consumed(bufs, n)
			}
			return true
		})
		if err != nil {
			werr = err
		}
	}
	return written, werr
}

// bulkSocket is the TCP connection under a TLS one. While the plane's
// writer writes a block over the TLS connection (the only goroutine that
// writes a data connection it dialled), hold says so, and the records
// TLS writes go out through writeRaw under the block's token.
type bulkSocket struct {
	net.Conn
	raw  syscall.RawConn // nil when Conn is not a socket
	hold atomic.Pointer[bulkHold]
}

// bulkHold is a block write's token over TLS. mu orders the records'
// writes with the block's end (done), after which a Write of another
// goroutine that loaded the hold late takes no token nobody gives back.
type bulkHold struct {
	p    *TCPPlane
	mu   sync.Mutex
	st   rawWrite
	done bool
}

func newBulkSocket(c net.Conn) *bulkSocket { return &bulkSocket{Conn: c, raw: rawConn(c)} }

func (s *bulkSocket) Write(b []byte) (int, error) {
	if h := s.hold.Load(); h != nil {
		h.mu.Lock()
		defer h.mu.Unlock()
		if !h.done {
			return h.p.writeRaw(s.raw, [][]byte{b}, &h.st)
		}
	}
	return s.Conn.Write(b)
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
