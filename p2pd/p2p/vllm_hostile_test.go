package p2p

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/vllmwire"
	"github.com/kvtier/kvtier/p2pd/wire"
	"github.com/kvtier/kvtier/p2pd/zmtp"
)

// countLogs counts log records whose message contains sub.
type countLogs struct {
	sub string
	n   *atomic.Int64
}

func (h countLogs) Enabled(context.Context, slog.Level) bool { return true }
func (h countLogs) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, h.sub) {
		h.n.Add(1)
	}
	return nil
}
func (h countLogs) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countLogs) WithGroup(string) slog.Handler      { return h }

// rawDealer connects a DEALER with identity id to addr and drains it.
func rawDealer(t *testing.T, mn zNet, addr, id string) *zmtp.Conn {
	t.Helper()
	c, err := mn.Dial(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	z, err := zmtp.Handshake(c, zmtp.Dealer, []byte(id), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { z.Close() })
	go func() {
		for {
			if _, err := z.ReadMessage(); err != nil {
				return
			}
		}
	}()
	return z
}

// Found in review (issue 15): a connect whose identity is the node's own
// host:port made the node dial itself, take its own connect for a
// restart of that session, and dial itself again, forever. The identity
// is refused (CodeSelf).
func TestVLLMSelfIdentity(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		var ended atomic.Int64
		cfg := vllmConfig(32)
		cfg.Logger = slog.New(countLogs{"p2p: session ended", &ended})
		n := newNodeWith(t, mn, func(c *Config) { c.Dialect, c.DataPlane = DialectVLLM, "mem" }, cfg)
		self := n.tier.Addr()
		z := rawDealer(t, mn, self, self)
		m := vllmwire.Msg{Type: vllmwire.TypeConnect, PeerID: self, AgentMetadata: []byte("md"), NumBlocks: 64,
			BlockLen: uint64(n.m.BlockBytes()), HashSeed: offload.VLLMDefaultSeed}
		if err := z.WriteMessage(vllmwire.Encode(nil, m)); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 200000 && ended.Load() < 50; i++ {
			runtime.Gosched()
		}
		if k := ended.Load(); k >= 50 {
			t.Errorf("one connect with the node's own identity ended %d sessions and is still going (the node dials itself, forever)", k)
		}
		noSessions(t, n)
	})
}

// Found in review: a node whose static peers include itself (a
// cluster-wide peer list) made a ready session with itself; kvtier's wire
// refuses that (CodeSelf), and so does vLLM's now.
func TestVLLMSelfStaticPeer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "mem", func(c *Config) {
			c.Listen = "selfnode:7000"
			c.Peers = []string{"selfnode:7000"}
		})
		synctest.Wait()
		n.m.Do(func(*offload.Step) {
			for _, ps := range n.tier.Peers() {
				if ps.Node == n.tier.Addr() {
					t.Errorf("the node has a session with itself: %+v", ps)
				}
			}
		})
	})
}

// Found in review (S8.5): a peer that acknowledged the node's connect
// before it could have seen it (the node's DEALER still dialling an
// identity whose ROUTER does not answer) became ready, and every answer
// to its flood of lookups piled up unbounded for the DEALER. Such an ack
// is now a protocol error, a session is ready only with its DEALER, and
// what waits for the DEALER is bounded by maxQueued.
func TestVLLMAckBeforeConnect(t *testing.T) {
	old := maxQueued
	maxQueued = 16 << 10
	defer func() { maxQueued = old }()
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "mem", nil)
		p := newVPeer(t, mn, "vllm-q:7000") // its ROUTER never accepts: the node's dial hangs
		p.dial(n.tier.Addr())
		p.send(p.connectMsg(n))
		p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: p.id}) // before it saw the node's connect
		keys := vkeys(testKeys(7, 256))
		for i := range 64 {
			p.dealer.WriteMessage(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: fmt.Sprint("kv", i), RoundSeq: 1, Keys: keys})) // fails once the node closed it
		}
		synctest.Wait()
		pre, alive, ready := 0, false, false
		n.m.Do(func(*offload.Step) {
			for s := range n.tier.sessions {
				alive, ready = !s.dead, s.ready
				for _, f := range s.v.pre {
					pre += len(f)
				}
			}
		})
		if alive || pre > maxQueued {
			t.Errorf("the session (alive %v, ready %v) buffers %d bytes for a DEALER not connected yet (maxQueued %d); want it ended at the early ack", alive, ready, pre, maxQueued)
		}
	})
}

