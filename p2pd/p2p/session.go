package p2p

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
	"github.com/kvtier/kvtier/p2pd/wire"
	"github.com/kvtier/kvtier/p2pd/zmtp"
)

// session is one peer process: the consumer requests that fetch from it
// and the rounds this node serves it (S6.1). It speaks over one active
// control connection; a duplicate connection to the same process retires
// beside it without losing a frame. Fields are touched under the manager
// lock.
type session struct {
	t      *Tier
	dialed bool
	addr   string      // what we dialled
	conn   *ctrlConn   // the active connection; nil while dialling
	old    []*ctrlConn // duplicates retiring

	peer     string
	peerInc  [16]byte
	peerAddr string
	peerInfo []byte

	ready, dead bool
	held        []wire.Msg // role messages queued until ready
	// deferred holds frames of a connection while one the peer used
	// before it has not delivered its last frame, its marker (S6.1): the
	// peer sends on its connections in wins order, worst first, so a
	// connection waits only for those it beats. Their bytes stay counted
	// against their reader's maxUnapplied until served; the worst
	// connection never waits, so its reader always reads on.
	deferred   []frameReceived
	flushing   bool // flushDeferred runs (a frame it serves may end a connection and flush again)
	flushAgain bool

	live protocol.Liveness // keep-alive (S6.9)
	errs int               // consecutive handler errors (S8.2)

	cons *protocol.Consumer // the consumer side: local requests fetching from the peer
	prod *protocol.Producer // the producer side: the peer's lookups, leases and rounds

	v *vstate // vLLM's dialect (vllm.go); nil on kvtier's wire
}

// ctrlConn is one authenticated control connection with its reader and
// writer goroutines; they stop when the connection closes.
type ctrlConn struct {
	c         net.Conn
	s         *session
	dialer    string   // node id of the side that dialled it
	nonce     [32]byte // the dialler's handshake nonce
	retiring  bool     // a losing duplicate: nothing new is sent on it
	nDeferred int      // its frames in the session's deferred
	retiredAt time.Time
	peerDone  bool            // the peer's duplicate marker arrived: nothing more comes on it
	raw       syscall.RawConn // the socket, for queue's direct write; nil over TLS or a pipe
	// z is the connection's ZMTP layer on vLLM's wire (nil on kvtier's):
	// frames are then vLLM messages, written with z. pingOut is the
	// sequence of a PING sent and not yet answered.
	z       *zmtp.Conn
	pingOut atomic.Uint64
	out     struct {
		sync.Mutex
		cond   *sync.Cond
		frames [][]byte
		bytes  int    // queued in frames
		ping   uint64 // a ZMTP PING to send (vLLM's wire), 0: none
		busy   bool   // the writer is writing frames it took
		closed bool
	}
	// in counts the bytes of frames the reader posted that the manager
	// has not applied yet: beyond maxUnapplied the reader stops reading
	// until a pass applies them, so a peer that sends faster than the
	// manager serves is held back by TCP instead of growing the event
	// queue (S8.5). closed: the connection ended, the reader stops.
	in struct {
		sync.Mutex
		cond   *sync.Cond
		bytes  int
		closed bool
	}
}

// maxUnapplied bounds the bytes of a control connection's frames read and
// not yet applied (one frame more may always wait). A variable so a test
// can lower it.
var maxUnapplied = 16 << 20

// frameCost is what one frame counts against maxUnapplied beyond its
// bytes: its event and decoded message, so tiny frames are bounded too.
const frameCost = 256

// admit waits until n more bytes may wait for the manager; false when the
// connection ended meanwhile.
func (cc *ctrlConn) admit(n int) bool {
	in := &cc.in
	in.Lock()
	defer in.Unlock()
	for in.bytes > 0 && in.bytes+n > maxUnapplied {
		if in.closed {
			return false
		}
		in.cond.Wait()
	}
	in.bytes += n
	return true
}

// release is the manager applying a frame admit counted.
func (cc *ctrlConn) release(n int) {
	in := &cc.in
	in.Lock()
	in.bytes -= n
	in.cond.Signal()
	in.Unlock()
}

