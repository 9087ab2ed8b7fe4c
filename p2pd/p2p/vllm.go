package p2p

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
	"github.com/kvtier/kvtier/p2pd/vllmwire"
	"github.com/kvtier/kvtier/p2pd/wire"
	"github.com/kvtier/kvtier/p2pd/zmtp"
)

// vLLM's dialect (issue 15, docs/vllm.md): the same sessions and protocol
// machines as kvtier's wire, over vLLM's G2 P2P wire.
//
//   - The P2P port is a ZeroMQ ROUTER (ZMTP 3.1, NULL security): each
//     peer's DEALER connects to it with its identity, its "host:port", and
//     sends one msgpack message a frame. The ROUTER never sends.
//   - This node opens one DEALER a peer, with its own "host:port" (the
//     advertised address) as identity, and sends on it only. An unknown
//     identity that sends connect is dialled back at that identity.
//   - A session is keyed by the peer's identity. Both sides send connect
//     (block_len and hash_seed must match; the data plane's region and
//     metadata) and answer the other's with connect_ack; the session is
//     ready once both arrived, within handshake_timeout.
//   - Role messages go through vllmwire.ToWire and FromWire into the
//     machines; lookup_resp carries no round, so it is matched to its
//     lookup by request and keys (vanswered), and dropped when that round
//     is no longer open. Completion is transfer_done alone
//     (ConsumerConfig.DoneCompletes): vLLM's NIXL writes carry no
//     notification and no checksum.
//   - Keep-alive is the Liveness machine's, as ZMTP PING/PONG on the
//     DEALER; a PING from the peer is answered on the connection it came
//     on (zmtp.Conn does it).
//
// Nothing on this wire is authenticated: cluster_token and TLS do not
// apply (Config.Validate), and status says so. An identity whose host is
// an IP address must connect from it (vsource).

// vstate is what a vLLM session has beyond a kvtier one.
type vstate struct {
	pipes      []*ctrlConn // the peer's DEALER connections to this node's ROUTER
	connPipe   *ctrlConn   // the pipe whose connect the session took
	gotConnect bool        // the peer's connect was taken (its region is in the data plane)
	gotAck     bool        // the peer took this node's connect
	sentConn   bool        // this node's connect is queued on its DEALER
	pre        [][]byte    // session messages before the DEALER connected
	preBytes   int         // their bytes, bounded by maxQueued
	deadline   time.Time   // the handshake's bound
	// asked are the lookups sent and not answered, oldest first (at most
	// vllmMaxAsked): G2's lookup_resp names no round, so an answer is
	// matched to the lookup of its request with the same keys. Two such
	// lookups are never out at once (the peer may answer them in either
	// order, and their answers look alike): a second waits in waiting
	// (at most vllmMaxAsked) until the first is answered or forgotten.
	asked   []vlookup
	waiting []vwaiting
	// heir is the next session of the identity, made while this one's
	// DEALER dial was in flight (Tier.vdials): the dial's end is its.
	heir *session
	// writes maps a round being written to its data-plane write id: vLLM's
	// round numbers are the consumer's, per request (PD rounds are all 0),
	// while the data plane keys writes by peer and one number.
	writes map[protocol.RoundID]uint64
}

// vlookup is a lookup sent on vLLM's wire: its request, round, and a
// digest of its keys.
type vlookup struct {
	kvID  string
	round uint64
	keys  [sha256.Size]byte
}

// vwaiting is a lookup held back while one of its request with the same
// keys is out.
type vwaiting struct {
	m   wire.Lookup
	sum [sha256.Size]byte
}

func keysDigest(ks []wire.Key) [sha256.Size]byte {
	h := sha256.New()
	for _, k := range ks {
		h.Write(k[:])
	}
	return [sha256.Size]byte(h.Sum(nil))
}