// Found in review (twice): G2's lookup_resp has no round. A lookup of
// round N answered after the request fetched round N and asked again in
// round N+1 was taken for round N+1's answer (first it was given the
// request's current round; then, matched by keys, the peer's answers to
// two lookups of the same keys could come in either order): the node
// fetched in round N+1 a key the peer never confirmed for it (vLLM's
// producer fails such a fetch), and the request failed. Now two lookups of
// one request with the same keys are never out at once: the second waits
// for the first's answer, which is dropped as late.
func TestVLLMLateLookupResp(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n, p, req, _ := vlinked(t, mn, "mem", "vllm-r:7000")
		keys := testKeys(8, 2)
		a, b := keys[0], keys[1]
		n.m.Do(func(s *offload.Step) { s.Lookup(a, req) })
		l1 := p.expect(vllmwire.TypeLookup)
		n.m.Do(func(s *offload.Step) { s.Lookup(b, req) })
		l1b := p.expect(vllmwire.TypeLookup) // the same round; the peer holds it (B is being stored there)
		if l1b.RoundSeq != l1.RoundSeq {
			t.Fatalf("rounds %d, %d", l1.RoundSeq, l1b.RoundSeq)
		}
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: l1.Keys, Hits: []bool{true}})
		synctest.Wait()
		n.m.Do(func(s *offload.Step) { s.Lookup(a, req) }) // A promoted: fetch round N
		f1 := p.expect(vllmwire.TypeFetch)
		n.m.Do(func(s *offload.Step) { s.Lookup(b, req) }) // B asked again: round N+1
		synctest.Wait()
		if len(p.in) != 0 { // its answer would look like round N's, in either order
			t.Fatalf("a second lookup of the same keys went out while the first is unanswered: %+v", <-p.in)
		}
		// The peer's answer to round N's held lookup (B hit, pinned in round
		// N) arrives: late, dropped; round N+1's lookup goes out now.
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: l1b.Keys, Hits: []bool{true}})
		l2 := p.expect(vllmwire.TypeLookup)
		if l2.RoundSeq == f1.RoundSeq {
			t.Fatalf("no new round")
		}
		var got offload.Result
		n.m.Do(func(s *offload.Step) { got = s.Lookup(b, req) })
		if got == offload.Hit {
			t.Fatalf("B in round %d after round %d's late answer: hit; want it unanswered", l2.RoundSeq, l1b.RoundSeq)
		}
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: l2.Keys, Hits: []bool{false}}) // round N+1: miss
		synctest.Wait()
		n.m.Do(func(s *offload.Step) { got = s.Lookup(b, req) })
		synctest.Wait()
		if got != offload.Miss {
			t.Errorf("B in round %d: %v; the peer answered that round's lookup miss", l2.RoundSeq, got)
		}
		select {
		case m := <-p.in:
			if m.Type == vllmwire.TypeFetch && m.RoundSeq == l2.RoundSeq {
				t.Errorf("the node fetched %d key(s) in round %d, whose lookup the peer answered miss", len(m.Keys), m.RoundSeq)
			}
		default:
		}
		n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	})
}

// Found in review: any connection naming a live session's identity joined
// it, so a stranger on another host could complete a load with a forged
// transfer_done (the node's bytes never written), or end the session. An
// identity whose host is an IP address must now connect from it (real
// sockets: the check needs source addresses); a refused claim is counted
// as an auth reject, and vllm_source_check false lets it through.
func TestVLLMSourceCheck(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.2:0") // the claimed identity's ROUTER
	if err != nil {
		t.Skipf("no 127.0.0.2 here: %v", err)
	}
	defer ln.Close()
	id := ln.Addr().String()
	for _, check := range []bool{true, false} {
		n := newVNode(t, nil, "none", func(c *Config) { c.VLLMSourceCheck = check })
		c, z := tcpConnect(t, n, n.tier.Addr(), id) // from 127.0.0.1
		if check {
			if _, err := z.ReadMessage(); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("a claim of 127.0.0.2's identity from 127.0.0.1: %v, want the connection closed", err)
			}
			if got := rejectsOf(n, "auth"); got != 1 {
				t.Errorf("auth rejects %v, want 1", got)
			}
		} else { // taken: the node dials the identity back
			ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
			back, err := ln.Accept()
			if err != nil {
				t.Fatalf("with vllm_source_check false the node did not dial the identity back: %v", err)
			}
			back.Close()
		}
		c.Close()
	}
}

