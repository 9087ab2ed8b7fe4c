package p2p

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/vllmwire"
	"github.com/kvtier/kvtier/p2pd/zmtp"
)

// Tests of vLLM's dialect (issue 15), under synctest over memNet: two
// kvtier nodes speaking it to each other, and a hand-played vLLM peer
// (vpeer) driving a node message by message. Against libzmq and vLLM's
// own message flow: testing/vllmpeer.

// memPlane is a data plane between arenas of one test process: a write
// copies the local slots into the peer's arena, as a NIXL WRITE would. A
// fake, for unit tests only; over memNet the pipes order the copy before
// the transfer_done that reports it.
type memPlane struct {
	arena  *offload.Arena
	name   string
	mu     sync.Mutex
	peers  map[string]*offload.Arena
	expect map[roundKey]func(error)
}

var memArenas sync.Map // memPlane.name → *offload.Arena

func init() {
	testPlanes["mem"] = func(a *offload.Arena) DataPlane {
		p := &memPlane{arena: a, name: fmt.Sprintf("mem-%p", a), peers: map[string]*offload.Arena{}, expect: map[roundKey]func(error){}}
		memArenas.Store(p.name, a)
		return p
	}
}

func (p *memPlane) Name() string                  { return "mem" }
func (p *memPlane) LocalInfo() []byte             { return []byte(p.name) }
func (p *memPlane) VLLMRegion() ([]byte, uintptr) { return []byte(p.name), 0 }

func (p *memPlane) AddPeer(peer, _ string, info []byte) error {
	if len(info) < nixlInfoLen {
		return errors.New("mem: no region")
	}
	a, _ := memArenas.Load(string(info[nixlInfoLen:])) // none: a vpeer, which writes by hand
	p.mu.Lock()
	p.peers[peer], _ = a.(*offload.Arena)
	p.mu.Unlock()
	return nil
}

func (p *memPlane) RemovePeer(peer string, done func()) {
	p.mu.Lock()
	delete(p.peers, peer)
	p.mu.Unlock()
	done()
}

func (p *memPlane) Write(peer string, _ uint64, pairs []SlotPair, done func(error)) {
	p.mu.Lock()
	a := p.peers[peer]
	p.mu.Unlock()
	if a == nil {
		done(ErrNoPeer)
		return
	}
	for _, sp := range pairs {
		copy(a.Slot(int(sp.Remote)), p.arena.Slot(int(sp.Local)))
	}
	done(nil)
}

func (p *memPlane) Cancel(string, uint64) {}

// Expect holds the round's callback: on vLLM's wire it only reports a
// failure (here: Unexpect's cancellation).
func (p *memPlane) Expect(peer string, round uint64, _ []uint32, done func(error)) {
	p.mu.Lock()
	p.expect[roundKey{peer, round}] = done
	p.mu.Unlock()
}

func (p *memPlane) Unexpect(peer string, round uint64, done func()) {
	p.mu.Lock()
	e := p.expect[roundKey{peer, round}]
	delete(p.expect, roundKey{peer, round})
	p.mu.Unlock()
	if e != nil {
		e(ErrCanceled)
	}
	done()
}
func (p *memPlane) Admit(string) (func(net.Conn), bool) { return closeData, true }
func (p *memPlane) Close() error                        { memArenas.Delete(p.name); return nil }

// vllmConfig is a node's config for vLLM's dialect: vLLM's keys.
func vllmConfig(slots int) offload.Config {
	cfg := tinyConfig(slots)
	cfg.HashAlgo, cfg.HashSeed = offload.HashVLLMSHA256CBOR, offload.VLLMDefaultSeed
	if testing.Verbose() {
		cfg.Logger = slog.Default()
	}
	return cfg
}

func newVNode(t testing.TB, n Network, plane string, edit func(*Config)) *node {
	t.Helper()
	return newNodeWith(t, n, func(c *Config) {
		c.Dialect, c.DataPlane = DialectVLLM, plane
		if edit != nil {
			edit(c)
		}
	}, vllmConfig(32))
}

// vkeys are keys as vLLM sends them: the block hash and group 0.
func vkeys(ks []offload.Key) [][]byte {
	out := make([][]byte, len(ks))
	for i, k := range ks {
		out[i] = append(k[:], 0, 0, 0, 0)
	}
	return out
}