const (
	// vllmMaxAsked bounds a session's unanswered lookups remembered for
	// matching answers (asked); beyond it the oldest is forgotten, and its
	// answer, if it comes, is dropped (its keys then miss at lookup_timeout).
	vllmMaxAsked = 1024
	// vllmMaxBlocks bounds a peer's num_blocks: the data plane prepares a
	// descriptor for each, under the manager lock (NIXL took 135 – 200 ms
	// for 4 Mi here, found in review; 1 Mi slots of 1.75 MiB are 1.75 TiB).
	vllmMaxBlocks = 1 << 20
	// vllmMaxMsg bounds one message on vLLM's wire: a lookup or fetch of
	// vllmwire.MaxList keys takes under 4 MiB, a connect's NIXL metadata
	// a few KiB.
	vllmMaxMsg = 8 << 20
	// vllmMaxPipes bounds the connections one peer identity holds to the
	// ROUTER (a DEALER reconnects on its own); a newer one closes the oldest.
	vllmMaxPipes = 4
)

// vllmLocalID checks that addr (the value of key) can be this node's
// vLLM identity: a host:port that peers dial back, so not an unspecified
// address.
func vllmLocalID(key, addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%w: %s: %q is not host:port, which a node's identity on vLLM's wire is: %v", ErrConfig, key, addr, err)
	}
	if ip, err := netip.ParseAddr(host); host == "" || (err == nil && ip.IsUnspecified()) {
		return fmt.Errorf("%w: %s: %q names no host vLLM peers can dial back: give this node's routable host:port, e.g. 10.0.0.5:5710", ErrConfig, key, addr)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("%w: %s: %q has no port vLLM peers can dial", ErrConfig, key, addr)
	}
	return nil
}

// vllmPeerID checks a peer's ZMTP identity: its dialable host:port.
func vllmPeerID(id []byte) (string, error) {
	s := string(id)
	host, port, err := net.SplitHostPort(s)
	n, perr := strconv.Atoi(port)
	if err != nil || host == "" || perr != nil || n < 1 || n > 65535 || !wire.PrintableID(s) {
		return "", fmt.Errorf("%w: a vLLM peer's identity %q is not its host:port", wire.ErrMalformed, id)
	}
	return s, nil
}

// vsource checks a connection's claim to a vLLM identity: never this
// node's own (a loop of dialling itself), and, with vllm_source_check, a
// connection from the identity's host — its address when the host is an
// IP address, loopback for localhost (vLLM's default identity) — so a
// stranger elsewhere cannot join or end a peer's session by naming it
// (vLLM's wire has no other proof). Other host names are checked when the
// connection joins a session whose DEALER is up (vjoins). Off for
// multi-homed peers whose connections leave from another address.
func (t *Tier) vsource(c net.Conn, id string) error {
	if id == t.addr {
		return &rejectError{Code: wire.CodeSelf, Text: fmt.Sprintf("a vLLM peer claims this node's identity %s", id)}
	}
	if !t.cfg.VLLMSourceCheck {
		return nil
	}
	host, _, _ := net.SplitHostPort(id)
	got, err := netip.ParseAddr(sourceIP(c))
	if err != nil {
		return nil // not an IP connection (an in-memory test network)
	}
	got = got.Unmap()
	if want, err := netip.ParseAddr(host); err == nil && got != want.Unmap() {
		return &rejectError{Code: wire.CodeAuth, Text: fmt.Sprintf("a connection from %s claims vLLM identity %s", got, id)}
	}
	if isLocalhost(host) && !fromThisHost(c) {
		return &rejectError{Code: wire.CodeAuth, Text: fmt.Sprintf("a connection from %s claims vLLM identity %s", got, id)}
	}
	return nil
}

// fromThisHost says whether c's peer is on this host: a loopback address,
// or this end's own address (a host dialling its own routable address
// leaves from it).
func fromThisHost(c net.Conn) bool {
	remote, err1 := netip.ParseAddr(sourceIP(c))
	local, err2 := netip.ParseAddr(localIP(c))
	if err1 != nil {
		return false
	}
	remote = remote.Unmap()
	return remote.IsLoopback() || (err2 == nil && remote == local.Unmap())
}

