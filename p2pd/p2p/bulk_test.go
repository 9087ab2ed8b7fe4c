package p2p

import (
	"context"
	"io"
	"log/slog"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
)

// Issue 12: the bulk token on the socket path of writeBlock, over real
// loopback sockets (real time; each wait below has its bound). Each test
// fails under one mutation the others pass (found in review): the socket
// path taking no token; keeping it when the write fails; waiting for one
// inside the socket's write lock, which a Close waits behind.

func rawPair(t *testing.T, buf int) (w, r *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ch := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil && buf > 0 {
			c.(*net.TCPConn).SetReadBuffer(buf)
		}
		ch <- c
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if buf > 0 {
		c.(*net.TCPConn).SetWriteBuffer(buf)
	}
	rc := <-ch
	if rc == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { c.Close(); rc.Close() })
	return c.(*net.TCPConn), rc.(*net.TCPConn)
}

func rawPlane(t *testing.T) *TCPPlane {
	p := NewTCPPlane(nil, TCP{}, TCPPlaneConfig{Bulk: 1}, slog.New(slog.DiscardHandler))
	t.Cleanup(func() { p.Close() })
	return p
}

// waitFor polls cond for 5 s at most.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after 5 s: %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestRawWriteTakesAToken(t *testing.T) {
	p := rawPlane(t)
	w, r := rawPair(t, 0)
	go io.Copy(io.Discard, r)
	p.bulk.take() // the only token, held by another write
	done := make(chan error, 1)
	go func() { done <- p.writeBlock(w, []byte{1, 2, 3}, make([]byte, 4096), 7) }()
	waitFor(t, "the write never waited for the token", func() bool { return p.bulk.waits.Load() == 1 })
	select {
	case err := <-done:
		t.Fatalf("a block went out with no token free (%v)", err)
	default:
	}
	p.bulk.give()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the block waited after the token was free")
	}
	if p.bulk.holding() != 0 {
		t.Errorf("%d tokens held after the write", p.bulk.holding())
	}
}

func TestRawWriteErrorGivesTokenBack(t *testing.T) {
	p := rawPlane(t)
	big := make([]byte, 16<<20)
	w, _ := rawPair(t, 4096) // never read
	w.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
	if err := p.writeBlock(w, []byte{1}, big, 0); err == nil {
		t.Fatal("a 16 MiB block went into a socket nobody reads")
	}
	if n := p.bulk.holding(); n != 0 {
		t.Fatalf("%d tokens held after a write deadline expired", n)
	}
	w2, r2 := rawPair(t, 4096)
	done := make(chan error, 1)
	go func() { done <- p.writeBlock(w2, []byte{1}, big, 0) }()
	waitFor(t, "the second socket never filled", func() bool { return p.bulkYields.Load() >= 2 })
	r2.SetLinger(0)
	r2.Close() // a reset: writev fails
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a block reported sent to a reset peer")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the write did not end on the peer's reset")
	}
	if n := p.bulk.holding(); n != 0 {
		t.Fatalf("%d tokens held after a write failed", n)
	}
}

func TestRawWriteWaitsForTokenOutsideLock(t *testing.T) {
	p := rawPlane(t)
	w, r := rawPair(t, 0)
	done := make(chan error, 1)
	go func() { done <- p.writeBlock(w, []byte{1}, make([]byte, 64<<20), 0) }()
	waitFor(t, "the socket never filled", func() bool { return p.bulkYields.Load() >= 1 })
	p.bulk.take() // another write holds the only token now
	// Make room: the writer wakes, finds no token and waits for one.
	buf := make([]byte, 1<<16)
	r.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	for got := 0; got < 8<<20; {
		n, err := r.Read(buf)
		got += n
		if err != nil {
			break
		}
	}

	waitFor(t, "the writer never waited for a token", func() bool { return p.bulk.waits.Load() >= 1 })
	closed := make(chan struct{})
	go func() { w.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(2 * time.Second):
		t.Error("Close of the connection waited for a bulk token (the writer waits for one inside the write lock)")
	}
	p.bulk.give()
	select {
	case err := <-done:
		if err == nil {
			t.Error("the block reported sent on a closed connection")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the write did not end after its connection closed")
	}
	<-closed
	if n := p.bulk.holding(); n != 0 {
		t.Fatalf("%d tokens held", n)
	}
}

// tlsPair dials a TLS data connection (as the plane does) to an accepted
// one whose socket reads with a buf-byte buffer.
func tlsPair(t *testing.T, buf int) (w, r *tlsConn) {
	t.Helper()
	ca := newTestCA(t, "ca")
	prod, cons := ca.network("prod", 5*time.Second), ca.network("cons", 5*time.Second)
	ln, err := cons.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ch := make(chan *tlsConn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			ch <- nil
			return
		}
		tc := c.(*tlsConn)
		if buf > 0 {
			tc.raw.(*net.TCPConn).SetReadBuffer(buf)
		}
		if tc.handshake() != nil {
			ch <- nil
			return
		}
		ch <- tc
	}()
	c, err := prod.Dial(context.Background(), ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	wc := c.(*tlsConn)
	if buf > 0 {
		wc.raw.(*net.TCPConn).SetWriteBuffer(buf)
	}
	rc := <-ch
	if rc == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { wc.Close(); rc.Close() })
	return wc, rc
}