func rejectsOf(n *node, code string) float64 {
	var v float64
	n.m.Do(func(*offload.Step) {
		for _, st := range n.tier.Stats() {
			if st.Name == "kv_offload_p2p_handshake_rejects_total" && slices.Contains(st.Labels, code) {
				v += st.Value
			}
		}
	})
	return v
}

// Close does not wait out handshake_timeout for connections still in
// their handshake (found in review): a peer that completed ZMTP's
// handshake and sends no message, or kvtier's hello and no proof, used to
// hold Close for up to handshake_timeout; Close now ends them at once.
// Real sockets.
func TestCloseEndsHandshakes(t *testing.T) {
	for _, dialect := range []string{DialectKvtier, DialectVLLM} {
		t.Run(dialect, func(t *testing.T) {
			edit := func(c *Config) { c.HandshakeTimeout = offload.Duration(time.Hour) }
			var n *node
			if dialect == DialectVLLM {
				n = newVNode(t, nil, "none", edit)
			} else {
				n = newNode(t, nil, edit, 8)
			}
			c, err := net.DialTimeout("tcp", n.tier.Addr(), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			if dialect == DialectVLLM {
				if _, err := zmtp.Handshake(c, zmtp.Dealer, []byte("127.0.0.1:1"), 1<<20); err != nil {
					t.Fatal(err)
				}
			} else if _, err := wire.Write(c, nil, wire.Hello{Version: wire.Version, Kind: wire.KindControl, NodeID: "silent", Nonce: newNonce()}); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for n.tier.handshakes.Load() == 0 && time.Now().Before(deadline) { // the node took the connection
				time.Sleep(time.Millisecond)
			}
			closed := make(chan struct{})
			go func() { n.m.Close(); close(closed) }()
			select {
			case <-closed:
			case <-time.After(10 * time.Second):
				t.Fatal("Close waits for a handshake in progress (handshake_timeout 1h)")
			}
		})
	}
}

// A lookup held back behind one of the same keys is dropped when its
// request ends (the terminal fetch): sent afterwards it would pin blocks
// on the peer for a request that is gone, until pin_hold.
func TestVLLMWaitingLookupDroppedAtEnd(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n, p, req, _ := vlinked(t, newZNet(), "mem", "vllm-w:7000")
		keys := testKeys(11, 2)
		a, b := keys[0], keys[1]
		n.m.Do(func(s *offload.Step) { s.Lookup(a, req) })
		la := p.expect(vllmwire.TypeLookup)
		n.m.Do(func(s *offload.Step) { s.Lookup(b, req) })
		lb := p.expect(vllmwire.TypeLookup) // held by the peer
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: la.Keys, Hits: []bool{true}})
		synctest.Wait()
		n.m.Do(func(s *offload.Step) { s.Lookup(a, req) }) // fetch A: round N
		f := p.expect(vllmwire.TypeFetch)
		n.m.Do(func(s *offload.Step) { s.Lookup(b, req) }) // B again: waits behind round N's lookup of B
		synctest.Wait()
		p.send(vllmwire.Msg{Type: vllmwire.TypeTransferDone, KVRequestID: "kv", RoundSeq: f.RoundSeq, Success: true})
		synctest.Wait()
		n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) }) // the terminal fetch
		if m := p.expect(vllmwire.TypeFetch); len(m.Keys) != 0 {
			t.Fatalf("want the terminal fetch, got %+v", m)
		}
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: lb.Keys, Hits: []bool{true}}) // round N's answer for B
		synctest.Wait()
		select {
		case m := <-p.in:
			t.Errorf("after the request ended the node sent %s %+v", m.Type, m)
		default:
		}
	})
}