// Two kvtier nodes speaking vLLM's dialect: the consumer fetches the
// producer's blocks (byte for byte), a partial hit loads the hit prefix,
// both end with no pins, and the node reports no checksums.
func TestVLLMDialectFetch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		prod := newVNode(t, mn, "mem", nil)
		cons := newVNode(t, mn, "mem", nil)
		keys := testKeys(1, 6)
		prod.store(t, keys[:4])
		got := cons.fetchFrom(t, "kv-1", prod.tier.Addr(), keys)
		want := []offload.Result{offload.Hit, offload.Hit, offload.Hit, offload.Hit, offload.Miss}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("answers %v, want %v", got, want)
		}
		waitClean(t, prod)
		waitClean(t, cons)
		if cons.tier.Checksums() || cons.tier.Dialect() != DialectVLLM {
			t.Errorf("checksums %v, dialect %q: want false, vllm", cons.tier.Checksums(), cons.tier.Dialect())
		}
		// A second request reuses the session (one each way).
		prod.store(t, keys[4:])
		if got := cons.fetchFrom(t, "kv-2", prod.tier.Addr(), keys[4:]); fmt.Sprint(got) != fmt.Sprint([]offload.Result{offload.Hit, offload.Hit}) {
			t.Fatalf("second request: %v", got)
		}
		cons.m.Do(func(*offload.Step) {
			if ps := cons.tier.Peers(); len(ps) != 1 || !ps[0].Ready || ps[0].Node != prod.tier.Addr() {
				t.Errorf("consumer's sessions %+v, want one ready, named %s", ps, prod.tier.Addr())
			}
		})
	})
}

// vpeer plays a vLLM node by hand: its ROUTER listens at id (the node's
// DEALER connects there), its DEALER dials the node with identity id.
type vpeer struct {
	t       testing.TB
	mn      zNet
	id      string
	ln      net.Listener
	dealer  *zmtp.Conn   // to the node's ROUTER
	dealers []*zmtp.Conn // every DEALER connection it made, closed at the end
	// dealerGone is closed when the node closed the DEALER's connection.
	dealerGone chan struct{}
	in         chan vllmwire.Msg // what the node sent on its DEALER
	stop       atomic.Bool       // the ROUTER side stops reading after its next message (and answers no PING)
	resume     chan struct{}     // closed: it reads again
	closed     chan struct{}     // the node's DEALER connection ended
	router     net.Conn
}

func newVPeer(t testing.TB, mn zNet, id string) *vpeer {
	ln, err := mn.Listen(id)
	if err != nil {
		t.Fatal(err)
	}
	p := &vpeer{t: t, mn: mn, id: id, ln: ln, resume: make(chan struct{})}
	t.Cleanup(func() {
		close(p.resume)
		ln.Close()
		for _, d := range p.dealers {
			d.Close()
		}
		if p.router != nil {
			p.router.Close()
		}
	})
	return p
}

// dial connects the peer's DEALER to the node's ROUTER.
func (p *vpeer) dial(addr string) {
	c, err := p.mn.Dial(context.Background(), addr)
	if err != nil {
		p.t.Fatal(err)
	}
	z, err := zmtp.Handshake(c, zmtp.Dealer, []byte(p.id), 8<<20)
	if err != nil {
		p.t.Fatal(err)
	}
	p.dealer = z
	p.dealers = append(p.dealers, z)
	p.dealerGone = make(chan struct{})
	go func() { // the node's ROUTER sends nothing but answers
		defer close(p.dealerGone)
		for {
			if _, err := z.ReadMessage(); err != nil {
				return
			}
		}
	}()
}

// accept takes the node's DEALER connection and reads what comes on it.
func (p *vpeer) accept(nodeID string) {
	c, err := p.ln.Accept()
	if err != nil {
		p.t.Fatal(err)
	}
	z, err := zmtp.Handshake(c, zmtp.Router, nil, 8<<20)
	if err != nil {
		p.t.Fatal(err)
	}
	if string(z.PeerIdentity()) != nodeID {
		p.t.Fatalf("the node's DEALER identity %q, want %q", z.PeerIdentity(), nodeID)
	}
	p.router = c
	p.in, p.closed = make(chan vllmwire.Msg, 64), make(chan struct{})
	go func() {
		defer close(p.closed)
		for {
			if p.stop.Load() {
				<-p.resume
			}
			parts, err := z.ReadMessage()
			if err != nil {
				return
			}
			m, err := vllmwire.Decode(parts[0])
			if err != nil || len(parts) != 1 {
				p.t.Errorf("the node sent %d frames, %v", len(parts), err)
				return
			}
			p.in <- m
		}
	}()
}

