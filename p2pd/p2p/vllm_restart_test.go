package p2p

import (
	"errors"
	"net"
	"os"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/vllmwire"
)

// Found in review: a restart (connect on a new connection of the
// identity) at max_sessions took the old session's DEALER, ended the old
// session and refused the new one for the cap, leaving the DEALER open on
// a dead session (libzmq then refuses the node's next DEALER to the peer;
// Tier.Close hung on its writer). A restart adds no session: it is taken.
func TestVLLMRestartAtCap(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "none", func(c *Config) { c.MaxSessions = 1 })
		p := newVPeer(t, mn, "vllm-cap:7000")
		p.handshake(n)
		// A local request names another peer whose ROUTER does not accept:
		// a second session, dialling (vdial checks no cap).
		q := newVPeer(t, mn, "vllm-q2:7000")
		req := &offload.Request{ID: "rq", TransferParams: source("kvq", q.id)}
		n.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
		synctest.Wait()
		var dealer *ctrlConn
		n.m.Do(func(*offload.Step) {
			for s := range n.tier.sessions {
				if s.peer == p.id {
					dealer = s.conn
				}
			}
		})
		if dealer == nil {
			t.Fatal("no DEALER to the peer")
		}
		// The peer starts a new session: a new connection of its identity, connect.
		p.dial(n.tier.Addr())
		p.send(p.connectMsg(n))
		time.Sleep(time.Minute) // past every handshake_timeout
		synctest.Wait()
		var leaked bool
		n.m.Do(func(*offload.Step) {
			dealer.out.Lock()
			closed := dealer.out.closed
			dealer.out.Unlock()
			leaked = !closed && dealer.s.dead
		})
		select {
		case <-p.closed:
		default:
			t.Errorf("the node's DEALER to %s is still open a minute after its session ended (refused restart at max_sessions): leaked, attached to a dead session (%v)", p.id, leaked)
		}
		if leaked { // let Tier.Close end (its wg.Wait waits on the writer)
			n.m.Do(func(*offload.Step) { n.tier.closeConn(dealer) })
		}
		n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	})
}

// data_plane none on the consuming side: a load fails unsent (no fetch),
// the request misses from then on, and its end sends the terminal fetch
// that releases the peer's pins.
func TestVLLMNonePlaneConsumer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n, p, req, _ := vlinked(t, newZNet(), "none", "vllm-n:7000")
		k := testKeys(10, 2)
		n.m.Do(func(s *offload.Step) { s.Lookup(k[0], req) })
		l := p.expect(vllmwire.TypeLookup)
		p.send(vllmwire.Msg{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: l.Keys, Hits: []bool{true}})
		synctest.Wait()
		var first, then offload.Result
		n.m.Do(func(s *offload.Step) { first = s.Lookup(k[0], req) })
		synctest.Wait()
		n.m.Do(func(s *offload.Step) { then = s.Lookup(k[1], req) })
		synctest.Wait()
		select {
		case m := <-p.in:
			t.Errorf("with data_plane none the node sent %s %+v", m.Type, m)
		default:
		}
		t.Logf("first lookup %v, after the failed load %v", first, then)
		if then != offload.Miss {
			t.Errorf("after the failed load: %v, want miss", then)
		}
		n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
		if f := p.expect(vllmwire.TypeFetch); len(f.Keys) != 0 {
			t.Errorf("terminal fetch %+v", f)
		}
	})
}

// Found in review: host-name identities were not checked, so
// "localhost:P" (vLLM's default form) from another host ended that
// peer's session. localhost must now come from this host: a loopback
// address, or the connection's own address. In memory, with the source
// addresses a real network would show (addrNet).
func TestVLLMLocalhostIdentity(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		an := &addrNet{zNet: newZNet(), local: "10.0.0.5"}
		n := newVNode(t, an, "none", nil)
		p := newVPeer(t, an.zNet, "localhost:7000")
		an.from = "127.0.0.1"
		p.handshake(n)
		if readyPeers(n) != 1 {
			t.Fatal("a localhost peer from loopback is not ready")
		}
		for _, from := range []string{"198.51.100.7", "10.0.0.5"} { // another host; this host's own address
			an.from = from
			z := rawDealer(t, an.zNet, n.tier.Addr(), p.id)
			z.WriteMessage(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeDisconnect}))
			synctest.Wait()
		}
		if readyPeers(n) != 0 {
			t.Fatal("neither connection ended the session: the one from this host's own address should have")
		}
		if got := rejectsOf(n, "auth"); got != 1 {
			t.Errorf("auth rejects %v, want 1 (the connection from another host)", got)
		}
	})
}

