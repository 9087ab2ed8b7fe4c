package p2p

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/crc32c"
	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// hsConn is an attacker's end of a handshake: frames written and read by
// hand, a Disconnect read as the node's reject.
type hsConn struct {
	c   net.Conn
	buf []byte
}

func (h *hsConn) write(m wire.Msg) error {
	var err error
	h.buf, err = wire.Write(h.c, h.buf, m)
	return err
}

func (h *hsConn) read(limit int) (wire.Msg, error) {
	p, err := wire.ReadFrame(h.c, nil, limit)
	if err != nil {
		return nil, err
	}
	m, err := wire.Decode(p)
	if err != nil {
		return nil, err
	}
	if d, ok := m.(wire.Disconnect); ok {
		return nil, &rejectError{Code: d.Code, ByPeer: true, Text: d.Reason}
	}
	return m, nil
}

// expectMsg reads a message of type M.
func expectMsg[M wire.Msg](h *hsConn, limit int) (M, error) {
	var zero M
	m, err := h.read(limit)
	if err != nil {
		return zero, err
	}
	v, ok := m.(M)
	if !ok {
		return zero, fmt.Errorf("%v where %v was due", m.Type(), zero.Type())
	}
	return v, nil
}

// rawDial opens a connection to n's P2P port and sends a hello.
func rawDial(t *testing.T, mn *memNet, n *node, kind wire.ConnKind, id string, inc [16]byte, nonce [32]byte) *hsConn {
	t.Helper()
	c, err := mn.Dial(context.Background(), n.tier.Addr())
	if err != nil {
		t.Fatal(err)
	}
	h := &hsConn{c: c}
	if err := h.write(wire.Hello{Version: wire.Version, Kind: kind, NodeID: id, Incarnation: inc, Nonce: nonce}); err != nil {
		t.Fatal(err)
	}
	return h
}

// S7.1: a data connection that cannot prove the session key is closed
// before anything is read from it, and counted; one from a process the
// node has no session with is refused at once. Only the real peer's
// connection is served.
func TestDataConnectionAuthentication(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		cons := newNode(t, mn, func(c *Config) { c.ClusterToken = "s3cret" }, 16)
		f := newFake(t, "fake", "s3cret")
		c, _ := mn.Dial(context.Background(), cons.tier.Addr())
		f.c = c
		if _, err := f.shaker().dialControl(c); err != nil {
			t.Fatal(err)
		}
		f.serve()
		synctest.Wait()
		self := peerID{Node: cons.tier.self.NodeID, Inc: cons.tier.self.Incarnation}
		for name, tc := range map[string]struct {
			token string
			inc   [16]byte
		}{
			"no token":        {token: "", inc: f.inc},
			"wrong token":     {token: "guess", inc: f.inc},
			"unknown process": {token: "s3cret", inc: [16]byte{0xff}},
		} {
			before := stat(cons, "kv_offload_p2p_handshake_rejects_total")
			spoof := &handshaker{Shaker: protocol.Shaker{Self: peerID{Node: "fake", Inc: tc.inc}, Token: []byte(tc.token)}}
			dc, _ := mn.Dial(context.Background(), cons.tier.Addr())
			err := spoof.dialData(dc, self)
			var re *rejectError
			if !errors.As(err, &re) || re.Code != wire.CodeAuth {
				t.Errorf("%s: data handshake %v, want a reject with code auth", name, err)
			}
			dc.Close()
			synctest.Wait()
			if v := stat(cons, "kv_offload_p2p_handshake_rejects_total"); v != before+1 {
				t.Errorf("%s: rejects %v, want %v", name, v, before+1)
			}
		}
		dc, _ := mn.Dial(context.Background(), cons.tier.Addr())
		if err := f.shaker().dialData(dc, self); err != nil {
			t.Errorf("the real peer's data connection: %v", err)
		}
		dc.Close()
		if cons.m.Metrics().CPU.Used != 0 {
			t.Error("a slot was written")
		}
	})
}

// S8.1: frames before authentication are at most 64 KiB: a hello that
// claims more is a protocol error, and nothing of it is allocated.
func TestPreAuthFrameLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		n := newNode(t, mn, nil, 4)
		c, _ := mn.Dial(context.Background(), n.tier.Addr())
		go c.Write([]byte{0, 2, 0, 0}) // a 128 KiB frame announced
		var b [1]byte
		c.SetReadDeadline(time.Now().Add(time.Minute))
		if _, err := c.Read(b[:]); err == nil {
			t.Fatal("the node answered an oversized hello")
		}
		synctest.Wait()
		if v := stat(n, "kv_offload_p2p_handshake_rejects_total"); v != 1 {
			t.Errorf("rejects %v, want 1", v)
		}
	})
}

// S8.1: beyond max_handshakes connections in their handshake, new ones are
// closed unread; the stalled ones go at handshake_timeout, and a real peer
// connects afterwards.
func TestHandshakeCap(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		n := newNode(t, mn, func(c *Config) { c.MaxHandshakes = 2 }, 4)
		var stalled []net.Conn
		for range 5 {
			c, err := mn.Dial(context.Background(), n.tier.Addr())
			if err != nil {
				t.Fatal(err)
			}
			stalled = append(stalled, c)
		}
		synctest.Wait()
		if v := stat(n, "kv_offload_p2p_handshakes_in_progress"); v != 2 {
			t.Errorf("handshakes in progress %v, want 2", v)
		}
		if v := stat(n, "kv_offload_p2p_handshake_cap_drops_total"); v != 3 {
			t.Errorf("cap drops %v, want 3", v)
		}
		time.Sleep(time.Duration(DefaultConfig().HandshakeTimeout) + time.Second)
		synctest.Wait()
		if v := stat(n, "kv_offload_p2p_handshakes_in_progress"); v != 0 {
			t.Errorf("handshakes in progress after the timeout %v, want 0", v)
		}
		connectFake(t, mn, n, "fake")
		synctest.Wait()
		if ps := n.tier.Peers(); len(ps) != 1 || !ps[0].Ready {
			t.Errorf("peers %+v, want the fake, ready", ps)
		}
		for _, c := range stalled {
			c.Close()
		}
	})
}

