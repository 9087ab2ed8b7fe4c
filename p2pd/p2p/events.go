package p2p

import (
	"fmt"
	"net"

	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
	"github.com/kvtier/kvtier/p2pd/vllmwire"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// Events: what the connection and data-plane goroutines hand the tier.
// They queue (post) and are applied under the manager lock by the next
// pass (Serve), in order. Typed, not closures (issue 13), so a test or a
// log can name them.
type event interface{ apply(t *Tier) }

type (
	// frameReceived: a control connection read a frame.
	frameReceived struct {
		cc *ctrlConn
		m  wire.Msg
		n  int // what it counts against the reader's bound (ctrlConn.admit)
	}
	// connClosed: a control connection's reader or writer ended.
	connClosed struct {
		cc  *ctrlConn
		err error
	}
	// sendQueueFull: the peer does not read its control connection.
	sendQueueFull struct{ s *session }
	// accepted: an inbound control connection completed its handshake.
	accepted struct {
		c  net.Conn
		sh shaken
	}
	// dialled: a dial to addr ended, with a handshaken connection or err.
	dialled struct {
		s    *session
		addr string
		c    net.Conn
		sh   shaken
		err  error
	}
	// writeDone: the data plane ended a round this node wrote (producer).
	writeDone struct {
		s     *session
		round protocol.RoundID
		err   error
	}
	// blocksArrived: every block of a round arrived and verified, or the
	// round failed in the data plane (consumer).
	blocksArrived struct {
		s     *session
		round uint64
		err   error
	}
	// unexpected: the data plane no longer reads a failed round's blocks.
	unexpected struct {
		s     *session
		round uint64
	}
	// vpipe: a vLLM peer's DEALER connected to the ROUTER, with its first
	// message; vframe: a message on such a connection.
	vpipe struct {
		cc    *ctrlConn
		first vllmwire.Msg
	}
	vframe struct {
		cc *ctrlConn
		m  vllmwire.Msg
		n  int // as frameReceived's
	}
	// vdialled: this node's DEALER to a vLLM peer connected, or err.
	vdialled struct {
		s   *session
		cc  *ctrlConn
		err error
	}
	// vpong: the DEALER's outstanding PING was answered.
	vpong struct {
		cc  *ctrlConn
		seq uint64
	}
	// peerRemoved: the data plane dropped the peer; re-added while the
	// session lives (a quarantine), not after its death.
	peerRemoved struct {
		s          *session
		peer, addr string
		info       []byte
	}
)

func (e frameReceived) apply(t *Tier) {
	if !t.deferring(e) {
		e.cc.release(e.n)
		t.handle(e.cc, e.m)
	}
}
func (e connClosed) apply(t *Tier)    { t.connLost(e.cc, e.err) }
func (e sendQueueFull) apply(t *Tier) { t.kill(e.s, "send queue full") }
func (e accepted) apply(t *Tier)      { t.established(nil, e.c, e.sh) }

func (e vpipe) apply(t *Tier) { t.vattach(e.cc, e.first) }
func (e vframe) apply(t *Tier) {
	e.cc.release(e.n)
	t.vhandle(e.cc, e.m)
}
func (e vdialled) apply(t *Tier) { t.vdialled(e.s, e.cc, e.err) }

func (e vpong) apply(t *Tier) {
	if s := e.cc.s; s != nil && !s.dead && s.conn == e.cc {
		s.live.Received(t.env.Now())
		s.live.Pong(wire.Pong{Seq: e.seq})
	}
}

func (e dialled) apply(t *Tier) {
	if e.err != nil {
		t.kill(e.s, fmt.Sprintf("dialling %s: %v", e.addr, e.err))
		return
	}
	t.established(e.s, e.c, e.sh)
}

func (e writeDone) apply(t *Tier) {
	if e.s.v != nil {
		delete(e.s.v.writes, e.round)
	}
	e.s.prod.WriteDone(e.round, e.err)
	t.applyProd(e.s)
}

func (e blocksArrived) apply(t *Tier) {
	e.s.cons.BlocksArrived(e.round, e.err, t.env.Now())
	t.applyCons(e.s)
}

func (e unexpected) apply(t *Tier) {
	e.s.cons.Unexpected(e.round, t.env.Now())
	t.applyCons(e.s)
}

func (e peerRemoved) apply(t *Tier) {
	e.s.cons.PeerRemoved(t.env.Now())
	t.applyCons(e.s)
	if !e.s.dead { // a quarantine: the peer stays
		t.dp.AddPeer(e.peer, e.addr, e.info)
	}
}