func newCtrlConn(c net.Conn) *ctrlConn {
	cc := &ctrlConn{c: c}
	cc.out.cond = sync.NewCond(&cc.out.Mutex)
	cc.in.cond = sync.NewCond(&cc.in.Mutex)
	return cc
}

func (t *Tier) newSession(dialed bool, addr string) *session {
	s := &session{t: t, dialed: dialed, addr: addr, cons: t.conss.New(), prod: t.prods.New(),
		live: protocol.Liveness{Interval: time.Duration(t.cfg.KeepaliveInterval), Timeout: time.Duration(t.cfg.KeepaliveTimeout)}}
	t.sessions[s] = true
	t.consOf[s.cons] = s
	return s
}

// wins says whether control connection a beats b as a duplicate (S6.1):
// the one dialled by the smaller node id; between connections one node
// dialled, the smaller dialler nonce. Both sides decide alike.
func wins(a, b *ctrlConn) bool {
	if a.dialer != b.dialer {
		return a.dialer < b.dialer
	}
	return bytes.Compare(a.nonce[:], b.nonce[:]) < 0
}

// established takes a control connection whose handshake succeeded: the
// first for that peer process makes its session ready; a duplicate joins
// the existing session, and the loser of the two retires (S6.1). pending
// is the session that dialled it (nil when accepted).
func (t *Tier) established(pending *session, c net.Conn, sh shaken) {
	if t.closed {
		c.Close()
		return
	}
	if pending != nil && pending.dead {
		pending = nil
	}
	cc := newCtrlConn(c)
	cc.dialer, cc.nonce = sh.Dialer, sh.DialNonce
	if tc, ok := c.(*net.TCPConn); ok { // exactly a socket: a wrapper (TLS) writes through itself
		cc.raw, _ = tc.SyscallConn()
	}
	pc := sh.Peer
	s := t.byNode[pc.NodeID]
	if s != nil && s.peerInc != pc.Incarnation {
		t.kill(s, "new incarnation of the peer")
		s = nil
	}
	if s != nil {
		if pending != nil && pending != s {
			t.merge(s, pending)
		}
		t.start(s, cc)
		if old := s.conn; wins(cc, old) {
			s.conn = cc // first: what retire's flush answers goes out on cc, not after old's marker
			t.retire(old)
		} else {
			t.retire(cc)
		}
		t.st.duplicates++
		t.redialed(pending)
		return
	}
	if int(t.nready.Load()) >= t.cfg.MaxSessions {
		t.rejects.add(false, wire.CodeCapacity)
		t.warnLimited("p2p: session cap reached; refusing a peer", "peer", pc.NodeID, "max_sessions", t.cfg.MaxSessions)
		t.wg.Go(func() { // not under the manager lock: the peer may not read
			c.SetWriteDeadline(time.Now().Add(time.Second))
			wire.Write(c, nil, wire.Disconnect{Code: wire.CodeCapacity, Reason: "too many sessions"})
			c.Close()
		})
		if pending != nil {
			t.kill(pending, "session cap reached")
		}
		return
	}
	if pending == nil {
		pending = t.newSession(false, "")
	}
	s = pending
	s.peer, s.peerInc, s.peerAddr, s.peerInfo = pc.NodeID, pc.Incarnation, pc.Addr, pc.DataInfo
	s.prod.Peer, s.cons.Peer = s.peer, s.peer
	t.start(s, cc)
	s.conn = cc
	if err := t.dp.AddPeer(s.peer, s.peerAddr, s.peerInfo); err != nil {
		t.protocolErrorCode(s, wire.CodeDataPlane, fmt.Sprintf("data plane: %v", err))
		return
	}
	s.ready = true
	s.live.Received(t.env.Now())
	t.byNode[s.peer] = s
	if s.peerAddr != "" && t.byAddr[s.peerAddr] == nil {
		t.byAddr[s.peerAddr] = s
	}
	t.live.add(peerID{Node: s.peer, Inc: s.peerInc})
	t.nready.Add(1)
	t.redialed(s)
	t.st.sessionsOpened++
	t.log.Info("p2p: peer connected", "peer", s.peer, "addr", s.peerAddr, "dialed", s.dialed)
	s.cons.Left(t.env.Now())
	for _, m := range s.held {
		t.sendNow(s, m)
	}
	s.held = nil
}