// failingNet's listener fails its first Accepts, like a process out of fds.
type failingNet struct {
	*memNet
	fails int
}

type failingListener struct {
	net.Listener
	mu    sync.Mutex
	fails int
}

func (n failingNet) Listen(addr string) (net.Listener, error) {
	l, err := n.memNet.Listen(addr)
	return &failingListener{Listener: l, fails: n.fails}, err
}

func (l *failingListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	fail := l.fails > 0
	l.fails--
	l.mu.Unlock()
	if fail {
		return nil, errors.New("accept: too many open files")
	}
	return l.Listener.Accept()
}

// S8.1: accept errors do not stop the accept loop: they are retried with
// backoff and counted, and the next peer is served.
func TestAcceptErrorsRetried(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		n := newNode(t, failingNet{mn, 3}, nil, 4)
		connectFake(t, mn, n, "fake")
		synctest.Wait()
		if v := stat(n, "kv_offload_p2p_accept_errors_total"); v != 3 {
			t.Errorf("accept errors %v, want 3", v)
		}
		if ps := n.tier.Peers(); len(ps) != 1 || !ps[0].Ready {
			t.Errorf("peers %+v, want the fake, ready", ps)
		}
	})
}

// S6.1: a static peer that is not listening yet is dialled again with
// backoff until it connects.
func TestStaticPeerRedial(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		a := newNode(t, mn, func(c *Config) { c.Peers = []string{"late:1"} }, 4)
		synctest.Wait()
		time.Sleep(5 * time.Second) // several failed dials
		l, _ := mn.Listen("late:1")
		acceptFake(t, l, "late")
		synctest.Wait()
		if ps := a.tier.Peers(); len(ps) != 1 || !ps[0].Ready || ps[0].Node != "late" {
			t.Errorf("peers %+v, want late, ready", ps)
		}
	})
}

// S8.5: cancelled rounds are remembered at most maxDead.
func TestDeadRoundsBounded(t *testing.T) {
	p := NewTCPPlane(nil, nil, TCPPlaneConfig{Conns: 1}, nil)
	for r := range uint64(3 * maxDead) {
		p.Unexpect("peer", r, func() {})
	}
	if len(p.dead) != maxDead || len(p.deadFIFO) != maxDead {
		t.Errorf("dead rounds %d (fifo %d), want %d", len(p.dead), len(p.deadFIFO), maxDead)
	}
	if !p.dead[roundKey{"peer", 3*maxDead - 1}] || p.dead[roundKey{"peer", 0}] {
		t.Error("the newest dead round is forgotten or the oldest kept")
	}
}

// S6.1: two nodes that fetch from each other for the first time dial each
// other at once; the duplicate connection retires without losing work:
// every request gets all its hits, none recomputes, no peer death.
func TestDuplicateDialsKeepWork(t *testing.T) {
	const pairs = 12
	for i := range pairs {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			a := newNode(t, nil, func(c *Config) { c.NodeID = fmt.Sprintf("a%02d", i) }, 32)
			b := newNode(t, nil, func(c *Config) { c.NodeID = fmt.Sprintf("b%02d", 20-i) }, 32)
			ka, kb := testKeys(2*i+1, 3), testKeys(2*i+2, 3)
			a.store(t, ka)
			b.store(t, kb)
			ra := &offload.Request{ID: "ra", TransferParams: source("kv-a", b.tier.Addr())}
			rb := &offload.Request{ID: "rb", TransferParams: source("kv-b", a.tier.Addr())}
			var wg sync.WaitGroup
			results := make([][]offload.Result, 2)
			for j, x := range []struct {
				n    *node
				r    *offload.Request
				keys []offload.Key
			}{{a, ra, kb}, {b, rb, ka}} {
				wg.Go(func() {
					x.n.m.Do(func(s *offload.Step) { s.OnNewRequest(x.r) })
					results[j] = x.n.prefix(t, x.r, x.keys, realWait(x.n.m))
					x.n.m.Do(func(s *offload.Step) { s.OnRequestFinished(x.r) })
				})
			}
			wg.Wait()
			for j, got := range results {
				if fmt.Sprint(got) != fmt.Sprint([]offload.Result{offload.Hit, offload.Hit, offload.Hit}) {
					t.Errorf("node %d: answers %v, want three hits", j, got)
				}
			}
			for _, n := range []*node{a, b} {
				if v := stat(n, "kv_offload_p2p_peer_deaths_total"); v != 0 {
					t.Errorf("%s: %v peer deaths", n.tier.NodeID(), v)
				}
				t.Logf("%s: %v duplicate connections", n.tier.NodeID(), stat(n, "kv_offload_p2p_duplicate_connections_total"))
			}
		})
	}
}

// S6.1, S8.5: a peer process that connects again and again keeps at most
// maxRetiring duplicates; when its session dies every one of them is
// closed, so the node still shuts down (Close joins their goroutines).
func TestKillClosesRetiringDuplicates(t *testing.T) {
	// 4 connections leave 3 retiring (a slice with spare capacity, which
	// once made kill skip some); 7 hit the cap.
	for _, conns := range []int{4, maxRetiring + 3} {
		t.Run(fmt.Sprint(conns), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				mn := newMemNet()
				n := newNode(t, mn, nil, 4)
				var fs []*fakePeer
				for range conns {
					fs = append(fs, connectFake(t, mn, n, "fake"))
					synctest.Wait()
				}
				n.m.Do(func(*offload.Step) {
					for s := range n.tier.sessions {
						if want := min(conns-1, maxRetiring); len(s.old) != want {
							t.Errorf("%d retiring duplicates, want %d", len(s.old), want)
						}
					}
				})
				// A protocol error on the active connection kills the session
				// (sent on every connection: which one is active depends on nonces).
				for _, f := range fs {
					wire.Write(f.c, nil, wire.Hello{Version: wire.Version, Kind: wire.KindControl, NodeID: "fake"})
				}
				synctest.Wait()
				if ps := n.tier.Peers(); len(ps) != 0 {
					t.Errorf("peers %+v after the protocol error", ps)
				}
				n.m.Close() // hangs if a duplicate's writer was left running
			})
		})
	}
}