// localIP is c's own host address.
func localIP(c net.Conn) string {
	a := c.LocalAddr().String()
	if h, _, err := net.SplitHostPort(a); err == nil {
		return h
	}
	return a
}

// isLocalhost says whether a host name names this host's loopback.
func isLocalhost(host string) bool {
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	return host == "localhost" || strings.HasSuffix(host, ".localhost") || host == "ip6-localhost" || host == "ip6-loopback"
}

// vjoins checks a connection joining the existing session s by name: with
// vllm_source_check and the session's DEALER up, it must come from the
// address that DEALER reached (the identity's host, resolved).
func (t *Tier) vjoins(s *session, cc *ctrlConn) error {
	if !t.cfg.VLLMSourceCheck || s.conn == nil {
		return nil
	}
	want, err1 := netip.ParseAddr(sourceIP(s.conn.c))
	got, err2 := netip.ParseAddr(sourceIP(cc.c))
	if err1 != nil || err2 != nil || want.Unmap() == got.Unmap() {
		return nil
	}
	if fromThisHost(s.conn.c) && fromThisHost(cc.c) { // one host by other addresses (127.0.1.1, ::1, its own IP)
		return nil
	}
	return &rejectError{Code: wire.CodeAuth, Text: fmt.Sprintf("a connection from %s claims vLLM identity %s, whose host is %s", got, s.peer, want)}
}

// serveZMTP runs the ROUTER's side of an accepted connection: the ZMTP
// handshake and the first message, both within handshake_timeout, before
// the connection reaches the session layer.
func (t *Tier) serveZMTP(c net.Conn) {
	defer t.untilClose(c)()
	t.shakeDeadline(c, time.Now().Add(time.Duration(t.cfg.HandshakeTimeout)))
	z, err := zmtp.Handshake(c, zmtp.Router, nil, vllmMaxMsg)
	var id string
	if err == nil {
		id, err = vllmPeerID(z.PeerIdentity())
	}
	if err == nil {
		err = t.vsource(c, id)
	}
	var first vllmwire.Msg
	if err == nil {
		first, _, err = t.vread(z)
	}
	if err != nil {
		t.handshakeFailed(c, err)
		c.Close()
		return
	}
	c.SetDeadline(time.Time{})
	cc := newZConn(c, z)
	cc.dialer = id
	t.post(vpipe{cc, first})
}

func newZConn(c net.Conn, z *zmtp.Conn) *ctrlConn {
	cc := newCtrlConn(c)
	cc.z = z
	return cc
}

// vread reads the next message of one frame; a message of more frames is
// dropped, as vLLM's ROUTER drops it. A payload that is not a vLLM
// message is wire.ErrMalformed.
func (t *Tier) vread(z *zmtp.Conn) (m vllmwire.Msg, n int, err error) {
	for {
		parts, err := z.ReadMessage()
		if err != nil {
			return vllmwire.Msg{}, 0, err
		}
		if len(parts) != 1 {
			t.warnLimited("p2p: dropping a vLLM message of more than one frame", "frames", len(parts))
			continue
		}
		m, err := vllmwire.Decode(parts[0])
		if err != nil {
			return m, 0, fmt.Errorf("%w: %w", wire.ErrMalformed, err)
		}
		return m, len(parts[0]), nil
	}
}

// vpipeReader reads a peer's DEALER connection until it ends; it closes
// the connection (nothing is written on it but PONGs).
func (t *Tier) vpipeReader(cc *ctrlConn) {
	defer cc.c.Close()
	for {
		m, n, err := t.vread(cc.z)
		if err == nil && !cc.admit(n+frameCost) {
			err = net.ErrClosed
		}
		if err != nil {
			t.post(connClosed{cc, err})
			return
		}
		t.post(vframe{cc, m, n + frameCost})
	}
}