// start attaches cc to s and starts its goroutines.
func (t *Tier) start(s *session, cc *ctrlConn) {
	cc.s = s
	t.wg.Go(func() { t.writer(cc) })
	t.wg.Go(func() { t.reader(cc) })
}

// merge moves what a dialling session holds (requests waiting for the
// handshake and their held messages) into the ready session of the same
// peer: nothing was sent on its behalf yet, so nothing is lost.
func (t *Tier) merge(s, pending *session) {
	pending.cons.Left(t.env.Now()) // its held lookups leave on s now
	collided := s.cons.Merge(pending.cons)
	delete(t.consOf, pending.cons)
	for _, m := range pending.held {
		if l, ok := m.(wire.Lookup); ok && collided[l.ReqID] {
			continue // the failed request's lookups: nothing will fetch them
		}
		t.send(s, m)
	}
	pending.held = nil
	pending.dead = true
	delete(t.sessions, pending)
	if pending.addr != "" {
		t.byAddr[pending.addr] = s
	}
}

// retire stops sending on a losing duplicate: frames already queued go
// out, then the duplicate marker; the peer does the same, and the
// connection closes once both markers passed, or after keepalive_timeout.
// Frames that arrive on it meanwhile are served like any other.
func (t *Tier) retire(cc *ctrlConn) {
	if cc.retiring {
		return
	}
	cc.retiring = true
	cc.retiredAt = t.env.Now()
	cc.queue(wire.Append(nil, wire.Disconnect{Code: wire.CodeDuplicate, Reason: "duplicate connection"}))
	s := cc.s
	if len(s.old) >= maxRetiring { // a peer dialling again and again: the oldest goes now
		t.closeConn(s.old[0])
	}
	s.old = append(s.old, cc)
	if cc.peerDone {
		t.finishConn(cc)
	}
	t.armBy(cc.retiredAt.Add(time.Duration(t.cfg.KeepaliveTimeout))) // the retirement's bound
}

// maxRetiring bounds a session's retiring duplicates.
const maxRetiring = 4

// closeConn closes one control connection now and forgets it: queued
// frames get a second to go out; neither goroutine waits on the peer.
func (t *Tier) closeConn(cc *ctrlConn) {
	t.endConn(cc)
	cc.c.SetReadDeadline(time.Now())
	cc.c.SetWriteDeadline(time.Now().Add(time.Second))
}

// finishConn closes a retired connection whose markers both passed: the
// writer flushes what is queued (within keepalive_timeout) and closes it;
// the reader then ends.
func (t *Tier) finishConn(cc *ctrlConn) {
	t.endConn(cc)
	cc.c.SetWriteDeadline(time.Now().Add(time.Duration(t.cfg.KeepaliveTimeout)))
}

func (t *Tier) endConn(cc *ctrlConn) {
	cc.out.Lock()
	cc.out.closed = true
	cc.out.cond.Signal()
	cc.out.Unlock()
	cc.in.Lock()
	cc.in.closed = true
	cc.in.cond.Broadcast()
	cc.in.Unlock()
	if s := cc.s; s != nil {
		s.old = slices.DeleteFunc(s.old, func(o *ctrlConn) bool { return o == cc })
		if s.v != nil {
			s.v.pipes = slices.DeleteFunc(s.v.pipes, func(o *ctrlConn) bool { return o == cc })
		}
		t.flushDeferred(s)
	}
}

// waits says whether a frame on cc must wait: a retiring connection cc
// beats (the peer used it before cc) has not delivered its marker. A
// connection that closed with frames held here is not waited for by
// name: those frames wait for a worse one that cc beats too (wins is a
// total order), and are served before cc's.
func (s *session) waits(cc *ctrlConn) bool {
	for _, o := range s.old {
		if o != cc && !o.peerDone && wins(cc, o) {
			return true
		}
	}
	return false
}