// addrNet is zNet whose connections accepted by the node show a source
// address (from, set before each dial) and a local one, as TCP would.
type addrNet struct {
	zNet
	from, local string
}

func (n *addrNet) Listen(addr string) (net.Listener, error) {
	l, err := n.zNet.Listen(addr)
	return addrListener{l, n}, err
}

type addrListener struct {
	net.Listener
	n *addrNet
}

func (l addrListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return addrConn{c, &net.TCPAddr{IP: net.ParseIP(l.n.from), Port: 40000}, &net.TCPAddr{IP: net.ParseIP(l.n.local), Port: 5710}}, nil
}

type addrConn struct {
	net.Conn
	remote, local net.Addr
}

func (c addrConn) RemoteAddr() net.Addr { return c.remote }
func (c addrConn) LocalAddr() net.Addr  { return c.local }

// Found in review: a restart (a second connect, on a new connection)
// while the node's DEALER to the peer was still dialling made the new
// session dial a second DEALER, which libzmq's ROUTER would refuse while
// the first lingers. The new session takes the first dial's end: one
// DEALER, and on it connect then connect_ack.
func TestVLLMRestartWhileDialling(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "none", nil)
		p := newVPeer(t, mn, "vllm-rd:7000")
		p.dial(n.tier.Addr())
		p.send(p.connectMsg(n))
		synctest.Wait() // the node dials back; the peer's ROUTER has not accepted yet
		p.dial(n.tier.Addr())
		p.send(p.connectMsg(n)) // the peer's new session
		synctest.Wait()
		onlyDial(t, n, p)
	})
}

// Found in review: two restarts while the DEALER dials chain the heirs;
// the newest session gets the dial.
func TestVLLMRestartTwiceWhileDialling(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "none", nil)
		p := newVPeer(t, mn, "vllm-rd2:7000")
		for range 3 { // the first session, then two restarts, before the peer's ROUTER accepts
			p.dial(n.tier.Addr())
			p.send(p.connectMsg(n))
			synctest.Wait()
		}
		onlyDial(t, n, p)
	})
}

// Found in review: a session that ended another way (the peer's
// disconnect) while its DEALER dialled, then a new connect: the new
// session dialled a second time. Any new session of the identity takes a
// dial still in flight.
func TestVLLMNewSessionTakesDialInFlight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newZNet()
		n := newVNode(t, mn, "none", nil)
		p := newVPeer(t, mn, "vllm-dd:7000")
		p.dial(n.tier.Addr())
		p.send(p.connectMsg(n))
		synctest.Wait() // the node dials back; not accepted yet
		p.send(vllmwire.Msg{Type: vllmwire.TypeDisconnect})
		synctest.Wait()
		p.dial(n.tier.Addr())
		p.send(p.connectMsg(n))
		synctest.Wait()
		onlyDial(t, n, p)
	})
}

// The in-memory network honours write deadlines as TCP does (found in
// review: a write to a peer that stopped reading waited past its deadline,
// so closeConn's deadline could not wake a writer in these tests).
func TestZPipeWriteDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a, b := net.Pipe()
		defer b.Close()
		p := newZPipe(a)
		defer p.Close()
		p.SetWriteDeadline(time.Now().Add(time.Second))
		start := time.Now()
		var err error
		for err == nil && time.Since(start) < time.Minute { // nobody reads b: the queue fills
			_, err = p.Write([]byte("x"))
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) != time.Second {
			t.Errorf("a write to a peer that does not read: %v after %v, want the deadline's error after 1s", err, time.Since(start))
		}
	})
}

// onlyDial takes the node's one DEALER dial to p (after sessions of p's
// identity came and went while it dialled): on it connect and connect_ack
// for the newest session, which becomes ready; no second dial comes.
func onlyDial(t *testing.T, n *node, p *vpeer) {
	t.Helper()
	p.accept(n.tier.Addr())
	extra := make(chan net.Conn, 1)
	go func() { c, _ := p.ln.Accept(); extra <- c }()
	if m := p.next(); m.Type != vllmwire.TypeConnect {
		t.Fatalf("the node's DEALER sent %q (closed: %v); want connect for the newest session", m.Type, m.Type == "")
	}
	p.expect(vllmwire.TypeConnectAck)
	p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: p.id})
	synctest.Wait()
	if readyPeers(n) != 1 {
		t.Fatal("the newest session is not ready on the DEALER the node dialled")
	}
	select {
	case c := <-extra:
		if c != nil {
			t.Error("the node dialled the peer a second time")
			c.Close()
		}
	default:
	}
}