// S8.1: one source address holds at most maxPerIP handshake slots; the
// rest of its connections are closed at once, and another address still
// gets in. Real loopback sockets (every 127/8 address is local).
func TestHandshakesPerAddress(t *testing.T) {
	n := newNode(t, nil, nil, 4)
	var silent []net.Conn
	defer func() {
		for _, c := range silent {
			c.Close()
		}
	}()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)}, Timeout: 2 * time.Second}
	for range maxPerIP + 2 {
		c, err := d.Dial("tcp", n.tier.Addr())
		if err != nil {
			t.Fatal(err)
		}
		silent = append(silent, c)
	}
	deadline := time.Now().Add(5 * time.Second)
	for stat(n, "kv_offload_p2p_handshake_cap_drops_total") < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("cap drops %v, want 2", stat(n, "kv_offload_p2p_handshake_cap_drops_total"))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if v := stat(n, "kv_offload_p2p_handshakes_in_progress"); v != maxPerIP {
		t.Errorf("handshakes in progress %v, want %d", v, maxPerIP)
	}
	other := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}, Timeout: 2 * time.Second}
	c, err := other.Dial("tcp", n.tier.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	h := &hsConn{c: c}
	h.write(wire.Hello{Version: wire.Version, Kind: wire.KindControl, NodeID: "other", Nonce: newNonce()})
	if _, err := expectMsg[wire.Challenge](h, wire.MaxPreAuthFrame); err != nil {
		t.Errorf("a connection from another address: %v, want a challenge", err)
	}
}

// S8.1: an accepted connection that sends no hello is closed after 2 s,
// well before handshake_timeout, freeing its slot.
func TestHelloTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		n := newNode(t, mn, nil, 4)
		c, _ := mn.Dial(context.Background(), n.tier.Addr())
		defer c.Close()
		closed := make(chan time.Duration, 1)
		start := time.Now()
		go func() {
			var b [1]byte
			c.Read(b[:])
			closed <- time.Since(start)
		}()
		if d := <-closed; d != helloTimeout {
			t.Errorf("a silent connection closed after %v, want %v", d, helloTimeout)
		}
	})
}

// S8.5: a peer that keeps asking but never reads its control connection
// loses its session once maxQueued bytes wait for it.
func TestSendQueueBound(t *testing.T) {
	defer func(q int) { maxQueued = q }(maxQueued)
	maxQueued = 4 << 10
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		n := newNode(t, mn, nil, 4)
		c, _ := mn.Dial(context.Background(), n.tier.Addr())
		defer c.Close()
		f := newFake(t, "greedy", "")
		f.c = c
		if _, err := f.shaker().dialControl(c); err != nil {
			t.Fatal(err)
		}
		keys := wkeys(testKeys(1, 8))
		for i := range 64 { // ~330 bytes of answer each; the fake reads none
			f.send(wire.Lookup{ReqID: fmt.Sprint("kv", i), Round: 1, Keys: keys})
			synctest.Wait()
			if len(n.tier.Peers()) == 0 {
				break
			}
		}
		synctest.Wait()
		if ps := n.tier.Peers(); len(ps) != 0 {
			t.Errorf("peers %+v: a peer that never reads kept its session", ps)
		}
	})
}

// S6.6, S8.1: a producer that stalls inside a block is cut off after
// data_idle_timeout: the round fails and its slots are released, no
// reader stays inside a slot.
func TestDataStallInsideBlock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nd := newNode(t, newMemNet(), nil, 4)
		p := NewTCPPlane(nd.m.Arena(), nil, TCPPlaneConfig{Conns: 1, IdleTimeout: time.Minute}, slog.New(slog.DiscardHandler))
		defer p.Close()
		if err := p.AddPeer("prod", "prod:1", nil); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		p.Expect("prod", 1, []uint32{0}, func(err error) { done <- err })
		a, b := net.Pipe()
		defer b.Close()
		admitData(t, p, "prod", a)
		var hdr [wire.DataHeaderSize]byte
		wire.PutDataHeader(hdr[:], wire.DataHeader{Round: 1, Slot: 0, Len: uint32(nd.m.BlockBytes())})
		b.Write(hdr[:])
		b.Write(make([]byte, 100)) // then nothing more
		start := time.Now()
		err := <-done
		if err == nil || time.Since(start) != time.Minute {
			t.Errorf("stalled block: %v after %v, want an error after 1m", err, time.Since(start))
		}
		drained := make(chan struct{})
		p.Unexpect("prod", 1, func() { close(drained) })
		<-drained
	})
}

// Issue 12: block writes across peers are bounded by bulk_concurrency,
// and a peer that stops reading holds its token for bulkSlice only: with
// one token, a block for a second peer goes out exactly bulkSlice after
// the first peer stalled inside its block (at once without the bound; a
// minute later, at data_idle_timeout, without the slice).
func TestBulkConcurrencyAcrossPeers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nd := newNode(t, newMemNet(), nil, 4)
		mn := newMemNet()
		p := NewTCPPlane(nd.m.Arena(), mn, TCPPlaneConfig{Conns: 1, IdleTimeout: time.Minute, Bulk: 1}, slog.New(slog.DiscardHandler))
		defer p.Close()
		conns := map[string]chan net.Conn{}
		for _, peer := range []string{"a", "b"} {
			ln, err := mn.Listen(peer + ":1")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			if err := p.AddPeer(peer, peer+":1", nil); err != nil {
				t.Fatal(err)
			}
			ch := make(chan net.Conn, 1)
			conns[peer] = ch
			go func() {
				if c, err := ln.Accept(); err == nil {
					ch <- c
				}
			}()
		}
		done := map[string]chan error{"a": make(chan error, 1), "b": make(chan error, 1)}
		p.Write("a", 1, []SlotPair{{Local: 0, Remote: 0}}, func(err error) { done["a"] <- err })
		stalled := <-conns["a"] // never read: a's writer blocks inside its block, holding the token
		defer stalled.Close()
		synctest.Wait()
		start := time.Now()
		p.Write("b", 1, []SlotPair{{Local: 1, Remote: 0}}, func(err error) { done["b"] <- err })
		c := <-conns["b"]
		defer c.Close()
		go io.Copy(io.Discard, c)
		if err := <-done["b"]; err != nil || time.Since(start) != bulkSlice {
			t.Errorf("the second peer's block: %v after %v, want it sent after bulkSlice (%v)", err, time.Since(start), bulkSlice)
		}
		if w, s := p.bulk.waits.Load(), p.bulkYields.Load(); w != 1 || s != 1 {
			t.Errorf("bulk waits %d, slow writes %d; want 1 and 1", w, s)
		}
		stalled.Close()
		if err := <-done["a"]; err == nil {
			t.Error("the stalled peer's block reported sent")
		}
	})
}