// vdealerReader reads this node's DEALER: vLLM's ROUTER sends nothing on
// it but heartbeats (answered inside ReadMessage), so a message is
// dropped; its end ends the session (vLLM's EVENT_DISCONNECTED).
func (t *Tier) vdealerReader(cc *ctrlConn) {
	for {
		if _, err := cc.z.ReadMessage(); err != nil {
			t.post(connClosed{cc, err})
			return
		}
	}
}

// vdial starts a vLLM session to the peer whose identity is id.
func (t *Tier) vdial(id string) *session {
	if s := t.byNode[id]; s != nil && !s.dead {
		return s
	}
	if id == t.addr { // this node: a session that ends at once, its requests recompute
		s := t.newSession(true, id)
		s.v = &vstate{writes: map[protocol.RoundID]uint64{}}
		t.kill(s, "that is this node's own identity")
		return s
	}
	s := t.vnewSession(true, id, nil)
	if r := t.redial[id]; r != nil {
		r.at = time.Time{}
	}
	return s
}

// vnewSession makes the session of peer id on dealer, this node's DEALER
// to it; with none, it dials one — unless a dial to id is in flight for
// an ended session: its end is handed over (vdialled), since a second
// connection of this node's identity could be refused by the peer's
// ROUTER while the first lingers.
func (t *Tier) vnewSession(dialed bool, id string, dealer *ctrlConn) *session {
	s := t.newSession(dialed, id)
	s.v = &vstate{deadline: t.env.Now().Add(time.Duration(t.cfg.HandshakeTimeout)), writes: map[protocol.RoundID]uint64{}}
	s.peer, s.peerAddr = id, id
	s.prod.Peer, s.cons.Peer = id, id
	t.byNode[id] = s
	if o := t.byAddr[id]; o == nil || o.dead {
		t.byAddr[id] = s
	}
	t.armBy(s.v.deadline)
	if dealer != nil {
		dealer.out.Lock() // the ended session's frames are not the new one's: the peer sees connect first
		dealer.out.frames, dealer.out.bytes, dealer.out.ping = nil, 0, 0
		dealer.out.Unlock()
		dealer.s, s.conn = s, dealer
		t.vsendMsg(s, t.vconnectMsg())
		s.v.sentConn = true
		return s
	}
	if d := t.vdials[id]; d != nil {
		for d.v.heir != nil {
			d = d.v.heir
		}
		d.v.heir = s
		return s
	}
	t.vdials[id] = s
	t.wg.Go(func() {
		deadline := time.Now().Add(time.Duration(t.cfg.HandshakeTimeout))
		ctx, cancel := context.WithDeadline(t.stop, deadline)
		defer cancel()
		c, err := t.net.Dial(ctx, id)
		var cc *ctrlConn
		if err == nil {
			defer t.untilClose(c)()
			t.shakeDeadline(c, deadline)
			var z *zmtp.Conn
			if z, err = zmtp.Handshake(c, zmtp.Dealer, []byte(t.addr), vllmMaxMsg); err != nil {
				t.handshakeFailed(c, err)
				c.Close()
			} else {
				c.SetDeadline(time.Time{})
				cc = newZConn(c, z)
				cc.dialer = t.addr
			}
		}
		t.post(vdialled{s, cc, err})
	})
	return s
}