// Found in review: the source check refused legitimate peers on the
// node's own host: a vLLM with the default localhost identity dialling
// the node's routable address (the connection leaves from that address,
// not loopback), and a host-name identity whose DEALER reached another
// address of the same host than the peer's connection comes from (::1
// against 127.0.0.1). Real sockets.
func TestVLLMSourceCheckSameHost(t *testing.T) {
	t.Run("localhost identity to a routable node", func(t *testing.T) {
		const far = "192.0.2.2" // a non-loopback address of this host
		if c, err := net.Listen("tcp", far+":0"); err != nil {
			t.Skipf("no %s here: %v", far, err)
		} else {
			c.Close()
		}
		router, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer router.Close()
		_, port, _ := net.SplitHostPort(router.Addr().String())
		id := net.JoinHostPort("localhost", port)
		np := freePortOf(t, "0.0.0.0")
		n := newVNode(t, nil, "none", func(c *Config) { c.Listen, c.Advertise = "0.0.0.0:"+np, far+":"+np })
		c, _ := tcpConnect(t, n, n.tier.Addr(), id)
		defer c.Close()
		router.(*net.TCPListener).SetDeadline(time.Now().Add(5 * time.Second))
		back, err := router.Accept()
		if err != nil {
			t.Fatalf("the node did not dial vLLM (identity %s) back: %v; auth rejects %v", id, err, rejectsOf(n, "auth"))
		}
		back.Close()
	})
	t.Run("localhost over ::1 and 127.0.0.1", func(t *testing.T) {
		router, err := net.Listen("tcp", "[::]:0")
		if err != nil {
			t.Skip(err)
		}
		defer router.Close()
		_, port, _ := net.SplitHostPort(router.Addr().String())
		id := net.JoinHostPort("localhost", port)
		np := freePortOf(t, "127.0.0.1")
		n := newVNode(t, v6localhost{}, "none", func(c *Config) { c.Listen, c.Advertise = "127.0.0.1:"+np, "localhost:"+np })
		dealerThenPipe(t, n, router, id, "127.0.0.1:"+np)
	})
}

func freePortOf(t *testing.T, host string) string {
	l, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, p, _ := net.SplitHostPort(l.Addr().String())
	return p
}

// v6localhost resolves localhost to ::1 first, as a resolver with
// "::1 localhost" first in /etc/hosts does.
type v6localhost struct{ TCP }

func (n v6localhost) Dial(ctx context.Context, addr string) (net.Conn, error) {
	if h, p, err := net.SplitHostPort(addr); err == nil && h == "localhost" {
		if c, err := n.TCP.Dial(ctx, net.JoinHostPort("::1", p)); err == nil {
			return c, nil
		}
	}
	return n.TCP.Dial(ctx, addr)
}

// dealerThenPipe: the node dials the peer (a request names it), the peer
// takes its DEALER and connect, dials the node at dialAddr with identity
// id, sends connect, and expects connect_ack on the DEALER.
func dealerThenPipe(t *testing.T, n *node, router net.Listener, id, dialAddr string) {
	t.Helper()
	req := &offload.Request{ID: "r", TransferParams: source("kv", id)}
	n.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
	defer n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	router.(*net.TCPListener).SetDeadline(time.Now().Add(5 * time.Second))
	back, err := router.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	back.SetDeadline(time.Now().Add(10 * time.Second))
	zb, err := zmtp.Handshake(back, zmtp.Router, nil, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := zb.ReadMessage(); err != nil { // the node's connect
		t.Fatal(err)
	}
	c, _ := tcpConnect(t, n, dialAddr, id)
	defer c.Close()
	parts, err := zb.ReadMessage()
	if err != nil {
		t.Fatalf("no connect_ack (%v); auth rejects %v", err, rejectsOf(n, "auth"))
	}
	if m, _ := vllmwire.Decode(parts[0]); m.Type != vllmwire.TypeConnectAck {
		t.Fatalf("the node sent %q, want connect_ack; auth rejects %v", m.Type, rejectsOf(n, "auth"))
	}
}

// Found in review: a PONG with a zero context "answered" the PING that
// was not outstanding (pingOut is 0 then), so a peer could flood the
// event queue with vpong events (and feign liveness). Only the PONG of
// the outstanding PING counts, once.
func TestVLLMPongAnswersOnlyItsPing(t *testing.T) {
	var cc ctrlConn
	ctx := func(seq uint64) []byte { return binary.BigEndian.AppendUint64(nil, seq) }
	if _, ok := cc.answers(ctx(0)); ok {
		t.Error("a zero PONG with no PING outstanding counted")
	}
	cc.pingOut.Store(7)
	if _, ok := cc.answers(ctx(6)); ok {
		t.Error("a PONG of another PING counted")
	}
	if seq, ok := cc.answers(ctx(7)); !ok || seq != 7 {
		t.Error("the outstanding PING's PONG did not count")
	}
	if _, ok := cc.answers(ctx(7)); ok {
		t.Error("the same PONG counted twice")
	}
}

// tcpConnect dials addr over TCP as a vLLM DEALER of identity id and
// sends a connect that fits node n (real sockets, 10 s deadlines).
func tcpConnect(t *testing.T, n *node, addr, id string) (net.Conn, *zmtp.Conn) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	z, err := zmtp.Handshake(c, zmtp.Dealer, []byte(id), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	z.WriteMessage(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeConnect, PeerID: id, AgentMetadata: []byte{}, NumBlocks: 1,
		BlockLen: uint64(n.m.BlockBytes()), HashSeed: offload.VLLMDefaultSeed}))
	return c, z
}

