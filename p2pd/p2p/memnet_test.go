package p2p

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// memNet is an in-memory Network of net.Pipe connections, for tests under
// testing/synctest.
type memNet struct {
	mu sync.Mutex
	ls map[string]*memListener
}

func newMemNet() *memNet { return &memNet{ls: map[string]*memListener{}} }

type memListener struct {
	addr   string
	conns  chan net.Conn
	closed chan struct{}
	once   sync.Once
}

type memAddr string

func (a memAddr) Network() string { return "mem" }
func (a memAddr) String() string  { return string(a) }

func (n *memNet) Listen(addr string) (net.Listener, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if addr == "127.0.0.1:0" {
		addr = "node" + string(rune('a'+len(n.ls))) + ":1"
	}
	l := &memListener{addr: addr, conns: make(chan net.Conn), closed: make(chan struct{})}
	n.ls[addr] = l
	return l, nil
}

func (n *memNet) Dial(ctx context.Context, addr string) (net.Conn, error) {
	n.mu.Lock()
	l := n.ls[addr]
	n.mu.Unlock()
	if l == nil {
		return nil, errors.New("memnet: connection refused")
	}
	a, b := net.Pipe()
	select {
	case l.conns <- b:
		return a, nil
	case <-l.closed:
		return nil, errors.New("memnet: connection refused")
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (l *memListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

func (l *memListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

func (l *memListener) Addr() net.Addr { return memAddr(l.addr) }

// fakePeer speaks the protocol by hand over a memNet connection, to drive
// one side of a session exactly.
type fakePeer struct {
	t     testing.TB
	c     net.Conn
	buf   []byte
	node  offload.Config
	id    string
	inc   [16]byte
	token string
	recv  chan wire.Msg
	mu    sync.Mutex // serialises sends (the test and the pong replies)
	// Mute stops the automatic pong replies (set before the handshake).
	Mute  bool
	pings int
}

// fakeShaker is the handshaker of a fake peer named id.
func (f *fakePeer) shaker() *handshaker {
	return &handshaker{Shaker: protocol.Shaker{Self: peerID{Node: f.id, Inc: f.inc}, Token: []byte(f.token), Connect: wire.Connect{NodeID: f.id,
		Incarnation: f.inc, Version: wire.Version, BlockBytes: uint64(f.node.Geometry.BlockBytes()),
		Fingerprint: f.node.Fingerprint(), HashSeed: f.node.HashSeed, Addr: f.id + ":1", DataPlane: "tcp"}}}
}

// connectFake dials n's P2P port as peer id and completes the handshake.
func connectFake(t testing.TB, mn *memNet, n *node, id string) *fakePeer {
	t.Helper()
	f := newFake(t, id, n.tier.cfg.ClusterToken)
	c, err := mn.Dial(context.Background(), n.tier.Addr())
	if err != nil {
		t.Fatal(err)
	}
	f.c = c
	if _, err := f.shaker().dialControl(c); err != nil {
		t.Fatalf("fake peer handshake: %v", err)
	}
	f.serve()
	return f
}

func newFake(t testing.TB, id, token string) *fakePeer {
	f := &fakePeer{t: t, node: tinyConfig(1), id: id, token: token}
	f.inc[0] = byte(len(id))
	copy(f.inc[1:], id)
	return f
}

// acceptFake waits on the fake's listener for the node's control
// connection and completes the handshake.
func acceptFake(t testing.TB, l net.Listener, id string) *fakePeer {
	t.Helper()
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	f := newFake(t, id, "")
	f.c = c
	h, ok := f.read().(wire.Hello)
	if !ok || h.Kind != wire.KindControl {
		t.Fatalf("first frame %v, want a control hello", h)
	}
	if _, err := f.shaker().acceptControl(c, h); err != nil {
		t.Fatalf("fake peer handshake: %v", err)
	}
	f.serve()
	return f
}

// acceptData answers, as the acceptor, the handshake of a data
// connection the node dialled to the fake: its hello, then the proofs.
func (f *fakePeer) acceptData(c net.Conn) error {
	p, err := wire.ReadFrame(c, nil, wire.MaxPreAuthFrame)
	if err != nil {
		return err
	}
	m, err := wire.Decode(p)
	if err != nil {
		return err
	}
	h, ok := m.(wire.Hello)
	if !ok {
		return fmt.Errorf("first frame %v, want a hello", m.Type())
	}
	return f.shaker().acceptData(c, h, func(peerID) bool { return true }, nil)
}

// serve reads what the node sends after the handshake, answering pings.
func (f *fakePeer) serve() {
	f.recv = make(chan wire.Msg, 64)
	go func() {
		defer close(f.recv)
		for {
			m := f.readErr()
			if m == nil {
				return
			}
			if p, ok := m.(wire.Ping); ok {
				f.mu.Lock()
				f.pings++
				mute := f.Mute
				f.mu.Unlock()
				if !mute {
					f.send(wire.Pong{Seq: p.Seq})
				}
				continue
			}
			f.recv <- m
		}
	}()
}

func (f *fakePeer) send(m wire.Msg) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var err error
	if f.buf, err = wire.Write(f.c, f.buf, m); err != nil {
		f.t.Errorf("fake peer send %v: %v", m.Type(), err)
	}
}

func (f *fakePeer) readErr() wire.Msg {
	p, err := wire.ReadFrame(f.c, nil, wire.MaxHandshakeFrame)
	if err != nil {
		return nil
	}
	m, err := wire.Decode(p)
	if err != nil {
		f.t.Errorf("fake peer decode: %v", err)
		return nil
	}
	return m
}

func (f *fakePeer) read() wire.Msg {
	m := f.readErr()
	if m == nil {
		f.t.Fatal("fake peer: connection closed")
	}
	return m
}

// Pings is how many pings the node sent.
func (f *fakePeer) Pings() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pings
}

// next returns the next message the node sent, or nil if it closed.
func (f *fakePeer) next() wire.Msg { return <-f.recv }

// idle reports whether no message is waiting (call after synctest.Wait).
func (f *fakePeer) idle() bool { return len(f.recv) == 0 }

var _ = time.Second