// Issue 12: over a real TCP socket, and over TLS on one, a block write
// gives its bulk token back as soon as the socket is full, not after
// bulkSlice: with one token and a peer that stops reading, a second
// peer's blocks still go out. Real sockets and real time: the bound below
// (5 s) is what fails when the stalled write keeps its token (until
// data_idle_timeout, a minute), bulkSlice set beyond it so that the
// fallback's give-back cannot pass for the socket's.
func TestBulkTokenNotHeldWhileSocketFull(t *testing.T) {
	defer func(d time.Duration) { bulkSlice = d }(bulkSlice)
	bulkSlice = time.Hour
	ca := newTestCA(t, "ca")
	for _, tc := range []struct {
		name       string
		prod, cons Network
	}{
		{"tcp", TCP{}, TCP{}},
		{"tls", ca.network("prod", 5*time.Second), ca.network("cons", 5*time.Second)},
	} {
		t.Run(tc.name, func(t *testing.T) { bulkSocketFull(t, tc.prod, tc.cons) })
	}
}

func bulkSocketFull(t *testing.T, prodNet, consNet Network) {
	nd := newNode(t, newMemNet(), nil, 64)
	p := NewTCPPlane(nd.m.Arena(), prodNet, TCPPlaneConfig{Conns: 1, IdleTimeout: time.Minute, Bulk: 1}, slog.New(slog.DiscardHandler))
	defer p.Close()
	accepted := map[string]chan net.Conn{}
	for _, peer := range []string{"a", "b"} {
		ln, err := consNet.Listen("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		if err := p.AddPeer(peer, ln.Addr().String(), nil); err != nil {
			t.Fatal(err)
		}
		ch := make(chan net.Conn, 1)
		accepted[peer] = ch
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			tcp := c
			if tc, ok := c.(*tlsConn); ok {
				tcp = tc.raw
				if tc.handshake() != nil { // the dial waits for it; then nothing is read
					c.Close()
					return
				}
			}
			tcp.(*net.TCPConn).SetReadBuffer(4096)
			ch <- c
		}()
	}
	pairs := make([]SlotPair, 4096) // more than the stalled socket's buffers take
	for i := range pairs {
		pairs[i] = SlotPair{Local: uint32(i % 64), Remote: uint32(i)}
	}
	aDone, bDone := make(chan error, 1), make(chan error, 1)
	p.Write("a", 1, pairs, func(err error) { aDone <- err })
	stalled := <-accepted["a"] // never read
	defer stalled.Close()
	waitFor(t, "the stalled peer's socket never filled", func() bool { return p.bulkYields.Load() > 0 })
	p.Write("b", 1, pairs[:4], func(err error) { bDone <- err })
	c := <-accepted["b"]
	defer c.Close()
	go io.Copy(io.Discard, c)
	select {
	case err := <-bDone:
		if err != nil {
			t.Errorf("the second peer's blocks: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the second peer's blocks waited behind a peer that does not read")
	}
	stalled.Close()
	if err := <-aDone; err == nil {
		t.Error("the stalled peer's blocks reported sent")
	}
	if n := p.bulk.holding(); n != 0 {
		t.Errorf("%d bulk tokens still held after both writes ended", n)
	}
}

// slotsOf returns the CPU slots of ready keys.
func slotsOf(t *testing.T, n *node, keys []offload.Key) []int32 {
	t.Helper()
	req := &offload.Request{ID: "slots-of"}
	var slots []int32
	n.m.Do(func(s *offload.Step) {
		s.OnNewRequest(req)
		var err error
		if slots, err = s.PrepareLoad(keys, req); err != nil {
			t.Fatal(err)
		}
		s.CompleteLoad(keys, req)
		s.OnRequestFinished(req)
	})
	return slots
}

// S7.2: the producer sends the checksum kept with the slot, reading the
// block once; the consumer keeps the checksum it verified. A producer
// block whose bytes and kept checksum disagree is never accepted: the
// round fails and is counted, and the request recomputes.
func TestChecksumKeptWithSlot(t *testing.T) {
	prod := newNode(t, nil, nil, 32)
	cons := newNode(t, nil, nil, 32)
	keys := testKeys(5, 3)
	prod.store(t, keys)
	if got := cons.fetchFrom(t, "kv-1", prod.tier.Addr(), keys); fmt.Sprint(got) != fmt.Sprint([]offload.Result{offload.Hit, offload.Hit, offload.Hit}) {
		t.Fatalf("answers %v, want three hits", got)
	}
	for i, slot := range slotsOf(t, cons, keys) {
		crc, ok := cons.m.Arena().Sum(int(slot))
		if !ok || crc != crc32.Checksum(cons.m.Arena().Slot(int(slot)), crc32c.Table) {
			t.Errorf("fetched block %d: kept checksum %08x (%v), want its bytes'", i, crc, ok)
		}
	}

	bad := slotsOf(t, prod, keys[1:2])[0]
	sum, _ := prod.m.Arena().Sum(int(bad))
	prod.m.Arena().SetSum(int(bad), sum^1) // the kept checksum no longer matches the bytes
	cons2 := newNode(t, nil, nil, 32)
	// prefix asks one key a step: the first arrives; the corrupt second
	// fails its round and the request answers Miss from there (recompute).
	if got := cons2.fetchFrom(t, "kv-2", prod.tier.Addr(), keys); fmt.Sprint(got) != fmt.Sprint([]offload.Result{offload.Hit, offload.Miss}) {
		t.Errorf("answers %v with a corrupt second block, want hit then miss", got)
	}
	if v := stat(cons2, "kv_offload_p2p_crc_errors_total"); v != 1 {
		t.Errorf("crc errors %v, want 1", v)
	}
}