func (p *vpeer) send(m vllmwire.Msg) {
	if err := p.dealer.WriteMessage(vllmwire.Encode(nil, m)); err != nil {
		p.t.Errorf("vpeer send %s: %v", m.Type, err)
	}
}

// next is the next message the node sent; Type "" once it closed.
func (p *vpeer) next() vllmwire.Msg {
	select {
	case m := <-p.in:
		return m
	case <-p.closed:
		select {
		case m := <-p.in:
			return m
		default:
		}
		return vllmwire.Msg{}
	}
}

func (p *vpeer) expect(typ string) vllmwire.Msg {
	p.t.Helper()
	m := p.next()
	if m.Type != typ {
		p.t.Fatalf("the node sent %q %+v, want %s", m.Type, m, typ)
	}
	return m
}

// connectMsg is the peer's connect for node n.
func (p *vpeer) connectMsg(n *node) vllmwire.Msg {
	return vllmwire.Msg{Type: vllmwire.TypeConnect, PeerID: p.id, AgentMetadata: []byte("md"), NumBlocks: 64,
		BlockLen: uint64(n.m.BlockBytes()), HashSeed: offload.VLLMDefaultSeed}
}

// handshake connects to n as vLLM does and checks the node's connect.
func (p *vpeer) handshake(n *node) {
	p.t.Helper()
	p.dial(n.tier.Addr())
	p.send(p.connectMsg(n))
	p.accept(n.tier.Addr())
	c := p.expect(vllmwire.TypeConnect)
	if c.PeerID != n.tier.Addr() || c.BlockLen != uint64(n.m.BlockBytes()) || c.HashSeed != offload.VLLMDefaultSeed || c.NumBlocks != 32 {
		p.t.Errorf("the node's connect %+v", c)
	}
	p.expect(vllmwire.TypeConnectAck)
	p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: p.id})
	synctest.Wait()
}

// vlinked is a node in vLLM's dialect on plane consuming request req
// (kv_request_id "kv") from a hand-played vLLM peer id, handshake done the
// way the node dials: it returns the node's arena as its connect named it
// (mem) or nil.
func vlinked(t *testing.T, mn zNet, plane, id string) (*node, *vpeer, *offload.Request, *offload.Arena) {
	t.Helper()
	n := newVNode(t, mn, plane, func(c *Config) { c.LookupTimeout = offload.Duration(time.Hour) })
	p := newVPeer(t, mn, id)
	req := &offload.Request{ID: "r", TransferParams: source("kv", p.id)}
	n.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
	p.accept(n.tier.Addr())
	c := p.expect(vllmwire.TypeConnect)
	p.dial(n.tier.Addr())
	p.send(p.connectMsg(n))
	p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: p.id})
	p.expect(vllmwire.TypeConnectAck)
	synctest.Wait()
	a, _ := memArenas.Load(string(c.AgentMetadata))
	arena, _ := a.(*offload.Arena)
	return n, p, req, arena
}

// noSessions fails t if the node has a session left.
func noSessions(t *testing.T, n *node) {
	t.Helper()
	n.m.Do(func(*offload.Step) {
		if ps := n.tier.Peers(); len(ps) != 0 {
			t.Errorf("sessions left: %+v", ps)
		}
	})
}

func readyPeers(n *node) (ready int) {
	n.m.Do(func(*offload.Step) {
		for _, ps := range n.tier.Peers() {
			if ps.Ready {
				ready++
			}
		}
	})
	return ready
}