// flushDeferred serves the held frames the peer sent before anything
// still missing: connection by connection, worst first (the peer's
// order), each in its own order, up to the first that still waits.
func (t *Tier) flushDeferred(s *session) {
	if s.flushing {
		s.flushAgain = true
		return
	}
	s.flushing = true
	defer func() { s.flushing = false }()
	for again := true; again && len(s.deferred) > 0 && !s.dead; {
		s.flushAgain = false
		fs := s.deferred
		s.deferred = nil
		var conns []*ctrlConn
		for _, f := range fs {
			if !slices.Contains(conns, f.cc) {
				conns = append(conns, f.cc)
			}
		}
		slices.SortFunc(conns, func(a, b *ctrlConn) int {
			if wins(b, a) {
				return -1 // a is worse: the peer used it first
			}
			return 1
		})
		blocked := false
		for _, x := range conns {
			blocked = blocked || s.waits(x)
			for _, f := range fs {
				switch {
				case f.cc != x:
				case blocked || s.dead:
					s.deferred = append(s.deferred, f)
				default:
					x.nDeferred--
					x.release(f.n)
					t.handle(x, f.m)
				}
			}
		}
		again = s.flushAgain
	}
}

func (t *Tier) reader(cc *ctrlConn) {
	var buf []byte
	// Buffered: a small frame usually arrives whole in one read (issue 12).
	r := bufio.NewReaderSize(cc.c, 64<<10)
	for {
		p, err := wire.ReadFrame(r, buf, wire.MaxFrame)
		var m wire.Msg
		if err == nil {
			buf = p
			m, err = wire.Decode(p)
		}
		if err != nil {
			t.post(connClosed{cc, err})
			return
		}
		n := len(p) + frameCost
		if !cc.admit(n) {
			t.post(connClosed{cc, net.ErrClosed})
			return
		}
		t.post(frameReceived{cc, m, n})
	}
}

func (t *Tier) writer(cc *ctrlConn) {
	o := &cc.out
	for {
		o.Lock()
		o.busy = false
		for len(o.frames) == 0 && o.ping == 0 && !o.closed {
			o.cond.Wait()
		}
		frames, ping := o.frames, o.ping
		o.frames, o.bytes, o.ping = nil, 0, 0
		closed := o.closed
		o.busy = true
		o.Unlock()
		if ping != 0 {
			cc.pingOut.Store(ping)
			if err := cc.z.Ping(vllmPingTTL, binary.BigEndian.AppendUint64(nil, ping)); err != nil {
				cc.c.Close()
				t.post(connClosed{cc, err})
				return
			}
		}
		for _, f := range frames {
			var err error
			if cc.z != nil {
				err = cc.z.WriteMessage(f)
			} else {
				_, err = cc.c.Write(f)
			}
			if err != nil {
				cc.c.Close()
				t.post(connClosed{cc, err})
				return
			}
		}
		if closed {
			cc.c.Close()
			return
		}
	}
}

// maxQueued bounds the bytes queued for a control connection's writer: a
// peer that stops reading while it keeps asking is dropped (S8.5). A
// variable so a test can lower it.
var maxQueued = 64 << 20

// queue hands f to the writer; false when the queue is over maxQueued.
// When the writer is idle with nothing queued, the caller first writes f
// itself with one non-blocking write, so a lookup does not wait for the
// writer goroutine to wake (issue 12); what the socket does not take at
// once goes to the writer, which keeps the frames in order.
func (cc *ctrlConn) queue(f []byte) bool {
	cc.out.Lock()
	defer cc.out.Unlock()
	if cc.out.closed {
		return true
	}
	if cc.out.bytes+len(f) > maxQueued {
		return false
	}
	if cc.raw != nil && !cc.out.busy && len(cc.out.frames) == 0 {
		if f = f[tryWrite(cc.raw, f):]; len(f) == 0 {
			return true
		}
	}
	cc.out.frames = append(cc.out.frames, f)
	cc.out.bytes += len(f)
	cc.out.cond.Signal()
	return true
}