// S7.1: data connections take blocks from one queue as they free up: with
// one of two connections stalled (its reader reads nothing), every block
// but the one it took, if it was quick enough to take one, goes out on
// the other (the test once wanted exactly one on the stalled connection
// and failed when the free one drained the queue first).
func TestDataConnectionsShareOneQueue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		// A token for each connection: the stalled one holds its own for
		// bulkSlice (TestBulkConcurrencyAcrossPeers), not the free one's.
		prod := newNode(t, mn, func(c *Config) { c.BulkConcurrency = 2 }, 16)
		keys := testKeys(1, 6)
		prod.store(t, keys)
		dataL, _ := mn.Listen("fake:1")
		f := connectFake(t, mn, prod, "fake")
		f.send(wire.Lookup{ReqID: "kv", Round: 1, Keys: wkeys(keys)})
		expect[wire.LookupResp](t, f)
		slots := []uint32{0, 1, 2, 3, 4, 5}
		f.send(wire.Fetch{ReqID: "kv", Round: 1, Keys: wkeys(keys), Slots: slots})
		got := make(chan uint32, len(keys))
		var stalled []net.Conn
		for i := range 2 {
			c, err := dataL.Accept()
			if err != nil {
				t.Fatal(err)
			}
			if err := f.acceptData(c); err != nil {
				t.Fatal(err)
			}
			if i == 0 {
				stalled = append(stalled, c) // reads nothing
				continue
			}
			go func() {
				for {
					h, err := wire.ReadDataHeader(c)
					if err != nil {
						return
					}
					if _, err := io.CopyN(io.Discard, c, int64(h.Len)+wire.DataTrailerSize); err != nil {
						return
					}
					got <- h.Slot
				}
			}()
		}
		synctest.Wait()
		if n := len(got); n < len(keys)-1 {
			t.Errorf("%d of %d blocks went out on the free connection, want at least %d", n, len(keys), len(keys)-1)
		}
		for _, c := range stalled {
			c.Close()
		}
	})
}

// Issue 12: a data connection's reader runs on an OS thread of its own at
// data_nice, so bulk bytes yield the CPU to control and the engine.
func TestBulkThreadsNiced(t *testing.T) {
	nd := newNode(t, newMemNet(), nil, 4)
	const nice = 7
	p := NewTCPPlane(nd.m.Arena(), nil, TCPPlaneConfig{Conns: 1, Nice: nice}, slog.New(slog.DiscardHandler))
	defer p.Close()
	if err := p.AddPeer("prod", "prod:1", nil); err != nil {
		t.Fatal(err)
	}
	// Two connections: neither reader runs on the main thread (see lowered).
	a, b := net.Pipe()
	defer b.Close()
	admitData(t, p, "prod", a)
	a2, b2 := net.Pipe()
	defer b2.Close()
	admitData(t, p, "prod", a2)
	deadline := time.Now().Add(5 * time.Second)
	for niced(t, nice) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no thread at nice %d while a data connection is read", nice)
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.Close()
	b2.Close()
	deadline = time.Now().Add(5 * time.Second)
	for niced(t, nice) != 0 { // the reader's thread ends with it
		if time.Now().After(deadline) {
			t.Fatalf("a thread stayed at nice %d after its data connection closed", nice)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// niced counts this process's threads at nice.
func niced(t *testing.T, nice int) int {
	dirs, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	n := 0
	for _, d := range dirs {
		b, err := os.ReadFile("/proc/self/task/" + d.Name() + "/stat")
		if err != nil {
			continue
		}
		// Fields after the command's closing parenthesis; nice is field 19.
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) > 16 && f[16] == strconv.Itoa(nice) {
			n++
		}
	}
	return n
}

// Issue 12: queue writes a frame from the caller when the writer is idle.
// Frames stay in order when the socket takes only part of one and the
// rest goes to the writer, over a real TCP connection with a small
// buffer, read as it arrives.
func TestQueueDirectWriteKeepsOrder(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	out, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	in, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	in.SetReadDeadline(time.Now().Add(20 * time.Second)) // the test's bound
	out.SetWriteDeadline(time.Now().Add(20 * time.Second))
	out.(*net.TCPConn).SetWriteBuffer(16 << 10) // small: some writes are partial
	received := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(in)
		received <- b
	}()
	cc := newCtrlConn(out)
	cc.raw, _ = out.(*net.TCPConn).SyscallConn()
	done := make(chan struct{})
	go func() { defer close(done); (&Tier{}).writer(cc) }()
	var want bytes.Buffer
	direct := 0
	for i := range 400 {
		f := bytes.Repeat([]byte{byte(i)}, 1+(i*7919)%20000)
		want.Write(f)
		cc.out.Lock()
		idle := !cc.out.busy && len(cc.out.frames) == 0
		cc.out.Unlock()
		if idle {
			direct++
		}
		if !cc.queue(f) {
			t.Fatal("queue refused a frame under the cap")
		}
	}
	cc.out.Lock()
	cc.out.closed = true
	cc.out.cond.Signal()
	cc.out.Unlock()
	<-done
	if got := <-received; !bytes.Equal(got, want.Bytes()) {
		t.Fatalf("received %d bytes, not the %d queued in order", len(got), want.Len())
	}
	if direct == 0 {
		t.Fatal("no frame was offered to the direct write")
	}
}

// S8.5: a control connection's reader does not run ahead of the manager
// without bound. Frames it read and posted wait in memory until a pass
// applies them, so a peer sending faster than the manager serves (a flood
// of 65,536-key lookups while one is served) grew the event queue with all
// it sent; frames deferred while a retiring duplicate drains stayed there
// after their bytes were given back. The reader must stop once
// maxUnapplied bytes wait, and go on once they are served. No manager
// runs here: the test applies the events itself.
func TestReaderBoundsUnappliedFrames(t *testing.T) {
	for _, draining := range []bool{false, true} {
		t.Run(fmt.Sprint("draining=", draining), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				defer func(v int) { maxUnapplied = v }(maxUnapplied)
				maxUnapplied = 1 << 20
				a, b := net.Pipe()
				tr := &Tier{env: offload.TierEnv{Now: time.Now, Wake: func() {}}}
				cc := newCtrlConn(a)
				s := &session{}
				cc.s = s
				if draining { // a duplicate cc beats, whose marker has not come
					retiring := newCtrlConn(nil)
					rank(retiring, cc)
					s.old = []*ctrlConn{retiring}
				}
				s.conn = cc
				done := make(chan struct{})
				go func() { defer close(done); tr.reader(cc) }()
				frame := wire.Append(nil, wire.Pong{Seq: 1}) // handled with no roles in the session
				const frames = 20000                         // 5.3 MiB counted
				limit := maxUnapplied/frameCost + 1          // each frame counts at least frameCost; one more may wait
				wrote := make(chan struct{})
				go func() {
					defer close(wrote)
					for range frames {
						if _, err := b.Write(frame); err != nil {
							return
						}
					}
				}()
				defer func() {
					tr.endConn(cc) // wakes a reader that waits
					b.Close()
					a.Close()
					<-done
					<-wrote
				}()
				apply := func() int {
					q := tr.takeEvents()
					for _, e := range q {
						e.apply(tr) // handled or deferred
					}
					return len(q)
				}
				synctest.Wait() // the reader read everything or waits for the manager
				if n := apply(); n > limit {
					t.Fatalf("%d frames read before a pass, want at most %d (maxUnapplied %d KiB)", n, limit, maxUnapplied>>10)
				}
				synctest.Wait()
				n := apply()
				switch {
				case draining && n != 0:
					t.Errorf("%d more frames read while the first ones wait deferred, want 0", n)
				case !draining && n == 0:
					t.Error("the reader did not go on once its frames were applied")
				}
				if draining && len(s.deferred) > limit {
					t.Errorf("%d frames deferred, want at most %d", len(s.deferred), limit)
				}
			})
		})
	}
}