// A vLLM consumer fetching from a node: lookups are answered in wire order
// with one lookup_resp each (no round on the wire); with data_plane none
// the fetch fails with transfer_done and the pins go; an abort of a
// round not being written is acknowledged; a terminal empty fetch
// releases a lookup's pins; an unknown type is dropped.
func TestVLLMPeerFetchesFromNode(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "none", nil)
		keys := testKeys(1, 3)
		n.store(t, keys[:2])
		p := newVPeer(t, mn, "vllm-a:7000")
		p.handshake(n)
		if readyPeers(n) != 1 {
			t.Fatal("no ready session after the handshake")
		}
		p.send(vllmwire.Msg{Type: "hello_from_the_future"})
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv", RoundSeq: 0, Keys: vkeys(keys)})
		r := p.expect(vllmwire.TypeLookupResp)
		if r.KVRequestID != "kv" || !slices.Equal(r.Hits, []bool{true, true, false}) || !slices.EqualFunc(r.Keys, vkeys(keys), func(a, b []byte) bool { return string(a) == string(b) }) {
			t.Fatalf("lookup_resp %+v", r)
		}
		synctest.Wait()
		if pins(n) != 2 {
			t.Fatalf("%d pins after the lookup, want 2", pins(n))
		}
		p.send(vllmwire.Msg{Type: vllmwire.TypeFetch, KVRequestID: "kv", RoundSeq: 0, Keys: vkeys(keys[:2]), BlockIndexes: []uint64{5, 9}})
		if d := p.expect(vllmwire.TypeTransferDone); d.Success || d.RoundSeq != 0 || d.KVRequestID != "kv" {
			t.Fatalf("transfer_done %+v, want a failure of round 0 (data_plane none)", d)
		}
		synctest.Wait()
		if pins(n) != 0 {
			t.Fatalf("%d pins after the failed round", pins(n))
		}
		p.send(vllmwire.Msg{Type: vllmwire.TypeAbortFetch, KVRequestID: "kv", RoundSeq: 4})
		if a := p.expect(vllmwire.TypeAbortAck); a.RoundSeq != 4 {
			t.Fatalf("abort_ack %+v", a)
		}
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv2", RoundSeq: 1, Keys: vkeys(keys[:1])})
		p.expect(vllmwire.TypeLookupResp)
		synctest.Wait()
		if pins(n) != 1 {
			t.Fatalf("%d pins after the second lookup, want 1", pins(n))
		}
		p.send(vllmwire.Msg{Type: vllmwire.TypeFetch, KVRequestID: "kv2", Keys: [][]byte{}, BlockIndexes: []uint64{}})
		synctest.Wait()
		if pins(n) != 0 {
			t.Fatalf("%d pins after the terminal fetch", pins(n))
		}
		if readyPeers(n) != 1 {
			t.Fatal("the session ended")
		}
		p.send(vllmwire.Msg{Type: vllmwire.TypeDisconnect})
		synctest.Wait()
		if readyPeers(n) != 0 {
			t.Fatal("the session outlived the peer's disconnect")
		}
	})
}

// A node fetching from a vLLM producer: it dials the peer's ROUTER and
// sends connect; the peer connects back; the node's lookup carries
// 36-byte keys and a round, the peer's lookup_resp none; the fetch names
// the node's slots; the peer's WRITE (here a copy into the node's arena)
// and transfer_done complete the load, byte for byte.
func TestVLLMNodeFetchesFromPeer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "mem", nil)
		p := newVPeer(t, mn, "vllm-b:7000")
		keys := testKeys(2, 4)
		have := map[string]offload.Key{}
		for _, k := range keys[:3] {
			have[string(vkeys([]offload.Key{k})[0])] = k
		}
		done := make(chan []offload.Result, 1)
		go func() { done <- n.fetchFrom(t, "kv-9", p.id, keys) }()
		p.accept(n.tier.Addr())
		c := p.expect(vllmwire.TypeConnect)
		p.dial(n.tier.Addr())
		p.send(p.connectMsg(n))
		p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: p.id})
		p.expect(vllmwire.TypeConnectAck)
		arena, _ := memArenas.Load(string(c.AgentMetadata))
		served := make(chan int, 1)
		go func() { // the peer's side of the flow, until the node's DEALER closes
			loads := 0
			defer func() { served <- loads }()
			for {
				m := p.next()
				switch m.Type {
				case "", vllmwire.TypeDisconnect: // the node shuts down
					return
				case vllmwire.TypeLookup:
					if m.RoundSeq == 0 {
						t.Errorf("a lookup of round 0")
					}
					hits := make([]bool, len(m.Keys))
					for i, k := range m.Keys {
						_, hits[i] = have[string(k)]
					}
					p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: m.KVRequestID, Keys: m.Keys, Hits: hits})
				case vllmwire.TypeFetch:
					if len(m.Keys) == 0 {
						continue // terminal
					}
					for i, k := range m.Keys {
						copy(arena.(*offload.Arena).Slot(int(m.BlockIndexes[i])), blockOf(have[string(k)], n.m.BlockBytes()))
					}
					loads++
					p.send(vllmwire.Msg{Type: vllmwire.TypeTransferDone, KVRequestID: m.KVRequestID, RoundSeq: m.RoundSeq, Success: true})
				default:
					t.Errorf("unexpected %s from the node", m.Type)
				}
			}
		}()
		got := <-done
		want := []offload.Result{offload.Hit, offload.Hit, offload.Hit, offload.Miss}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("answers %v, want %v", got, want)
		}
		waitClean(t, n)
		n.m.Close()
		if loads := <-served; loads < 1 || loads > 3 {
			t.Errorf("%d loads of 3 hits", loads)
		}
	})
}