// A TLS block write that times out on a stalled peer ends holding no
// token and leaves no hold on its socket (a later write would use it).
func TestTLSWriteErrorGivesTokenBack(t *testing.T) {
	p := rawPlane(t)
	w, _ := tlsPair(t, 4096)
	w.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	if err := p.writeBlock(w, []byte{1}, make([]byte, 16<<20), 0); err == nil {
		t.Fatal("16 MiB into a socket nobody reads")
	}
	if n := p.bulk.holding(); n != 0 {
		t.Fatalf("%d tokens held", n)
	}
	if w.sock.hold.Load() != nil {
		t.Fatal("hold left set")
	}
}

// One block over TLS to a slow reader counts one bulk yield, as over TCP,
// though TLS writes it record by record (a review: it counted 5 for a
// 128 KiB block).
func TestTLSWriteYieldsOnceABlock(t *testing.T) {
	p := rawPlane(t)
	w, r := tlsPair(t, 4096)
	go func() {
		buf := make([]byte, 4096)
		for {
			time.Sleep(time.Millisecond) // a slow reader
			if _, err := r.Read(buf); err != nil {
				return
			}
		}
	}()
	if err := p.writeBlock(w, []byte{1}, make([]byte, 128<<10), 0); err != nil {
		t.Fatal(err)
	}
	if n := p.bulkYields.Load(); n != 1 {
		t.Errorf("one block write to a slow reader counted %d bulk yields, want 1", n)
	}
	if n := p.bulk.holding(); n != 0 {
		t.Fatalf("%d tokens held", n)
	}
}

// Issue 12: the gate holds bulk writes to n tokens, and to one fewer (but
// never none) while the engine is busy; a waiter takes a token when one
// is given back, the limit read again then.
func TestBulkGateLeavesACoreWhileEngineBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var busy atomic.Bool
		g := newBulkGate(2, busy.Load)
		if !g.tryTake() || !g.tryTake() {
			t.Fatal("an idle engine's gate refused one of its two tokens")
		}
		if g.tryTake() {
			t.Fatal("a third token of two")
		}
		g.give()
		g.give()
		busy.Store(true)
		if !g.tryTake() {
			t.Fatal("a busy engine's gate refused its first token")
		}
		if g.tryTake() {
			t.Fatal("a busy engine's gate gave bulk its last CPU")
		}
		took := make(chan struct{})
		go func() { g.take(); close(took) }()
		synctest.Wait()
		select {
		case <-took:
			t.Fatal("take did not wait while the engine was busy")
		default:
		}
		busy.Store(false)
		g.give()
		<-took
		if w, h := g.waits.Load(), g.holding(); w != 1 || h != 1 {
			t.Errorf("after the give: %d waits, %d held; want 1, 1", w, h)
		}
		one := newBulkGate(1, func() bool { return true })
		if !one.tryTake() {
			t.Error("a one-token gate refused its token while the engine was busy")
		}
	})
}

// Issue 12: a given-back token goes to the oldest waiting take, so one
// peer's writer, giving and taking again block after block, cannot keep
// another peer's block waiting (a review: the gate this replaced woke
// every waiter and let the first to lock take the token); a limit that
// rose while takes waited hands the next give's token and the free one.
func TestBulkGateTakesInLine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newBulkGate(1, nil)
		g.take() // one peer's writer, on its block
		var order []int
		var mu sync.Mutex
		done := make(chan struct{}, 2)
		for i := range 2 { // two more blocks wait, first 0, then 1
			go func() {
				g.take()
				mu.Lock()
				order = append(order, i)
				mu.Unlock()
				g.give()
				done <- struct{}{}
			}()
			synctest.Wait()
		}
		g.give()
		if g.tryTake() {
			t.Fatal("a give and take again went ahead of the waiting takes")
		}
		g.take() // its next block: after both
		if h := g.holding(); h != 1 {
			t.Errorf("%d tokens held, want 1", h)
		}
		<-done
		<-done
		g.give()
		if !slices.Equal(order, []int{0, 1}) {
			t.Errorf("takes served in order %v, want [0 1]", order)
		}

		var busy atomic.Bool
		busy.Store(true)
		g = newBulkGate(2, busy.Load)
		g.take()
		for range 2 {
			go func() { g.take(); done <- struct{}{} }()
		}
		synctest.Wait()
		busy.Store(false) // two tokens, one held, two takes waiting
		g.give()
		<-done
		<-done
		if h, w := g.holding(), g.waits.Load(); h != 2 || w != 2 {
			t.Errorf("after the rise and a give: %d held, %d waits; want 2, 2", h, w)
		}
	})
}

// Issue 12: bulk_concurrency 0 is GOMAXPROCS tokens, one fewer while the
// manager's engine has requests (the tier passes its EngineBusy); a
// configured value is fixed.
func TestBulkDefault(t *testing.T) {
	nd := newNode(t, newMemNet(), nil, 4)
	p := nd.tier.dp.(*TCPPlane)
	if p.bulk.n != runtime.GOMAXPROCS(0) || p.bulk.busy == nil {
		t.Fatalf("default: %d tokens, busy %v; want GOMAXPROCS (%d) and the manager's", p.bulk.n, p.bulk.busy != nil, runtime.GOMAXPROCS(0))
	}
	req := &offload.Request{ID: "engine"}
	nd.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
	if !p.bulk.busy() {
		t.Error("the plane did not see the engine's request")
	}
	nd.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	if p.bulk.busy() {
		t.Error("the plane saw the engine busy after its request finished")
	}
	fixed := newNode(t, newMemNet(), func(c *Config) { c.BulkConcurrency = 3 }, 4).tier.dp.(*TCPPlane)
	if fixed.bulk.n != 3 || fixed.bulk.busy != nil {
		t.Errorf("bulk_concurrency 3: %d tokens, busy %v; want 3, none", fixed.bulk.n, fixed.bulk.busy != nil)
	}
}
