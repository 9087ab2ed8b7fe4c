package p2p

import (
	"net"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/vllmwire"
	"github.com/kvtier/kvtier/p2pd/zmtp"
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
// "localhost:P" (vLLM's default form) from a non-loopback address ended
// that peer's session. localhost must now come from loopback, as an IP
// identity from its address. Real sockets; needs a non-loopback address
// on this host (192.0.2.2), else it skips.
func TestVLLMLocalhostIdentity(t *testing.T) {
	const far = "192.0.2.2" // this host's non-loopback address
	if c, err := net.Listen("tcp", far+":0"); err != nil {
		t.Skipf("no %s here: %v", far, err)
	} else {
		c.Close()
	}
	for _, host := range []string{"127.0.0.1", "localhost"} {
		t.Run(host, func(t *testing.T) {
			router, err := net.Listen("tcp", "127.0.0.1:0") // the vLLM beside the node
			if err != nil {
				t.Fatal(err)
			}
			defer router.Close()
			_, port, _ := net.SplitHostPort(router.Addr().String())
			id := net.JoinHostPort(host, port)
			free, _ := net.Listen("tcp", "0.0.0.0:0")
			_, np, _ := net.SplitHostPort(free.Addr().String())
			free.Close()
			n := newVNode(t, nil, "none", func(c *Config) { c.Listen, c.Advertise = "0.0.0.0:"+np, "127.0.0.1:"+np })
			dealer := func(local, addr string) *zmtp.Conn {
				d := net.Dialer{Timeout: 5 * time.Second}
				if local != "" {
					d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
				}
				c, err := d.Dial("tcp", addr)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				c.SetDeadline(time.Now().Add(10 * time.Second))
				z, err := zmtp.Handshake(c, zmtp.Dealer, []byte(id), 8<<20)
				if err != nil {
					t.Fatal(err)
				}
				go func() {
					for {
						if _, err := z.ReadMessage(); err != nil {
							return
						}
					}
				}()
				return z
			}
			// The legitimate peer: its DEALER from loopback, connect; it takes
			// the node's DEALER and acknowledges its connect.
			z := dealer("", "127.0.0.1:"+np)
			z.WriteMessage(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeConnect, PeerID: id, AgentMetadata: []byte{}, NumBlocks: 1,
				BlockLen: uint64(n.m.BlockBytes()), HashSeed: offload.VLLMDefaultSeed}))
			router.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
			back, err := router.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer back.Close()
			zb, err := zmtp.Handshake(back, zmtp.Router, nil, 8<<20)
			if err != nil {
				t.Fatal(err)
			}
			connected := make(chan struct{})
			go func() {
				for once := false; ; {
					if _, err := zb.ReadMessage(); err != nil {
						return
					}
					if !once { // the node's connect: only now may the peer acknowledge it
						once = true
						close(connected)
					}
				}
			}()
			<-connected
			z.WriteMessage(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: id}))
			for i := 0; readyPeers(n) != 1; i++ {
				if i > 2000 {
					t.Fatal("the legitimate peer's session is not ready")
				}
				time.Sleep(10 * time.Millisecond)
			}
			// A stranger on another address names the identity and says disconnect.
			s := dealer(far, far+":"+np)
			s.WriteMessage(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeDisconnect}))
			time.Sleep(500 * time.Millisecond)
			if readyPeers(n) != 1 {
				t.Errorf("a connection from %s claiming identity %s ended that peer's session", far, id)
			}
		})
	}
}

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
		p.accept(n.tier.Addr())
		extra := make(chan net.Conn, 1)
		go func() { c, _ := p.ln.Accept(); extra <- c }()
		p.expect(vllmwire.TypeConnect)
		p.expect(vllmwire.TypeConnectAck)
		p.send(vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: p.id})
		synctest.Wait()
		if readyPeers(n) != 1 {
			t.Fatal("the new session is not ready on the inherited DEALER")
		}
		select {
		case c := <-extra:
			if c != nil {
				t.Error("the node dialled the peer a second time")
				c.Close()
			}
		default:
		}
	})
}