// Connects a node refuses, and what breaks the handshake: each ends the
// session (a disconnect on the node's DEALER where it has one) and leaves
// no session behind.
func TestVLLMHandshakeRejects(t *testing.T) {
	for name, tc := range map[string]struct {
		edit func(m *vllmwire.Msg)
		then func(p *vpeer, n *node) // after the node's connect and connect_ack
	}{
		"block_len": {edit: func(m *vllmwire.Msg) { m.BlockLen++ }},
		"hash_seed": {edit: func(m *vllmwire.Msg) { m.HashSeed = "42" }},
		"lookup before ack": {then: func(p *vpeer, n *node) {
			p.send(vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv", Keys: [][]byte{}})
		}},
		"a second connect": {then: func(p *vpeer, n *node) { p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck}); p.send(p.connectMsg(n)) }},
		"a 32-byte key": {then: func(p *vpeer, n *node) {
			ack(p)
			p.send(vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv", Keys: [][]byte{make([]byte, 32)}})
		}},
		"another KV group": {then: func(p *vpeer, n *node) {
			ack(p)
			k := make([]byte, 36)
			k[35] = 1
			p.send(vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv", Keys: [][]byte{k}})
		}},
		"a malformed frame": {then: func(p *vpeer, n *node) { ack(p); p.dealer.WriteMessage([]byte{0x81, 0xa4, 't', 'y', 'p', 'e', 0x01}) }},
		"fetch, mismatched ": {then: func(p *vpeer, n *node) {
			ack(p)
			p.send(vllmwire.Msg{Type: vllmwire.TypeFetch, KVRequestID: "kv", Keys: vkeys(testKeys(1, 1)), BlockIndexes: []uint64{1, 2}})
		}},
	} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				mn := newZNet()
				n := newVNode(t, mn, "none", nil)
				p := newVPeer(t, mn, "vllm-c:7000")
				p.dial(n.tier.Addr())
				m := p.connectMsg(n)
				if tc.edit != nil {
					tc.edit(&m)
				}
				p.send(m)
				if tc.then == nil { // refused before the node dials back: its ROUTER closes the peer's DEALER
					<-p.dealerGone
				} else {
					p.accept(n.tier.Addr())
					p.expect(vllmwire.TypeConnect)
					p.expect(vllmwire.TypeConnectAck)
					tc.then(p, n)
					p.expect(vllmwire.TypeDisconnect)
				}
				synctest.Wait()
				noSessions(t, n)
				if p.in != nil {
					if m := p.next(); m.Type != "" {
						t.Errorf("after the disconnect: %s", m.Type)
					}
				}
			})
		})
	}
}

func ack(p *vpeer) {
	p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: p.id})
	synctest.Wait()
}

// A stranger whose first message is not connect is closed unread; a peer
// that sends connect and never acknowledges the node's is dropped at
// handshake_timeout.
func TestVLLMHandshakeBounds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "none", nil)
		p := newVPeer(t, mn, "vllm-d:7000")
		p.dial(n.tier.Addr())
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv", Keys: [][]byte{}})
		<-p.dealerGone
		q := newVPeer(t, mn, "vllm-e:7000")
		q.dial(n.tier.Addr())
		q.send(q.connectMsg(n))
		q.accept(n.tier.Addr())
		q.expect(vllmwire.TypeConnect)
		q.expect(vllmwire.TypeConnectAck)
		start := time.Now()
		q.expect(vllmwire.TypeDisconnect)
		if d := time.Since(start); d < 5*time.Second || d > 5*time.Second+100*time.Millisecond {
			t.Errorf("dropped after %v, want handshake_timeout 5s", d)
		}
		synctest.Wait()
		noSessions(t, n)
	})
}