// admitData hands c to p as an inbound data connection of peer whose
// handshake succeeded.
func admitData(t *testing.T, p *TCPPlane, peer string, c net.Conn) {
	t.Helper()
	accept, ok := p.Admit(peer)
	if !ok {
		t.Fatalf("data connection of %s refused", peer)
	}
	accept(c)
}

// S7.1, S8.1: a producer that opens more data connections than the
// consumer's max_data_conns is refused in the handshake, before it sends a
// block, so its rounds go over the connections it has (they used to be
// closed unread, the blocks written on them were lost and the round
// failed); and it dials no more for fullFor, so one refusal is counted
// for three fetches.
func TestDataConnsBeyondPeersCap(t *testing.T) {
	prod := newNode(t, nil, func(c *Config) { c.DataConns = 3 }, 64)
	cons := newNode(t, nil, func(c *Config) { c.DataConns, c.MaxDataConns = 1, 1 }, 64)
	all := []offload.Result{offload.Hit, offload.Hit, offload.Hit, offload.Hit, offload.Hit, offload.Hit}
	for i := range 3 {
		keys := testKeys(40+i, 6)
		prod.store(t, keys)
		if got := cons.fetchFrom(t, fmt.Sprint("kv", i), prod.tier.Addr(), keys); fmt.Sprint(got) != fmt.Sprint(all) {
			t.Fatalf("fetch %d: %v, want six hits", i, got)
		}
	}
	if v := stat(cons, "kv_offload_p2p_data_cap_drops_total"); v != 1 {
		t.Errorf("data connections refused %v, want 1", v)
	}
	if v := stat(cons, "kv_offload_p2p_handshake_rejects_total"); v != 1 {
		t.Errorf("handshake rejects %v, want 1 (capacity)", v)
	}
}

// S6.6, S8.1: a consumer that stops reading inside a block is cut off
// after data_idle_timeout, as a producer that stalls inside one is: the
// round fails (transfer_done not ok) instead of holding the producer's
// writer and the round's pins for as long as the session lives.
func TestDataWriteStallCutOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		prod := newNode(t, mn, func(c *Config) {
			c.DataConns, c.DataIdleTimeout = 1, offload.Duration(time.Minute)
		}, 8)
		keys := testKeys(1, 2)
		prod.store(t, keys)
		dataL, _ := mn.Listen("fake:1")
		f := connectFake(t, mn, prod, "fake")
		f.send(wire.Lookup{ReqID: "kv", Round: 1, Keys: wkeys(keys)})
		expect[wire.LookupResp](t, f)
		f.send(wire.Fetch{ReqID: "kv", Round: 1, Keys: wkeys(keys), Slots: []uint32{0, 1}})
		c, err := dataL.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := f.acceptData(c); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		var done wire.TransferDone
		select { // nothing is read from c
		case m := <-f.recv:
			var ok bool
			if done, ok = m.(wire.TransferDone); !ok {
				t.Fatalf("fake peer got %T %+v, want transfer_done", m, m)
			}
		case <-time.After(10 * time.Minute):
			t.Fatal("no transfer_done 10m after the consumer stopped reading")
		}
		if done.OK || time.Since(start) < time.Minute {
			t.Errorf("transfer_done %+v after %v, want a failure after the 1m idle timeout", done, time.Since(start))
		}
	})
}