// vdialled takes this node's DEALER to the session's peer: connect goes
// first, then what waited for the connection.
func (t *Tier) vdialled(s *session, cc *ctrlConn, err error) {
	if t.vdials[s.peer] == s {
		delete(t.vdials, s.peer)
	}
	h := s
	for h.dead && h.v.heir != nil { // sessions made meanwhile chain: the newest takes it
		h = h.v.heir
	}
	if h != s && !h.dead && h.conn == nil {
		s = h // the session that took over waits for this dial
	}
	switch {
	case err != nil:
		t.kill(s, fmt.Sprintf("dialling %s: %v", s.peer, err))
		return
	case s.dead || t.closed:
		cc.c.Close()
		return
	}
	cc.s = s
	s.conn = cc
	cc.z.OnPong(func(ctx []byte) {
		if seq, ok := cc.answers(ctx); ok {
			t.post(vpong{cc, seq})
		}
	})
	t.wg.Go(func() { t.writer(cc) })
	t.wg.Go(func() { t.vdealerReader(cc) })
	t.vsendMsg(s, t.vconnectMsg())
	s.v.sentConn = true
	pre := s.v.pre
	s.v.pre, s.v.preBytes = nil, 0
	for _, f := range pre {
		t.vqueue(s, f)
	}
}

// vconnectMsg is this node's connect: its identity, the data plane's
// region (base, slots, slot bytes) and metadata, and the hash seed.
func (t *Tier) vconnectMsg() vllmwire.Msg {
	m := vllmwire.Msg{Type: vllmwire.TypeConnect, PeerID: t.addr, AgentMetadata: []byte{},
		NumBlocks: uint64(t.env.Arena.Slots()), BlockLen: uint64(t.blockBytes), HashSeed: t.node.HashSeed}
	if r, ok := t.dp.(vllmRegion); ok {
		md, base := r.VLLMRegion()
		m.AgentMetadata, m.BaseAddr = md, uint64(base)
	}
	return m
}

// vllmRegion is a data plane that vLLM peers can write into and read
// from: its metadata and the base of its slots, num_blocks × block_len.
type vllmRegion interface {
	VLLMRegion() (metadata []byte, base uintptr)
}

// vllmInfo is a connect's region as a data plane's peer info (the layout
// NIXLPlane.LocalInfo has): base, stride and slot bytes (block_len:
// vLLM's slots are contiguous), slots, metadata.
func vllmInfo(m vllmwire.Msg) []byte {
	b := binary.LittleEndian.AppendUint64(nil, m.BaseAddr)
	b = binary.LittleEndian.AppendUint64(b, m.BlockLen)
	b = binary.LittleEndian.AppendUint64(b, m.BlockLen)
	b = binary.LittleEndian.AppendUint32(b, uint32(m.NumBlocks))
	return append(b, m.AgentMetadata...)
}

// vattach takes a new connection to the ROUTER and its first message: a
// connect starts a session (and one from a peer whose session already
// took a connect is its restart); anything else joins the session of its
// identity, or, from a stranger, closes the connection.
func (t *Tier) vattach(cc *ctrlConn, m vllmwire.Msg) {
	if t.closed {
		cc.c.Close()
		return
	}
	id := cc.dialer
	s := t.byNode[id]
	if s != nil && !s.dead {
		if err := t.vjoins(s, cc); err != nil {
			t.handshakeFailed(cc.c, err)
			cc.c.Close()
			return
		}
	}
	var dealer *ctrlConn
	var old *session
	if s != nil && m.Type == vllmwire.TypeConnect && s.v.gotConnect {
		// The peer started a new session: the old one ends, and the new
		// one keeps this node's DEALER, which belongs to the identity —
		// closing it and dialling again could reach the peer's ROUTER
		// before the old connection's end, and libzmq refuses a second
		// connection of one identity (vLLM sets no ROUTER_HANDOVER).
		dealer, s.conn = s.conn, nil
		t.kill(s, "the peer connected again (a new session or process)")
		old, s = s, nil
	}
	if s == nil {
		switch {
		case m.Type != vllmwire.TypeConnect:
			t.warnLimited("p2p: a vLLM peer's first message is not connect; closing its connection", "peer", id, "type", m.Type)
			cc.c.Close()
			return
		case old == nil && len(t.sessions) >= t.cfg.MaxSessions: // a restart adds no session
			t.rejects.add(false, wire.CodeCapacity)
			t.warnLimited("p2p: session cap reached; refusing a vLLM peer", "peer", id, "max_sessions", t.cfg.MaxSessions)
			cc.c.Close()
			return
		}
		s = t.vnewSession(false, id, dealer) // if old's DEALER was still dialling, s takes the dial
	}
	cc.s = s
	if len(s.v.pipes) >= vllmMaxPipes {
		t.closeConn(s.v.pipes[0])
	}
	s.v.pipes = append(s.v.pipes, cc)
	t.wg.Go(func() { t.vpipeReader(cc) })
	t.vhandle(cc, m)
}