// Keep-alive on vLLM's wire: while the node waits on the peer it PINGs on
// its DEALER; a peer that answers (libzmq does, and so does zmtp.Conn)
// stays; one that stops reading is dropped keepalive_timeout after the
// unanswered PING.
func TestVLLMKeepalive(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n, p, req, _ := vlinked(t, newZNet(), "mem", "vllm-f:7000")
		n.m.Do(func(s *offload.Step) { s.Lookup(testKeys(3, 1)[0], req); s.OnScheduleEnd() })
		p.expect(vllmwire.TypeLookup) // never answered: the session is busy
		time.Sleep(time.Minute)
		synctest.Wait()
		if readyPeers(n) != 1 {
			t.Fatal("a peer answering PINGs was dropped")
		}
		p.stop.Store(true) // the reader blocks after its next message
		n.m.Do(func(s *offload.Step) { s.Lookup(testKeys(3, 2)[1], req); s.OnScheduleEnd() })
		p.expect(vllmwire.TypeLookup)
		time.Sleep(13 * time.Second)
		synctest.Wait()
		if readyPeers(n) != 0 {
			t.Fatal("a peer that answers no PING still has its session")
		}
		n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	})
}

// zNet is memNet with buffered writes: ZMTP's handshake has both sides
// write before they read, which a TCP socket's buffer allows and a bare
// net.Pipe does not. Each connection end queues its writes (channels, so
// synctest sees a full queue as durably blocked) for a pump goroutine,
// which ends with the connection.
type zNet struct{ *memNet }

func newZNet() zNet { return zNet{newMemNet()} }

func (n zNet) Listen(addr string) (net.Listener, error) {
	l, err := n.memNet.Listen(addr)
	return zListener{l}, err
}

func (n zNet) Dial(ctx context.Context, addr string) (net.Conn, error) {
	c, err := n.memNet.Dial(ctx, addr)
	if err != nil {
		return nil, err
	}
	return newZPipe(c), nil
}

type zListener struct{ net.Listener }

func (l zListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newZPipe(c), nil
}

type zPipe struct {
	net.Conn
	q        chan []byte
	closing  chan struct{}
	failed   chan struct{} // the pump's write failed: nothing more goes out
	once     sync.Once
	deadline atomic.Pointer[time.Time]
}

func newZPipe(c net.Conn) *zPipe {
	p := &zPipe{Conn: c, q: make(chan []byte, 64), closing: make(chan struct{}), failed: make(chan struct{})}
	go func() {
		defer close(p.failed)
		defer c.Close()
		for {
			select {
			case b := <-p.q:
				if _, err := c.Write(b); err != nil {
					return
				}
			case <-p.closing: // what was written before Close goes out, as over TCP
				for {
					select {
					case b := <-p.q:
						if _, err := c.Write(b); err != nil {
							return
						}
					default:
						return
					}
				}
			}
		}
	}()
	return p
}

// Write queues b; with the queue full it waits, until the write deadline
// as a TCP write would (os.ErrDeadlineExceeded), and a pipe whose pump
// failed (or that closed) refuses it.
func (p *zPipe) Write(b []byte) (int, error) {
	select {
	case <-p.closing:
		return 0, net.ErrClosed
	case <-p.failed:
		return 0, net.ErrClosed
	default:
	}
	var timeout <-chan time.Time
	if d := p.deadline.Load(); d != nil && !d.IsZero() {
		t := time.NewTimer(time.Until(*d))
		defer t.Stop()
		timeout = t.C
	}
	select {
	case p.q <- append([]byte(nil), b...):
		return len(b), nil
	case <-p.closing:
		return 0, net.ErrClosed
	case <-p.failed:
		return 0, net.ErrClosed
	case <-timeout:
		return 0, os.ErrDeadlineExceeded
	}
}

func (p *zPipe) SetWriteDeadline(t time.Time) error {
	p.deadline.Store(&t)
	return p.Conn.SetWriteDeadline(t)
}

func (p *zPipe) SetDeadline(t time.Time) error {
	p.deadline.Store(&t)
	return p.Conn.SetDeadline(t)
}

// Close lets the queue drain (within a second, if the peer reads) and
// closes the pipe.
func (p *zPipe) Close() error {
	p.once.Do(func() {
		p.Conn.SetWriteDeadline(time.Now().Add(time.Second))
		close(p.closing)
	})
	return nil
}