// S6.1, S8.5: frames wait only for connections that were active before
// theirs. B, active while A drains, has frames deferred up to its read
// bound; then C wins over B, so B retires while its own frames wait. A's
// marker must let B's frames be served (and B's reader read on to B's
// marker) while C's frames wait for B's; B's reader once waited on its own
// deferred frames, which waited for B's marker behind them.
func TestDeferredFramesWaitOnlyForEarlierConnections(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		defer func(v int) { maxUnapplied = v }(maxUnapplied)
		maxUnapplied = 1 << 20
		tr := &Tier{env: offload.TierEnv{Now: time.Now, Wake: func() {}}}
		aIn, aOut := net.Pipe()
		defer aIn.Close()
		defer aOut.Close()
		bIn, bOut := net.Pipe()
		A, B, C := newCtrlConn(aIn), newCtrlConn(bIn), newCtrlConn(nil)
		s := &session{}
		A.s, B.s, C.s = s, s, s
		rank(A, B, C)
		A.retiring = true // B won over A
		s.old = []*ctrlConn{A}
		s.conn = B
		done := make(chan struct{})
		go func() { defer close(done); tr.reader(B) }()
		wrote := make(chan struct{})
		go func() {
			defer close(wrote)
			frame := wire.Append(nil, wire.Pong{Seq: 1})
			for range 20000 { // beyond B's bound
				if _, err := bOut.Write(frame); err != nil {
					return
				}
			}
			bOut.Write(wire.Append(nil, wire.Disconnect{Code: wire.CodeDuplicate, Reason: "duplicate connection"}))
		}()
		defer func() {
			tr.endConn(B)
			bOut.Close()
			bIn.Close()
			<-done
			<-wrote
		}()
		apply := func() {
			for _, e := range tr.takeEvents() {
				e.apply(tr)
			}
		}
		synctest.Wait()
		apply()
		if len(s.deferred) == 0 || B.peerDone {
			t.Fatalf("%d frames deferred behind A, B's marker read %v: want B's frames waiting", len(s.deferred), B.peerDone)
		}
		// C wins over B: B retires while it was the active one.
		B.retiring = true
		s.old = append(s.old, B)
		s.conn = C
		frameReceived{cc: C, m: wire.Pong{Seq: 2}}.apply(tr)
		if C.nDeferred != 1 {
			t.Fatalf("C's frame: %d deferred, want it waiting for B", C.nDeferred)
		}
		tr.handle(A, wire.Disconnect{Code: wire.CodeDuplicate, Reason: "duplicate connection"}) // A's marker
		for range 10 {
			synctest.Wait()
			apply()
		}
		if !B.peerDone {
			t.Errorf("B's marker never read: %d frames deferred", len(s.deferred))
		}
		if len(s.deferred) != 0 || C.nDeferred != 0 {
			t.Errorf("%d frames still deferred (C's %d) after every earlier marker", len(s.deferred), C.nDeferred)
		}
	})
}

// S6.1: a connection retired before it delivered anything still waits for
// the one active before it: A drains, B won over A and C over B; a frame
// B's peer sent then comes after A's frames, not before A's marker.
func TestRetiredConnectionWaitsForEarlier(t *testing.T) {
	tr := &Tier{env: offload.TierEnv{Now: time.Now, Wake: func() {}}}
	A, B, C := newCtrlConn(nil), newCtrlConn(nil), newCtrlConn(nil)
	s := &session{}
	A.s, B.s, C.s = s, s, s
	rank(A, B, C)
	A.retiring, B.retiring = true, true
	s.old = []*ctrlConn{A, B}
	s.conn = C
	frameReceived{cc: B, m: wire.Pong{Seq: 1}}.apply(tr)
	if B.nDeferred != 1 {
		t.Fatalf("B's frame: %d deferred, want it waiting for A's marker", B.nDeferred)
	}
	A.peerDone = true // A's marker (its Disconnect would close A, which has no socket here)
	s.old = s.old[1:]
	tr.flushDeferred(s)
	if B.nDeferred != 0 || len(s.deferred) != 0 {
		t.Errorf("after A's marker %d frames still deferred", len(s.deferred))
	}
}

// rank orders connections of one dialler as wins does: each beats the
// ones before it (the peer used them in that order).
func rank(ccs ...*ctrlConn) {
	for i, cc := range ccs {
		cc.dialer = "peer"
		cc.nonce[0] = byte(len(ccs) - i)
	}
}

// pongsQueued decodes the Pong seqs queued on cc (no socket: queue keeps them).
func pongsQueued(t *testing.T, cc *ctrlConn) []uint64 {
	t.Helper()
	var seqs []uint64
	for _, f := range cc.out.frames {
		p, err := wire.ReadFrame(bytes.NewReader(f), nil, wire.MaxFrame)
		if err != nil {
			t.Fatal(err)
		}
		m, err := wire.Decode(p)
		if err != nil {
			t.Fatal(err)
		}
		if pm, ok := m.(wire.Pong); ok {
			seqs = append(seqs, pm.Seq)
		}
	}
	return seqs
}

func pipeConn(t *testing.T) *ctrlConn {
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	return newCtrlConn(a)
}

var dupMarker = wire.Disconnect{Code: wire.CodeDuplicate, Reason: "duplicate connection"}

// S6.1: B won over A, C over B (the peer sent on A, its marker; on B Ping
// 1, its marker; on C Ping 2). C's Ping arrives first, then B's frames and
// B's end (the peer closed B once both markers passed), all before A's
// marker. B's frames still wait for A when B's reader ends; C must still
// wait for them. (It was served ahead of them: closing B took it out of
// what C waited for.)
func TestClosedConnectionStillOrdersLaterOnes(t *testing.T) {
	tr := &Tier{env: offload.TierEnv{Now: time.Now, Wake: func() {}}}
	A, B, C := pipeConn(t), pipeConn(t), newCtrlConn(nil)
	s := &session{}
	A.s, B.s, C.s = s, s, s
	rank(A, B, C)
	A.retiring, B.retiring = true, true
	s.old = []*ctrlConn{A, B}
	s.conn = C
	frameReceived{cc: C, m: wire.Ping{Seq: 2}}.apply(tr)
	frameReceived{cc: B, m: wire.Ping{Seq: 1}}.apply(tr)
	frameReceived{cc: B, m: dupMarker}.apply(tr)
	connClosed{B, io.EOF}.apply(tr)
	frameReceived{cc: C, m: wire.Ping{Seq: 3}}.apply(tr) // after B's end: still behind B's frames
	tr.handle(A, dupMarker)                              // A's marker: everything may be served now
	got := pongsQueued(t, C)
	if !slices.Equal(got, []uint64{1, 2, 3}) {
		t.Fatalf("pongs served in order %v, want [1 2 3] (the peer sent Ping 1 on B before Pings 2 and 3 on C)", got)
	}
	if len(s.deferred) != 0 {
		t.Errorf("%d frames still deferred", len(s.deferred))
	}
}