// vhandle dispatches one message from a peer's DEALER (vLLM's
// session.py rules): a malformed message, a second connect or a role
// message before the handshake is a protocol error; five handler errors
// in a row disconnect; an unknown type is logged and dropped.
func (t *Tier) vhandle(cc *ctrlConn, m vllmwire.Msg) {
	s := cc.s
	if s == nil || s.dead {
		return
	}
	s.live.Received(t.env.Now())
	switch m.Type {
	case vllmwire.TypeConnect:
		if s.v.gotConnect {
			t.protocolError(s, "a second connect")
			return
		}
		t.vconnect(s, cc, m)
		return
	case vllmwire.TypeConnectAck:
		if !s.v.sentConn { // it cannot have seen this node's connect
			t.protocolError(s, "connect_ack before this node's connect")
			return
		}
		s.v.gotAck = true
		t.vready(s)
		return
	case vllmwire.TypeDisconnect:
		t.kill(s, "peer disconnected")
		return
	case vllmwire.TypeLookup, vllmwire.TypeLookupResp, vllmwire.TypeFetch, vllmwire.TypeTransferDone,
		vllmwire.TypeAbortFetch, vllmwire.TypeAbortAck:
	default:
		t.warnLimited("p2p: a vLLM message of unknown type; dropped", "peer", s.peer, "type", m.Type)
		return
	}
	if !s.ready {
		t.protocolError(s, m.Type+" before the handshake")
		return
	}
	wm, err := vllmwire.ToWire(m)
	if err != nil {
		t.protocolError(s, err.Error())
		return
	}
	if lr, ok := wm.(wire.LookupResp); ok { // G2's carries no round: its lookup's
		if lr.Round = t.vanswered(s, lr); lr.Round == 0 {
			s.errs = 0
			return // late: its round was fetched or its request finished
		}
		wm = lr
	}
	t.roleDone(s, t.handleRole(s, wm))
}

// vanswered is the round of the lookup that lr answers — the oldest
// unanswered lookup of its request with the same keys, forgotten now —
// or 0 when that round is no longer the request's open one (or no such
// lookup is remembered): a late answer, which must not count for a later
// round whose lookup the peer has not answered.
func (t *Tier) vanswered(s *session, lr wire.LookupResp) uint64 {
	sum := keysDigest(lr.Keys)
	for i, l := range s.v.asked {
		if l.kvID == lr.ReqID && l.keys == sum {
			t.vforget(s, i)
			if l.round != s.cons.OpenRound(lr.ReqID) {
				return 0
			}
			return l.round
		}
	}
	return 0
}

// vforget drops asked[i], answered, and sends the lookup that waited for
// it, if any: that one leaves now, and its lookup_timeout runs from now
// (S6.10).
func (t *Tier) vforget(s *session, i int) {
	l := s.v.asked[i]
	s.v.asked = slices.Delete(s.v.asked, i, i+1)
	for {
		j := slices.IndexFunc(s.v.waiting, func(w vwaiting) bool { return w.m.ReqID == l.kvID && w.sum == l.keys })
		if j < 0 {
			return
		}
		m := s.v.waiting[j].m
		s.v.waiting = slices.Delete(s.v.waiting, j, j+1)
		if m.Round == s.cons.OpenRound(m.ReqID) { // else its round or request ended: dropped
			s.cons.Sent(m, t.env.Now())
			t.sendNow(s, m)
			return
		}
	}
}