// A peer that connects again with the same identity (a new session of
// vLLM's, or a new process) sending connect starts a new session: the old
// one's pins go, and the node keeps its DEALER (libzmq would refuse a
// second connection of the identity while the first lingers) and sends
// connect again on it.
func TestVLLMPeerReconnects(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "none", nil)
		keys := testKeys(4, 2)
		n.store(t, keys)
		p := newVPeer(t, mn, "vllm-g:7000")
		p.handshake(n)
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv", Keys: vkeys(keys)})
		p.expect(vllmwire.TypeLookupResp)
		synctest.Wait()
		if pins(n) != 2 {
			t.Fatalf("%d pins, want 2", pins(n))
		}
		gone := p.dealerGone
		p.dial(n.tier.Addr())
		p.send(p.connectMsg(n))
		p.expect(vllmwire.TypeConnect) // on the same DEALER connection
		p.expect(vllmwire.TypeConnectAck)
		<-gone // the old session's pipe
		synctest.Wait()
		if pins(n) != 0 || readyPeers(n) != 0 {
			t.Fatalf("after the new connect: %d pins, %d ready sessions; want the old session gone", pins(n), readyPeers(n))
		}
		p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: p.id})
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv", Keys: vkeys(keys[:1])})
		if r := p.expect(vllmwire.TypeLookupResp); !slices.Equal(r.Hits, []bool{true}) {
			t.Fatalf("lookup on the new session: %+v", r)
		}
		if readyPeers(n) != 1 {
			t.Fatal("the new session is not ready")
		}
	})
}

// S8.5 (found in review): asked stays within vllmMaxAsked. Its bound was
// `len == vllmMaxAsked`: when the forgotten oldest lookup had one waiting
// behind it, that one was sent (appended) before the new one was, asked
// reached vllmMaxAsked+1 and the trim never ran again.
func TestVLLMAskedStaysBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n, p, req, _ := vlinked(t, newZNet(), "mem", "vllm-x:7000")
		keys := testKeys(21, 2)
		b := keys[1]
		vlookupBehind(t, n, p, req, keys[0], b)
		go func() { // the peer reads and answers nothing more
			for {
				if m := p.next(); m.Type == "" {
					return
				}
			}
		}()
		req2 := &offload.Request{ID: "r2", TransferParams: source("kv2", p.id)}
		n.m.Do(func(s *offload.Step) { s.OnNewRequest(req2) })
		const extra = 1200
		for _, k := range testKeys(22, extra) {
			n.m.Do(func(s *offload.Step) { s.Lookup(k, req2) })
		}
		synctest.Wait()
		asked := 0
		n.m.Do(func(*offload.Step) {
			for s := range n.tier.sessions {
				if s.v != nil && !s.dead {
					asked = len(s.v.asked)
				}
			}
		})
		if asked > vllmMaxAsked {
			t.Errorf("%d unanswered lookups remembered after %d more were sent, want at most vllmMaxAsked (%d)", asked, extra, vllmMaxAsked)
		}
		n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req); s.OnRequestFinished(req2) })
	})
}

// S6.10 (found in review): a lookup held back on vLLM's wire (behind an
// unanswered one of the same request and keys) starts its bound when it
// leaves. It ran from the step that queued it: sent when the earlier
// answer came at 4.9 s, it timed out at 7 s, 2.1 s after it left, though
// the peer may hold it lookup_hold (5 s).
func TestVLLMWaitingLookupBoundFromSend(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		cfg := vllmConfig(32)
		cfg.HitPendingTimeout = offload.Duration(time.Minute) // the manager's bound (S4.7) out of the way
		// lookup_timeout: lookup_hold 5 s + 2 s
		n := newNodeWith(t, mn, func(c *Config) { c.Dialect, c.DataPlane = DialectVLLM, "mem" }, cfg)
		p := newVPeer(t, mn, "vllm-y:7000")
		req := &offload.Request{ID: "r", TransferParams: source("kv", p.id)}
		n.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
		p.accept(n.tier.Addr())
		p.expect(vllmwire.TypeConnect)
		p.dial(n.tier.Addr())
		p.send(p.connectMsg(n))
		p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: p.id})
		p.expect(vllmwire.TypeConnectAck)
		synctest.Wait()

		keys := testKeys(23, 2)
		b := keys[1]
		lb := vlookupBehind(t, n, p, req, keys[0], b)
		time.Sleep(4900 * time.Millisecond)
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: lb.Keys, Hits: []bool{true}}) // round N's, late
		l2 := p.expect(vllmwire.TypeLookup)                                                                       // leaves now
		left := time.Now()
		time.Sleep(4 * time.Second) // the peer holds it 4 s, within its lookup_hold
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: l2.Keys, Hits: []bool{true}})
		synctest.Wait()
		var got offload.Result
		n.m.Do(func(s *offload.Step) { got = s.Lookup(b, req) })
		if got == offload.Miss {
			t.Errorf("b answered hit %v after its lookup left: miss; want its promotion (lookup_timeout is 7 s from when a lookup leaves)", time.Since(left))
		}
		n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	})
}