// S6.1: the peer's connections become active in the order wins ranks
// them (each new active one beats the one before), whatever order they
// complete in here. Here A was active, C beat A, then B arrived and lost
// to C (never active here). The peer established A, B, C in that order:
// it sent Ping 1 on B (active there), its marker, then Ping 2 on C. C's
// Ping must wait for B's. (Frames waited by the order connections became
// active here, and C's went first.)
func TestFramesFollowThePeersOrder(t *testing.T) {
	tr := &Tier{env: offload.TierEnv{Now: time.Now, Wake: func() {}}}
	A, B, C := pipeConn(t), pipeConn(t), newCtrlConn(nil)
	for i, cc := range []*ctrlConn{A, B, C} {
		cc.dialer = "n1"
		cc.nonce[0] = byte(3 - i) // C beats B beats A
	}
	if !wins(C, B) || !wins(B, A) {
		t.Fatal("ranking")
	}
	s := &session{}
	A.s, B.s, C.s = s, s, s
	A.retiring, B.retiring = true, true // C won over A; B lost to C
	s.old = []*ctrlConn{A, B}
	s.conn = C
	frameReceived{cc: C, m: wire.Ping{Seq: 2}}.apply(tr)
	tr.handle(A, dupMarker) // A's marker
	frameReceived{cc: B, m: wire.Ping{Seq: 1}}.apply(tr)
	frameReceived{cc: B, m: dupMarker}.apply(tr)
	got := pongsQueued(t, C)
	if len(got) != 2 || got[0] != 1 || got[1] != 2 {
		t.Fatalf("pongs served in order %v, want [1 2] (the peer sent Ping 1 on B before Ping 2 on C)", got)
	}
}

// S6.1, S6.8: a Disconnect the peer sent on B while B was the active
// connection (the peer ended the session) waits behind A's marker; C then
// wins over B. Served once A's marker arrives, it must still end the
// session. (It only closed B, a retiring duplicate by then.)
func TestDeferredDisconnectEndsTheSession(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		n := newNode(t, mn, nil, 4)
		connectFake(t, mn, n, "fake")
		synctest.Wait()
		n.m.Do(func(*offload.Step) {
			tr := n.tier
			var s *session
			for x := range tr.sessions {
				s = x
			}
			A := s.conn
			A.retiring = true // B won over A
			s.old = append(s.old, A)
			B, C := pipeConn(t), pipeConn(t)
			B.s, C.s = s, s
			B.dialer, C.dialer = A.dialer, A.dialer
			B.nonce[31] = 1 // B beats A's random nonce, C beats B
			if !wins(B, A) || !wins(C, B) {
				t.Fatal("the ranking does not hold")
			}
			s.conn = B
			frameReceived{cc: B, m: wire.Disconnect{Code: wire.CodeProtocol, Reason: "bye"}}.apply(tr)
			if B.nDeferred != 1 {
				t.Fatalf("B's Disconnect: %d deferred, want it waiting for A", B.nDeferred)
			}
			B.retiring = true // C won over B
			s.old = append(s.old, B)
			s.conn = C
			tr.handle(A, dupMarker)
			if !s.dead {
				t.Errorf("the peer's Disconnect, sent on its active connection, left the session alive (B closed: %v)", B.out.closed)
			}
		})
		n.m.Close()
	})
}

// S6.1: nothing is sent on a connection after its duplicate marker. When
// a winning duplicate arrives with maxRetiring connections retiring,
// retire closes the oldest, which serves frames that waited for it; what
// they answer went out on the connection that had just sent its marker
// (it was retired before the new one became active).
func TestNothingAfterTheMarker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		n := newNode(t, mn, nil, 4)
		f := connectFake(t, mn, n, "fake")
		synctest.Wait()
		conn := f.shaker().Connect
		var far []net.Conn
		var got [][]wire.Msg
		var mu sync.Mutex
		dup := func(k int) {
			near, farEnd := net.Pipe()
			far = append(far, farEnd)
			mu.Lock()
			got = append(got, nil)
			mu.Unlock()
			go func() {
				for {
					p, err := wire.ReadFrame(farEnd, nil, wire.MaxFrame)
					if err != nil {
						return
					}
					m, _ := wire.Decode(p)
					mu.Lock()
					got[k] = append(got[k], m)
					mu.Unlock()
				}
			}()
			sh := shaken{Peer: conn, Dialer: "fake"}
			sh.DialNonce[31] = byte(10 - k) // each beats the one before (and A's random nonce)
			n.tier.established(nil, near, sh)
		}
		n.m.Do(func(*offload.Step) {
			tr := n.tier
			var s *session
			for x := range tr.sessions {
				s = x
			}
			dup(0) // B wins over A
			B := s.conn
			frameReceived{cc: B, m: wire.Ping{Seq: 7}}.apply(tr) // waits for A's marker
			if B.nDeferred != 1 {
				t.Fatalf("B's Ping: %d deferred", B.nDeferred)
			}
			dup(1) // C
			dup(2) // D
			dup(3) // E: A, B, C, D retire
			if len(s.old) != maxRetiring {
				t.Fatalf("%d retiring", len(s.old))
			}
			dup(4) // F: E retires, A is closed, B's Ping is served
		})
		synctest.Wait()
		mu.Lock()
		defer mu.Unlock()
		for k, ms := range got {
			marker := false
			for _, m := range ms {
				if d, ok := m.(wire.Disconnect); ok && d.Code == wire.CodeDuplicate {
					marker = true
					continue
				}
				if marker {
					t.Errorf("connection %d: %T %+v sent after its duplicate marker", k, m, m)
				}
			}
		}
		for _, c := range far {
			c.Close()
		}
		n.m.Close()
	})
}