// vforgetOldest drops the oldest unanswered lookup, to keep asked within
// vllmMaxAsked, and the lookups waiting for it: one sent now would take
// the forgotten one's answer, if it came, for its own (G2's answers name
// no round). Their keys miss at lookup_timeout.
func (t *Tier) vforgetOldest(s *session) {
	l := s.v.asked[0]
	s.v.asked = slices.Delete(s.v.asked, 0, 1)
	s.v.waiting = slices.DeleteFunc(s.v.waiting, func(w vwaiting) bool { return w.m.ReqID == l.kvID && w.sum == l.keys })
}

// vconnect takes the peer's connect: block_len and hash_seed must be this
// node's, its region joins the data plane, connect_ack answers.
func (t *Tier) vconnect(s *session, cc *ctrlConn, m vllmwire.Msg) {
	refuse := func(code wire.Code, reason string) {
		t.rejects.add(false, code)
		t.protocolErrorCode(s, code, reason)
	}
	switch {
	case m.BlockLen != uint64(t.blockBytes):
		refuse(wire.CodeBlockSize, fmt.Sprintf("block_len %d, this node's is %d", m.BlockLen, t.blockBytes))
		return
	case m.HashSeed != t.node.HashSeed:
		refuse(wire.CodeHashSeed, fmt.Sprintf("hash_seed %q, this node's is %q", m.HashSeed[:min(len(m.HashSeed), protocol.MaxPeerText)], t.node.HashSeed))
		return
	case m.NumBlocks > vllmMaxBlocks:
		refuse(wire.CodeDataPlane, fmt.Sprintf("num_blocks %d, at most %d", m.NumBlocks, vllmMaxBlocks))
		return
	}
	info := vllmInfo(m)
	if err := t.dp.AddPeer(s.peer, s.peer, info); err != nil {
		refuse(wire.CodeDataPlane, fmt.Sprintf("data plane: %v", err))
		return
	}
	s.peerInfo = info
	s.v.gotConnect, s.v.connPipe = true, cc
	t.vsendMsg(s, vllmwire.Msg{Type: vllmwire.TypeConnectAck, PeerID: t.addr})
	t.vready(s)
}

// vready makes the session ready once both connects were taken.
func (t *Tier) vready(s *session) {
	if s.ready || !s.v.gotConnect || !s.v.gotAck || s.conn == nil {
		return
	}
	s.ready = true
	s.live.Received(t.env.Now())
	t.live.add(peerID{Node: s.peer})
	t.nready.Add(1)
	t.redialed(s)
	t.st.sessionsOpened++
	t.log.Info("p2p: vLLM peer connected", "peer", s.peer, "dialed", s.dialed)
	s.cons.Left(t.env.Now())
	for _, m := range s.held {
		t.sendNow(s, m)
	}
	s.held = nil
}

// vsend sends a machine's frame in vLLM's wire: a ping as a ZMTP PING on
// the DEALER, a role message or disconnect as its vLLM message; what the
// wire has no equivalent of is dropped.
func (t *Tier) vsend(s *session, m wire.Msg) {
	if p, ok := m.(wire.Ping); ok {
		if cc := s.conn; cc != nil {
			cc.pingNow(p.Seq)
		}
		return
	}
	if f, ok := m.(wire.Fetch); ok && len(f.Keys) == 0 { // the request ended: what waited for it goes
		s.v.waiting = slices.DeleteFunc(s.v.waiting, func(w vwaiting) bool { return w.m.ReqID == f.ReqID })
	}
	if l, ok := m.(wire.Lookup); ok {
		sum := keysDigest(l.Keys)
		if slices.ContainsFunc(s.v.asked, func(a vlookup) bool { return a.kvID == l.ReqID && a.keys == sum }) {
			if len(s.v.waiting) >= vllmMaxAsked {
				s.v.waiting = slices.Delete(s.v.waiting, 0, 1) // its keys miss at lookup_timeout
			}
			s.v.waiting = append(s.v.waiting, vwaiting{l, sum})
			return
		}
		for len(s.v.asked) >= vllmMaxAsked {
			t.vforgetOldest(s)
		}
		s.v.asked = append(s.v.asked, vlookup{kvID: l.ReqID, round: l.Round, keys: sum})
	}
	if vm, ok := vllmwire.FromWire(m); ok {
		t.vsendMsg(s, vm)
	}
}