// Found in review: forgetting the oldest unanswered lookup (asked's
// bound) sent the lookup waiting behind it (same request and keys, the
// next round), so the forgotten one's answer, when it came, was taken for
// the next round's: the late-answer mix-up TestVLLMLateLookupResp guards
// against (a fetch in round N+1 of a key the peer pinned in round N,
// which vLLM's producer fails). The waiting one is dropped with it.
func TestVLLMForgottenAnswerNotTakenForNextRound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n, p, req, _ := vlinked(t, newZNet(), "mem", "vllm-z:7000")
		keys := testKeys(24, 2)
		b := keys[1]
		lb := vlookupBehind(t, n, p, req, keys[0], b)
		fetched := make(chan vllmwire.Msg, 16)
		go func() { // a busy peer: lookups outstanding, none answered yet
			for {
				m := p.next()
				switch {
				case m.Type == "":
					return
				case m.Type == vllmwire.TypeFetch && m.KVRequestID == "kv" && len(m.Keys) > 0:
					fetched <- m
				}
			}
		}()
		req2 := &offload.Request{ID: "r2", TransferParams: source("kv2", p.id)}
		n.m.Do(func(s *offload.Step) { s.OnNewRequest(req2) })
		for _, k := range testKeys(25, vllmMaxAsked) { // asked overflows: lb is forgotten
			n.m.Do(func(s *offload.Step) { s.Lookup(k, req2) })
		}
		synctest.Wait()
		// The peer now answers round N's lookup of b (hit: pinned in round N).
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: lb.Keys, Hits: []bool{true}})
		synctest.Wait()
		var got offload.Result
		n.m.Do(func(s *offload.Step) { got = s.Lookup(b, req) }) // the engine's next step
		synctest.Wait()
		select {
		case m := <-fetched:
			t.Errorf("the node fetched b in round %d, whose lookup of b the peer never answered, on its answer to round %d's (forgotten) lookup of b; b: %v", m.RoundSeq, lb.RoundSeq, got)
		default:
			if got == offload.Hit {
				t.Errorf("b is a hit in round N+1 from round N's (forgotten) lookup's answer; want it unanswered")
			}
		}
		n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req); s.OnRequestFinished(req2) })
	})
}

// vlookupBehind makes req's second lookup of b wait on vLLM's wire: a and
// b are looked up, the peer answers a (hit) and holds b's lookup (lb, the
// result), a is fetched (round N), and b is looked up again in round N+1,
// which waits behind lb (same request and keys).
func vlookupBehind(t *testing.T, n *node, p *vpeer, req *offload.Request, a, b offload.Key) (lb vllmwire.Msg) {
	t.Helper()
	n.m.Do(func(s *offload.Step) { s.Lookup(a, req) })
	la := p.expect(vllmwire.TypeLookup)
	n.m.Do(func(s *offload.Step) { s.Lookup(b, req) })
	lb = p.expect(vllmwire.TypeLookup)
	p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: la.Keys, Hits: []bool{true}})
	synctest.Wait()
	n.m.Do(func(s *offload.Step) { s.Lookup(a, req) }) // fetch a: round N
	f := p.expect(vllmwire.TypeFetch)
	p.send(vllmwire.Msg{Type: vllmwire.TypeTransferDone, KVRequestID: "kv", RoundSeq: f.RoundSeq, Success: true})
	synctest.Wait()
	n.m.Do(func(s *offload.Step) { s.Lookup(b, req) })
	synctest.Wait()
	return lb
}
