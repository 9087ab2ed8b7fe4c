package p2p

import (
	"crypto/hmac"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// session is one peer: one control connection, the consumer requests that
// fetch from it and the rounds this node serves it (S6.1). Fields are
// touched under the manager lock, except the send queue.
type session struct {
	t       *Tier
	dialed  bool
	addr    string // what we dialled
	created time.Time
	conn    net.Conn

	peer     string
	peerInc  [16]byte
	peerAddr string
	peerInfo []byte
	nonce    [32]byte

	gotConnect, gotAck, ready, dead bool
	handshakeDone                   atomic.Bool // lets the reader lower the frame limit
	held                            []wire.Msg  // role messages queued until ready

	lastRecv time.Time
	pingSent time.Time
	pingSeq  uint64
	errs     int // consecutive handler errors (S8.2)
	round    uint64

	creqs   map[string]*creq    // consumer requests by kv_request_id
	rounds  map[roundID]*pround // rounds this node serves
	lookups []*plookup          // peer lookups parked on pending keys
	pins    map[uint64]*pround  // pin job → its round
	loads   map[uint64]*load    // consumer loads by round
	quar    []*load             // loads quarantined until the data plane proves the writer stopped
	out     struct {            // frames for the writer goroutine
		sync.Mutex
		cond   *sync.Cond
		frames [][]byte
		closed bool
	}
}

type roundID struct {
	kvID  string
	round uint64
}

func (t *Tier) newSession(dialed bool, addr string) *session {
	s := &session{t: t, dialed: dialed, addr: addr, created: time.Now(), creqs: map[string]*creq{},
		rounds: map[roundID]*pround{}, pins: map[uint64]*pround{}, loads: map[uint64]*load{}}
	s.out.cond = sync.NewCond(&s.out.Mutex)
	rand.Read(s.nonce[:])
	t.sessions[s] = true
	return s
}

func (s *session) nextRound() uint64 {
	s.round++
	return s.round
}

// attach starts a control connection: its reader and writer goroutines,
// then our Connect.
func (t *Tier) attach(s *session, c net.Conn) {
	if s.dead || t.closed {
		c.Close()
		return
	}
	s.conn = c
	s.lastRecv = time.Now()
	t.wg.Go(func() { s.writer(c) })
	t.wg.Go(func() { s.reader(c) })
	t.sendNow(s, wire.Connect{NodeID: t.self.NodeID, Incarnation: t.self.Incarnation, Version: wire.Version,
		BlockBytes: uint64(t.blockBytes), Fingerprint: t.node.Fingerprint(), HashSeed: t.node.HashSeed,
		Addr: t.addr, DataPlane: t.dp.Name(), DataInfo: t.dp.LocalInfo(), Nonce: s.nonce})
}

func (s *session) reader(c net.Conn) {
	var buf []byte
	for {
		limit := wire.MaxHandshakeFrame
		if s.handshakeDone.Load() {
			limit = wire.MaxFrame
		}
		p, err := wire.ReadFrame(c, buf, limit)
		var m wire.Msg
		if err == nil {
			buf = p
			m, err = wire.Decode(p)
		}
		if err != nil {
			reason := fmt.Sprintf("connection lost: %v", err)
			proto := errors.Is(err, wire.ErrMalformed)
			if proto {
				reason = fmt.Sprintf("protocol error: %v", err)
			}
			s.t.post(func() {
				if proto {
					s.t.protocolError(s, reason)
				} else {
					s.t.kill(s, reason)
				}
			})
			return
		}
		s.t.post(func() { s.t.handle(s, m) })
	}
}

func (s *session) writer(c net.Conn) {
	o := &s.out
	for {
		o.Lock()
		for len(o.frames) == 0 && !o.closed {
			o.cond.Wait()
		}
		frames := o.frames
		o.frames = nil
		closed := o.closed
		o.Unlock()
		for _, f := range frames {
			if _, err := c.Write(f); err != nil {
				s.t.post(func() { s.t.kill(s, fmt.Sprintf("send failed: %v", err)) })
				c.Close()
				return
			}
		}
		if closed {
			c.Close()
			return
		}
	}
}

// sendNow queues m for the writer regardless of the handshake.
func (t *Tier) sendNow(s *session, m wire.Msg) {
	f := wire.Append(nil, m)
	s.out.Lock()
	if !s.out.closed {
		s.out.frames = append(s.out.frames, f)
		s.out.cond.Signal()
	}
	s.out.Unlock()
}

// send queues a role message; before the handshake completes it is held.
func (t *Tier) send(s *session, m wire.Msg) {
	if s.dead {
		return
	}
	if !s.ready {
		s.held = append(s.held, m)
		return
	}
	t.sendNow(s, m)
}

// handle dispatches one message (S6.2). A malformed message or a
// duplicate fetch is a protocol error; five handler errors in a row
// disconnect the session (S8.2).
func (t *Tier) handle(s *session, m wire.Msg) {
	if s.dead {
		return
	}
	s.lastRecv = time.Now()
	var err error
	switch m := m.(type) {
	case wire.Connect:
		err = t.onConnect(s, m)
	case wire.ConnectAck:
		err = t.onConnectAck(s, m)
	case wire.Disconnect:
		if !s.ready && m.Reason != "" {
			t.st.rejects["by peer: "+m.Reason]++
			t.log.Warn("p2p: peer rejected the handshake", "peer", s.peer, "addr", s.addr, "reason", m.Reason)
		}
		t.kill(s, "peer disconnected: "+m.Reason)
		return
	case wire.Ping:
		t.sendNow(s, wire.Pong{Seq: m.Seq})
	case wire.Pong:
		s.pingSent = time.Time{}
	case wire.Hello:
		err = fmt.Errorf("%w: hello after the connection started", errProtocol)
	default:
		if !s.ready {
			err = fmt.Errorf("%w: %v before the handshake", errProtocol, m.Type())
			break
		}
		err = t.handleRole(s, m)
	}
	switch {
	case err == nil:
		s.errs = 0
	case errors.Is(err, errProtocol) || errors.Is(err, errDuplicateFetch):
		t.protocolError(s, err.Error())
	default:
		s.errs++
		t.log.Warn("p2p: handler error", "peer", s.peer, "err", err, "in_a_row", s.errs)
		if s.errs >= 5 {
			t.protocolError(s, fmt.Sprintf("five handler errors in a row, last: %v", err))
		}
	}
}

var errProtocol = errors.New("protocol error")

func (t *Tier) handleRole(s *session, m wire.Msg) error {
	switch m := m.(type) {
	case wire.Lookup:
		return t.onLookup(s, m)
	case wire.LookupResp:
		return t.onLookupResp(s, m)
	case wire.Fetch:
		return t.onFetch(s, m)
	case wire.TransferDone:
		return t.onTransferDone(s, m)
	case wire.AbortFetch:
		return t.onAbortFetch(s, m)
	case wire.AbortAck:
		return t.onAbortAck(s, m)
	}
	return fmt.Errorf("%w: unexpected %v", errProtocol, m.Type())
}

// onConnect checks the peer's handshake (S6.1); any mismatch rejects it
// with a reason both sides log and count.
func (t *Tier) onConnect(s *session, m wire.Connect) error {
	if s.gotConnect {
		return fmt.Errorf("%w: second connect", errProtocol)
	}
	reason := ""
	switch {
	case m.Version != wire.Version:
		reason = fmt.Sprintf("protocol version %d, want %d", m.Version, wire.Version)
	case m.NodeID == t.self.NodeID:
		reason = "same node id as this node"
	case m.BlockBytes != uint64(t.blockBytes):
		reason = fmt.Sprintf("block size %d, want %d", m.BlockBytes, t.blockBytes)
	case m.HashSeed != t.node.HashSeed:
		reason = "hash seed differs"
	case m.Fingerprint != t.node.Fingerprint():
		reason = "config fingerprint differs"
	case m.DataPlane != t.dp.Name():
		reason = fmt.Sprintf("data plane %q, want %q", m.DataPlane, t.dp.Name())
	}
	if reason != "" {
		t.reject(s, reason)
		return nil
	}
	s.gotConnect = true
	s.peer, s.peerInc, s.peerAddr, s.peerInfo = m.NodeID, m.Incarnation, m.Addr, m.DataInfo
	t.sendNow(s, wire.ConnectAck{Proof: t.proof(m.Nonce, t.self.NodeID)})
	return t.maybeReady(s)
}

func (t *Tier) onConnectAck(s *session, m wire.ConnectAck) error {
	if s.gotAck {
		return nil // harmless
	}
	if !s.gotConnect {
		return fmt.Errorf("%w: connect_ack before connect", errProtocol)
	}
	if want := t.proof(s.nonce, s.peer); !hmac.Equal(want[:], m.Proof[:]) {
		t.reject(s, "cluster token proof failed")
		return nil
	}
	s.gotAck = true
	return t.maybeReady(s)
}

func (t *Tier) reject(s *session, reason string) {
	t.st.rejects[reason]++
	t.log.Warn("p2p: rejecting peer", "peer", s.peer, "addr", s.addr, "reason", reason)
	t.sendNow(s, wire.Disconnect{Reason: reason})
	t.kill(s, "rejected: "+reason)
}

// maybeReady completes the handshake: duplicate sessions are resolved
// (the connection dialled by the smaller node id wins), a new incarnation
// of a known node kills the old session (S6.8), and held messages flow.
func (t *Tier) maybeReady(s *session) error {
	if !s.gotConnect || !s.gotAck || s.ready {
		return nil
	}
	if o := t.byNode[s.peer]; o != nil && o != s && !o.dead {
		if o.peerInc != s.peerInc {
			t.kill(o, "new incarnation of the peer")
		} else {
			winner, loser := o, s
			if dialer(s, t.self.NodeID) < dialer(o, t.self.NodeID) {
				winner, loser = s, o
			}
			t.adopt(winner, loser)
			t.kill(loser, "duplicate connection")
			if loser == s {
				return nil
			}
		}
	}
	if err := t.dp.AddPeer(s.peer, s.peerAddr, s.peerInfo); err != nil {
		t.kill(s, fmt.Sprintf("data plane: %v", err))
		return nil
	}
	s.ready = true
	s.handshakeDone.Store(true)
	t.byNode[s.peer] = s
	t.st.sessionsOpened++
	t.log.Info("p2p: peer connected", "peer", s.peer, "addr", s.peerAddr, "dialed", s.dialed)
	for _, m := range s.held {
		t.sendNow(s, m)
	}
	s.held = nil
	return nil
}

// dialer is the node id that dialled s.
func dialer(s *session, self string) string {
	if s.dialed {
		return self
	}
	return s.peer
}

// adopt moves the consumer requests and held messages of a session that
// loses a duplicate race to the winner.
func (t *Tier) adopt(winner, loser *session) {
	for id, cr := range loser.creqs {
		cr.s = winner
		winner.creqs[id] = cr
	}
	loser.creqs = map[string]*creq{}
	winner.held = append(winner.held, loser.held...)
	loser.held = nil
	if loser.dialed && t.byAddr[loser.addr] == loser {
		t.byAddr[loser.addr] = winner
	}
	if winner.ready {
		for _, m := range winner.held {
			t.sendNow(winner, m)
		}
		winner.held = nil
	}
}

func (t *Tier) protocolError(s *session, reason string) {
	t.st.protocolErrors++
	t.sendNow(s, wire.Disconnect{Reason: reason})
	t.kill(s, reason)
}

// kill ends a session (S6.8): every load and store job of the peer fails,
// its consumer requests are marked failed (they recompute), and its
// data-plane registration is dropped; loads report only once the data
// plane proved the peer can no longer write into their slots.
func (t *Tier) kill(s *session, reason string) {
	if s.dead {
		return
	}
	s.dead = true
	if reason != "" {
		t.log.Info("p2p: session ended", "peer", s.peer, "addr", s.addr, "reason", reason)
	}
	if s.ready {
		t.st.peerDeaths++
	}
	s.out.Lock()
	s.out.closed = true
	s.out.cond.Signal()
	s.out.Unlock()
	if s.conn != nil {
		// The writer closes the connection after flushing a goodbye; the
		// deadlines make sure neither goroutine waits on the peer.
		s.conn.SetReadDeadline(time.Now())
		s.conn.SetWriteDeadline(time.Now().Add(time.Second))
	}
	delete(t.sessions, s)
	if t.byNode[s.peer] == s {
		delete(t.byNode, s.peer)
	}
	if t.byAddr[s.addr] == s {
		delete(t.byAddr, s.addr)
	}
	for _, cr := range s.creqs {
		cr.failed = true
	}
	if len(s.creqs) > 0 {
		t.env.Progress() // their lookups now answer Miss (S2.10)
	}
	// Producer side: every pin fails (the data plane's write callbacks
	// find the session dead and only report).
	for _, r := range s.rounds {
		if !r.writing {
			t.failRound(s, r)
		}
	}
	for _, l := range s.lookups {
		t.finishOutside(l.req)
	}
	s.lookups = nil
	loads := make([]*load, 0, len(s.loads)+len(s.quar))
	for _, l := range s.loads {
		loads = append(loads, l)
	}
	loads = append(loads, s.quar...)
	s.loads = map[uint64]*load{}
	s.quar = nil
	if s.peer == "" || !s.ready {
		for _, l := range loads {
			t.loadResult(l, false)
		}
		return
	}
	t.dp.RemovePeer(s.peer, func() {
		t.post(func() {
			for _, l := range loads {
				t.loadResult(l, false)
			}
		})
	})
}

// finishOutside tells the manager an outside request ended, now if a
// Parent is at hand, else at the next Serve.
func (t *Tier) finishOutside(r *offload.Request) {
	if r == nil {
		return
	}
	if t.p != nil {
		t.p.OnRequestFinished(r)
		return
	}
	t.owed = append(t.owed, r)
}

// timeouts enforces the session's deadlines and returns the next one.
func (t *Tier) timeouts(s *session, now time.Time) time.Time {
	var next time.Time
	soonest := func(d time.Time) {
		if next.IsZero() || d.Before(next) {
			next = d
		}
	}
	cfg := t.cfg
	if !s.ready {
		d := s.created.Add(time.Duration(cfg.HandshakeTimeout))
		if !now.Before(d) {
			t.kill(s, "handshake timed out")
			return time.Time{}
		}
		soonest(d)
		return next
	}
	// Consumer: load timeout → abort; abort-ack timeout → quarantine (S6.6).
	for round, l := range s.loads {
		switch {
		case l.abortedAt.IsZero():
			d := l.sent.Add(time.Duration(cfg.LoadTimeout))
			if !now.Before(d) {
				t.st.loadTimeouts++
				l.abortedAt = now
				l.cr.failed = true
				t.env.Progress()
				t.send(s, wire.AbortFetch{ReqID: l.cr.kvID, Round: round})
				d = now.Add(time.Duration(cfg.AbortAckTimeout))
			}
			soonest(d)
		default:
			d := l.abortedAt.Add(time.Duration(cfg.AbortAckTimeout))
			if !now.Before(d) {
				t.quarantine(s, round, l)
				continue
			}
			soonest(d)
		}
	}
	// Producer: pins unclaimed after pin_hold are released (S6.5).
	for id, r := range s.pins {
		if r.writing {
			continue
		}
		d := r.pinDeadline[id]
		if !now.Before(d) {
			t.st.pinExpiries++
			t.pinResult(s, r, id, false)
			continue
		}
		soonest(d)
	}
	// Liveness: pings only while work with the peer is outstanding (S6.9).
	if s.busy() {
		if !s.pingSent.IsZero() && !now.Before(s.pingSent.Add(time.Duration(cfg.KeepaliveTimeout))) {
			t.kill(s, "keep-alive timed out")
			return time.Time{}
		}
		if s.pingSent.IsZero() {
			d := s.lastRecv.Add(time.Duration(cfg.KeepaliveInterval))
			if !now.Before(d) {
				s.pingSeq++
				s.pingSent = now
				t.sendNow(s, wire.Ping{Seq: s.pingSeq})
				d = now.Add(time.Duration(cfg.KeepaliveTimeout))
			}
			soonest(d)
		} else {
			soonest(s.pingSent.Add(time.Duration(cfg.KeepaliveTimeout)))
		}
	} else {
		s.pingSent = time.Time{}
	}
	return next
}

// busy says whether work with the peer is outstanding.
func (s *session) busy() bool {
	if len(s.loads) > 0 || len(s.quar) > 0 || len(s.rounds) > 0 || len(s.lookups) > 0 {
		return true
	}
	for _, cr := range s.creqs {
		if cr.lookupOpen && !cr.answered() {
			return true
		}
	}
	return false
}