func (t *Tier) vsendMsg(s *session, m vllmwire.Msg) {
	t.vqueue(s, vllmwire.Encode(nil, m))
}

// vqueue queues one encoded message on the DEALER, or until it connects.
func (t *Tier) vqueue(s *session, f []byte) {
	if s.conn == nil {
		if s.v.preBytes+len(f) > maxQueued {
			t.log.Warn("p2p: too much queued for a vLLM peer not connected yet; dropping it", "peer", s.peer, "queued_limit", maxQueued)
			t.post(sendQueueFull{s})
			return
		}
		s.v.pre = append(s.v.pre, f)
		s.v.preBytes += len(f)
		return
	}
	if !s.conn.queue(f) {
		t.log.Warn("p2p: vLLM peer does not read its connection; dropping it", "peer", s.peer, "queued_limit", maxQueued)
		t.post(sendQueueFull{s})
	}
}

// answers says whether a PONG's context answers the PING outstanding on
// cc, and takes it: only then is an event posted, so a peer's
// unsolicited PONGs cost nothing (sequences start at 1: 0 is none).
func (cc *ctrlConn) answers(ctx []byte) (uint64, bool) {
	if len(ctx) != 8 {
		return 0, false
	}
	seq := binary.BigEndian.Uint64(ctx)
	return seq, seq != 0 && cc.pingOut.CompareAndSwap(seq, 0)
}

// pingNow has the writer send a ZMTP PING carrying seq.
func (cc *ctrlConn) pingNow(seq uint64) {
	cc.out.Lock()
	cc.out.ping = seq
	cc.out.cond.Signal()
	cc.out.Unlock()
}

// writeID is the data-plane number of a round's write: kvtier's rounds
// are unique per consumer node already; vLLM's get one of this node's.
func (t *Tier) writeID(s *session, id protocol.RoundID) uint64 {
	if s.v == nil {
		return id.Round
	}
	t.wid++
	s.v.writes[id] = t.wid
	return t.wid
}

// writeOf is the data-plane number of a round being written (0: none).
func (t *Tier) writeOf(s *session, id protocol.RoundID) uint64 {
	if s.v == nil {
		return id.Round
	}
	return s.v.writes[id]
}

// NonePlane moves no blocks: p2p_dialect vllm with data_plane none, for
// testing the control plane. Every write fails; the consumer side looks
// up, and its loads fail at once, unsent (Tier.SubmitLoad).
type NonePlane struct{}

// ErrNoDataPlane is a write on data_plane none.
var ErrNoDataPlane = errors.New("p2p: data_plane none moves no blocks")

func (NonePlane) Name() string                        { return "none" }
func (NonePlane) LocalInfo() []byte                   { return nil }
func (NonePlane) AddPeer(_, _ string, _ []byte) error { return nil }
func (NonePlane) RemovePeer(_ string, done func())    { done() }
func (NonePlane) Write(_ string, _ uint64, _ []SlotPair, done func(error)) {
	done(ErrNoDataPlane)
}
func (NonePlane) Cancel(string, uint64) {}
func (NonePlane) Expect(_ string, _ uint64, _ []uint32, done func(error)) {
	done(ErrNoDataPlane)
}
func (NonePlane) Unexpect(_ string, _ uint64, done func()) { done() }
func (NonePlane) Admit(string) (func(net.Conn), bool)      { return closeData, true }
func (NonePlane) Close() error                             { return nil }