// S8.5: a vLLM peer's DEALER pipe is read no further ahead of the manager
// than a kvtier control connection: beyond maxUnapplied of messages read
// and not applied, its reader waits, and goes on once they are.
func TestVLLMPipeReaderBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		defer func(v int) { maxUnapplied = v }(maxUnapplied)
		maxUnapplied = 1 << 20
		ours, pipe := net.Pipe()
		theirs := newAsyncWriter(pipe) // both sides greet before they read
		defer theirs.Close()
		var zr *zmtp.Conn
		shook := make(chan error, 1)
		go func() {
			var err error
			zr, err = zmtp.Handshake(ours, zmtp.Router, nil, 8<<20)
			shook <- err
		}()
		zd, err := zmtp.Handshake(theirs, zmtp.Dealer, []byte("127.0.0.1:1"), 8<<20)
		if err != nil || <-shook != nil {
			t.Fatalf("handshakes: %v", err)
		}
		tr := &Tier{env: offload.TierEnv{Now: time.Now, Wake: func() {}}}
		cc := newZConn(ours, zr)
		done := make(chan struct{})
		go func() { defer close(done); tr.vpipeReader(cc) }()
		msg := vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeAbortAck, KVRequestID: "kv", RoundSeq: 1})
		const msgs = 20000
		wrote := make(chan struct{})
		go func() {
			defer close(wrote)
			for range msgs {
				if zd.WriteMessage(msg) != nil {
					return
				}
			}
		}()
		defer func() {
			tr.endConn(cc)
			theirs.Close()
			<-done
			<-wrote
		}()
		synctest.Wait()
		q := tr.takeEvents()
		if limit := maxUnapplied/frameCost + 1; len(q) > limit {
			t.Fatalf("%d messages read before a pass, want at most %d", len(q), limit)
		}
		for _, e := range q { // applied: what vframe.apply gives back
			if f, ok := e.(vframe); ok {
				f.cc.release(f.n)
			}
		}
		synctest.Wait()
		if len(tr.takeEvents()) == 0 {
			t.Error("the pipe's reader did not go on once its messages were applied")
		}
	})
}

// asyncWriter is a net.Conn whose writes go out from a goroutine of its
// own, so a net.Pipe end can write before its peer reads.
type asyncWriter struct {
	net.Conn
	out    chan []byte
	closed chan struct{}
	once   sync.Once
	done   chan struct{}
}

func newAsyncWriter(c net.Conn) *asyncWriter {
	w := &asyncWriter{Conn: c, out: make(chan []byte, 64), closed: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for {
			select {
			case b := <-w.out:
				c.Write(b) // an error: Close comes
			case <-w.closed:
				return
			}
		}
	}()
	return w
}

func (w *asyncWriter) Write(b []byte) (int, error) {
	select {
	case w.out <- slices.Clone(b):
		return len(b), nil
	case <-w.closed:
		return 0, net.ErrClosed
	}
}

// Close closes the connection and ends the writing goroutine.
func (w *asyncWriter) Close() error {
	err := w.Conn.Close()
	w.once.Do(func() { close(w.closed) })
	<-w.done
	return err
}