// connLost handles a control connection that broke: the session's active
// one ends the session (S6.8); a retiring duplicate only goes away.
func (t *Tier) connLost(cc *ctrlConn, err error) {
	s := cc.s
	if s == nil || s.dead {
		return
	}
	if errors.Is(err, wire.ErrMalformed) && s.v != nil { // on any of a vLLM peer's connections
		t.protocolError(s, fmt.Sprintf("protocol error: %v", err))
		return
	}
	if cc != s.conn {
		t.closeConn(cc)
		return
	}
	if errors.Is(err, wire.ErrMalformed) {
		t.protocolError(s, fmt.Sprintf("protocol error: %v", err))
		return
	}
	t.kill(s, fmt.Sprintf("connection lost: %v", err))
}

// sendNow queues m on the session's active connection. A peer that
// lets maxQueued bytes pile up unread loses its session.
func (t *Tier) sendNow(s *session, m wire.Msg) {
	if s.v != nil {
		t.vsend(s, m)
		return
	}
	if s.conn != nil && !s.conn.queue(wire.Append(nil, m)) {
		t.log.Warn("p2p: peer does not read its control connection; dropping it", "peer", s.peer, "queued_limit", maxQueued)
		t.post(sendQueueFull{s})
	}
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

// deferring keeps f while a connection the peer used before f's has not
// delivered everything, or while earlier frames of f's connection are
// kept (S6.1: what the peer sent first is served first), its bytes still
// counted against its reader's maxUnapplied; false: handle f now.
func (t *Tier) deferring(f frameReceived) bool {
	s := f.cc.s
	if s.dead || (f.cc.nDeferred == 0 && !s.waits(f.cc)) {
		return false
	}
	s.live.Received(t.env.Now())
	if len(s.deferred) >= wire.MaxKeys {
		t.protocolError(s, "too many frames on a new connection while the old one drains")
		return true
	}
	s.deferred = append(s.deferred, f)
	f.cc.nDeferred++
	return true
}

// handle dispatches one message (S6.2). A malformed message or a
// duplicate fetch is a protocol error; five handler errors in a row
// disconnect the session (S8.2).
func (t *Tier) handle(cc *ctrlConn, m wire.Msg) {
	s := cc.s
	if s.dead {
		return
	}
	s.live.Received(t.env.Now())
	var err error
	switch m := m.(type) {
	case wire.Disconnect:
		switch {
		case m.Code == wire.CodeDuplicate:
			cc.peerDone = true
			if cc.retiring {
				t.finishConn(cc) // and serves what waited for it
			}
		default: // on whichever connection: the peer sends it where it ended its session
			t.kill(s, "peer disconnected: "+m.Code.String()+": "+m.Reason[:min(len(m.Reason), protocol.MaxPeerText)])
		}
		return
	case wire.Ping:
		t.sendNow(s, wire.Pong{Seq: m.Seq})
	case wire.Pong:
		s.live.Pong(m)
	case wire.Hello, wire.Challenge, wire.Auth, wire.Connect, wire.ConnectAck:
		err = fmt.Errorf("%w: %v after the handshake", errProtocol, m.Type())
	default:
		err = t.handleRole(s, m)
	}
	t.roleDone(s, err)
}

// roleDone counts a handler's outcome: a protocol error disconnects at
// once, five other errors in a row disconnect (S8.2).
func (t *Tier) roleDone(s *session, err error) {
	switch {
	case err == nil:
		s.errs = 0
	case errors.Is(err, errProtocol) || errors.Is(err, protocol.ErrDuplicateFetch) || errors.Is(err, protocol.ErrMalformed):
		t.protocolError(s, err.Error())
	default:
		s.errs++
		t.warnLimited("p2p: handler error", "peer", s.peer, "err", err, "in_a_row", s.errs)
		if s.errs >= 5 {
			t.protocolErrorCode(s, wire.CodeHandlerErrors, fmt.Sprintf("five handler errors in a row, last: %v", err))
		}
	}
}

var errProtocol = errors.New("protocol error")

func (t *Tier) handleRole(s *session, m wire.Msg) error {
	switch m := m.(type) {
	case wire.Lookup:
		s.prod.Lookup(m, t.env.Now())
		return nil
	case wire.LookupResp:
		err := s.cons.LookupResp(m)
		t.applyCons(s)
		return err
	case wire.Fetch:
		err := s.prod.Fetch(m)
		t.applyProd(s)
		return err
	case wire.TransferDone:
		err := s.cons.TransferDone(m, t.env.Now())
		t.applyCons(s)
		return err
	case wire.AbortFetch:
		s.prod.AbortFetch(m)
		t.applyProd(s)
		return nil
	case wire.AbortAck:
		err := s.cons.AbortAck(m)
		t.applyCons(s)
		return err
	}
	return fmt.Errorf("%w: unexpected %v", errProtocol, m.Type())
}

func (t *Tier) protocolError(s *session, reason string) {
	t.protocolErrorCode(s, wire.CodeProtocol, reason)
}

func (t *Tier) protocolErrorCode(s *session, code wire.Code, reason string) {
	t.st.protocolErrors++
	t.sendNow(s, wire.Disconnect{Code: code, Reason: reason})
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
		t.live.remove(peerID{Node: s.peer, Inc: s.peerInc})
		t.nready.Add(-1)
	}
	conns := append(slices.Clone(s.old), s.conn)
	joined := s.ready // the peer is in the data plane
	if s.v != nil {
		conns = append(conns, s.v.pipes...)
		joined = s.v.gotConnect
	}
	for _, cc := range conns { // closeConn edits s.old and s.v.pipes
		if cc != nil {
			t.closeConn(cc)
		}
	}
	delete(t.sessions, s)
	if t.byNode[s.peer] == s {
		delete(t.byNode, s.peer)
	}
	for a, o := range t.byAddr {
		if o == s {
			delete(t.byAddr, a)
			t.scheduleRedial(a)
		}
	}
	// Consumer side: the requests fail (their lookups now answer Miss),
	// every load fails once the peer can no longer write (S6.8).
	s.cons.Kill(s.peer != "" && joined, t.env.Now())
	t.applyCons(s)
	delete(t.consOf, s.cons) // what arrives for it later carries its session
	// Producer side: every pin fails (writes in flight only report when
	// they end).
	s.prod.Kill()
	t.applyProd(s)
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
	if s.v != nil && !s.ready { // vLLM's handshake: both connects by the deadline
		if !now.Before(s.v.deadline) {
			t.sendNow(s, wire.Disconnect{Code: wire.CodeTimeout, Reason: "handshake timed out"})
			t.kill(s, "handshake timed out")
			return time.Time{}
		}
		return s.v.deadline
	}
	if !s.ready {
		return next // the dialling goroutine's deadlines bound the handshake
	}
	// Retiring duplicates close once both markers passed, or now.
	for _, cc := range slices.Clone(s.old) {
		d := cc.retiredAt.Add(time.Duration(cfg.KeepaliveTimeout))
		if !now.Before(d) {
			t.closeConn(cc)
			continue
		}
		soonest(d)
	}
	// Consumer: the lookup bound (S6.10), load timeout → abort, abort-ack
	// timeout → quarantine (S6.6).
	if d := s.cons.Timeouts(now); !d.IsZero() {
		soonest(d)
	}
	t.applyCons(s)
	// Producer: pins unclaimed after pin_hold are released (S6.5).
	if d := s.prod.Timeouts(now); !d.IsZero() {
		soonest(d)
	}
	t.applyProd(s)
	// Liveness: pings only while work with the peer is outstanding (S6.9).
	ping, dead, d := s.live.Check(now, s.busy())
	switch {
	case dead:
		t.sendNow(s, wire.Disconnect{Code: wire.CodeTimeout, Reason: "keep-alive timed out"})
		t.kill(s, "keep-alive timed out")
		return time.Time{}
	case ping != nil:
		t.sendNow(s, *ping)
	}
	if !d.IsZero() {
		soonest(d)
	}
	return next
}

// busy says whether work with the peer is outstanding.
func (s *session) busy() bool {
	return s.cons.Busy() || s.prod.Busy()
}

// tryWrite writes what of f the socket takes now, without waiting, and
// returns how much that was. A failed write returns 0: the writer meets
// the error again and handles it.
func tryWrite(raw syscall.RawConn, f []byte) int {
	n := 0
	raw.Write(func(fd uintptr) bool {
		if w, err := syscall.Write(int(fd), f); err == nil {
			n = w
		}
		return true // one attempt; never wait here
	})
	return n
}
