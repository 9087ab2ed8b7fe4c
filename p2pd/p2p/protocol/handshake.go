package protocol

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// The handshake (S6.1, docs/security.md) as a machine: one Handshake per
// connection and side, fed the peer's frames (Receive) and emitting the
// frames to send (Take); its I/O layer reads each frame no larger than
// Limit, under a deadline of its own. Every connection to the P2P port
// opens with the dialler's Hello (its id, incarnation and nonce) and the
// acceptor's Challenge (the same of its own). Then:
//
//   - control: the dialler sends Auth with its proof; the acceptor verifies
//     it before it answers with its own proof; the dialler verifies that.
//     Only then does either side accept a frame larger than 64 KiB: the
//     dialler's Connect, the acceptor's Connect (sent only once it
//     validated the dialler's), the dialler's ConnectAck.
//   - data: the same two proofs, under the session key of the two
//     processes instead of the token; then blocks flow.
//
// A proof is HMAC-SHA256 over the transcript — both nonces, both node
// ids and incarnations, the connection kind, and, over TLS, keying
// material exported from the TLS session (the channel binding) — and a
// label naming its direction, so no proof answers any other connection,
// kind or side. The acceptor never proves anything before the dialler
// did, so it cannot be used as an oracle for a relay.

// PeerID names one process of a node: its node id and incarnation.
type PeerID struct {
	Node string
	Inc  [16]byte
}

// Reject is a handshake that failed: Code says why; ByPeer says the peer
// rejected us (its text in Text, truncated to MaxPeerText) rather than we
// it. When we reject, the machine's last frame to send is the Disconnect
// that tells the peer.
type Reject struct {
	Code   wire.Code
	ByPeer bool
	Text   string
}

func (e *Reject) Error() string {
	if e.ByPeer {
		return fmt.Sprintf("p2p: rejected by the peer (%v): %s", e.Code, e.Text)
	}
	return fmt.Sprintf("p2p: rejecting the peer (%v): %s", e.Code, e.Text)
}

// MaxPeerText is how much of a peer's reject text is kept for a log.
const MaxPeerText = 200

// Shaken is a control handshake that succeeded.
type Shaken struct {
	Peer      wire.Connect // what the peer said of itself
	Dialer    string       // node id of the side that dialled
	DialNonce [32]byte     // the dialler's nonce, the tie-break among one dialler's connections
}

// Shaker holds what every handshake of one node needs; it is fixed at the
// start, so connection goroutines share it without a lock.
type Shaker struct {
	Self    PeerID
	Token   []byte       // the cluster token; empty: every control proof passes
	Connect wire.Connect // this node's Connect
}

// Proof computes a transcript proof under key with a direction label.
func Proof(key []byte, label string, kind wire.ConnKind, d, a PeerID, dNonce, aNonce [32]byte, binding []byte) [32]byte {
	m := hmac.New(sha256.New, key)
	var b []byte
	str := func(s string) {
		b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
		b = append(b, s...)
	}
	str("kvtier-p2p/2")
	str(label)
	b = append(b, byte(kind))
	b = append(b, dNonce[:]...)
	b = append(b, aNonce[:]...)
	str(d.Node)
	b = append(b, d.Inc[:]...)
	str(a.Node)
	b = append(b, a.Inc[:]...)
	str(string(binding))
	m.Write(b)
	var out [32]byte
	copy(out[:], m.Sum(nil))
	return out
}

// SessionKey is the key data connections between two processes prove
// with: derived from the cluster token and both processes' identities,
// the same on both sides whichever control connection authenticated them.
func SessionKey(token []byte, a, b PeerID) []byte {
	if a.Node > b.Node || (a.Node == b.Node && bytes.Compare(a.Inc[:], b.Inc[:]) > 0) {
		a, b = b, a
	}
	var zero [32]byte
	k := Proof(token, "session key", wire.KindData, a, b, zero, zero, nil)
	return k[:]
}

// ControlProof is a control connection's proof under the cluster token:
// zero without a token (such a node warned at start that its port is
// unauthenticated).
func (s *Shaker) ControlProof(label string, d, a PeerID, dNonce, aNonce [32]byte, bind []byte) [32]byte {
	if len(s.Token) == 0 {
		return [32]byte{}
	}
	return Proof(s.Token, label, wire.KindControl, d, a, dNonce, aNonce, bind)
}

// hsWait is what a handshake waits for next.
type hsWait uint8

const (
	waitChallenge hsWait = iota
	waitAuth
	waitConnect
	waitAck
	shakeDone
	shakeFailed
)

// Handshake is one side of one connection's handshake.
type Handshake struct {
	s      *Shaker
	kind   wire.ConnKind
	dialer bool
	wait   hsWait
	err    error

	nonce     [32]byte // ours
	peerNonce [32]byte
	peer      PeerID        // the other process: known from its Hello or Challenge
	want      PeerID        // a data dial: the process it must reach
	bind      func() []byte // the channel binding, asked once the peer's first frame arrived
	binding   []byte
	admit     func() bool // a data acceptor: room for the connection, asked once the dialler proved itself
	result    Shaken
	out       []wire.Msg
}

// DialControl starts the dialler's side of a control handshake with our
// nonce; bind returns the connection's channel binding (nil on plain TCP)
// and is called once the peer's first frame arrived, when a TLS session
// is established.
func (s *Shaker) DialControl(nonce [32]byte, bind func() []byte) *Handshake {
	h := &Handshake{s: s, kind: wire.KindControl, dialer: true, nonce: nonce, bind: bind}
	h.hello()
	return h
}

// DialData starts the dialler's side of a data connection to the process
// peer, which this node holds a session with (S7.1).
func (s *Shaker) DialData(peer PeerID, nonce [32]byte, bind func() []byte) *Handshake {
	h := &Handshake{s: s, kind: wire.KindData, dialer: true, nonce: nonce, want: peer, bind: bind}
	h.hello()
	return h
}

// AcceptControl starts the acceptor's side of a control handshake whose
// Hello the I/O layer read.
func (s *Shaker) AcceptControl(hello wire.Hello, nonce [32]byte, bind func() []byte) *Handshake {
	h := &Handshake{s: s, kind: wire.KindControl, nonce: nonce, bind: bind,
		peer: PeerID{hello.NodeID, hello.Incarnation}, peerNonce: hello.Nonce}
	if h.peer.Node == s.Self.Node {
		h.reject(wire.CodeSelf, "same node id as this node")
		return h
	}
	h.challenge()
	return h
}

// AcceptData starts the acceptor's side of a data connection whose Hello
// the I/O layer read: it must come from a process this node holds a
// session with (known says whether it does), and prove the session key
// before anything else is read from it. Once it did, admit (nil: always)
// says whether this node takes one more of that peer's data connections;
// if not, the dialler is refused with capacity before it sends a block
// (S7.1), instead of having its connection closed unread.
func (s *Shaker) AcceptData(hello wire.Hello, nonce [32]byte, known bool, bind func() []byte, admit func() bool) *Handshake {
	h := &Handshake{s: s, kind: wire.KindData, nonce: nonce, bind: bind, admit: admit,
		peer: PeerID{hello.NodeID, hello.Incarnation}, peerNonce: hello.Nonce}
	if !known {
		h.reject(wire.CodeAuth, "no session with that process")
		return h
	}
	h.challenge()
	return h
}

func (h *Handshake) hello() {
	h.send(wire.Hello{Version: wire.Version, Kind: h.kind, NodeID: h.s.Self.Node, Incarnation: h.s.Self.Inc, Nonce: h.nonce})
	h.wait = waitChallenge
}

func (h *Handshake) challenge() {
	h.send(wire.Challenge{NodeID: h.s.Self.Node, Incarnation: h.s.Self.Inc, Nonce: h.nonce})
	h.wait = waitAuth
}

func (h *Handshake) send(m wire.Msg) { h.out = append(h.out, m) }

// Take returns the frames to send, in order; the slice is the caller's.
func (h *Handshake) Take() []wire.Msg {
	o := h.out
	h.out = nil
	return o
}

// Limit is the largest frame the next read may return: 64 KiB until both
// sides proved themselves (S6.1), a handshake frame's bound after.
func (h *Handshake) Limit() int {
	if h.wait == waitConnect {
		return wire.MaxHandshakeFrame
	}
	return wire.MaxPreAuthFrame
}

// Done says the handshake ended, well or not (Err).
func (h *Handshake) Done() bool { return h.wait >= shakeDone }

// Err is why the handshake failed: a *Reject, ours or the peer's; nil
// while it runs and once it succeeded.
func (h *Handshake) Err() error { return h.err }

// Result is the control handshake's outcome, once Done without Err.
func (h *Handshake) Result() Shaken { return h.result }

// Malformed is a frame that did not decode: a protocol error, told to
// the peer.
func (h *Handshake) Malformed(err error) error {
	if h.Done() {
		return h.err
	}
	return h.reject(wire.CodeProtocol, "%v", err)
}

// reject fails the handshake with our reason and tells the peer.
func (h *Handshake) reject(code wire.Code, format string, args ...any) error {
	e := &Reject{Code: code, Text: fmt.Sprintf(format, args...)}
	h.send(wire.Disconnect{Code: code, Reason: e.Text})
	h.wait, h.err = shakeFailed, e
	return e
}

// ensureBinding reads the channel binding once.
func (h *Handshake) ensureBinding() {
	if h.bind != nil {
		h.binding, h.bind = h.bind(), nil
	}
}

// Receive is the peer's next frame; it returns the handshake's error once
// it failed (Err), nil while it runs or once it succeeded.
func (h *Handshake) Receive(m wire.Msg) error {
	if h.Done() {
		return h.err
	}
	if d, ok := m.(wire.Disconnect); ok {
		text := d.Reason
		if len(text) > MaxPeerText {
			text = text[:MaxPeerText]
		}
		h.wait, h.err = shakeFailed, &Reject{Code: d.Code, ByPeer: true, Text: text}
		return h.err
	}
	var due wire.Msg
	switch h.wait {
	case waitChallenge:
		if ch, ok := m.(wire.Challenge); ok {
			return h.challenged(ch)
		}
		due = wire.Challenge{}
	case waitAuth:
		if a, ok := m.(wire.Auth); ok {
			return h.authed(a)
		}
		due = wire.Auth{}
	case waitConnect:
		if c, ok := m.(wire.Connect); ok {
			return h.connected(c)
		}
		due = wire.Connect{}
	case waitAck:
		if _, ok := m.(wire.ConnectAck); ok {
			h.succeed(h.peer.Node, h.peerNonce)
			return nil
		}
		due = wire.ConnectAck{}
	}
	return h.reject(wire.CodeProtocol, "%v where %v was due", m.Type(), due.Type())
}

// challenged, on the dialler: the acceptor named itself; our proof goes
// first.
func (h *Handshake) challenged(ch wire.Challenge) error {
	h.peer, h.peerNonce = PeerID{ch.NodeID, ch.Incarnation}, ch.Nonce
	switch {
	case h.kind == wire.KindControl && h.peer.Node == h.s.Self.Node:
		return h.reject(wire.CodeSelf, "same node id as this node")
	case h.kind == wire.KindData && h.peer != h.want:
		return h.reject(wire.CodeAuth, "data connection answered by another process")
	}
	h.ensureBinding()
	h.send(wire.Auth{Proof: h.proof("dialer")})
	h.wait = waitAuth
	return nil
}

// authed is the other side's proof: on the acceptor the dialler's, which
// it answers with its own only if it holds; on the dialler the acceptor's.
func (h *Handshake) authed(a wire.Auth) error {
	h.ensureBinding()
	if h.dialer {
		if !h.verify(a.Proof, h.proof("acceptor")) {
			if h.kind == wire.KindData {
				return h.reject(wire.CodeAuth, "the data acceptor's proof failed")
			}
			return h.reject(wire.CodeAuth, "the acceptor's proof failed")
		}
		if h.kind == wire.KindData {
			h.wait = shakeDone
			return nil
		}
		h.send(h.s.Connect)
		h.wait = waitConnect
		return nil
	}
	if !h.verify(a.Proof, h.proof("dialer")) {
		if h.kind == wire.KindData {
			return h.reject(wire.CodeAuth, "data connection proof failed")
		}
		return h.reject(wire.CodeAuth, "cluster token proof failed")
	}
	if h.admit != nil && !h.admit() {
		return h.reject(wire.CodeCapacity, "max_data_conns of this peer's data connections are open")
	}
	h.send(wire.Auth{Proof: h.proof("acceptor")})
	if h.kind == wire.KindData {
		h.wait = shakeDone
		return nil
	}
	h.wait = waitConnect
	return nil
}

// connected is the peer's Connect, checked against this node (S6.1): the
// acceptor answers with its own, the dialler acknowledges.
func (h *Handshake) connected(c wire.Connect) error {
	self := h.s.Connect
	switch {
	case c.NodeID != h.peer.Node || c.Incarnation != h.peer.Inc:
		return h.reject(wire.CodeProtocol, "connect names another process than the hello")
	case !wire.PrintableID(c.NodeID):
		return h.reject(wire.CodeProtocol, "node id is not printable UTF-8")
	case c.Version != wire.Version:
		return h.reject(wire.CodeVersion, "protocol version %d, want %d", c.Version, wire.Version)
	case c.BlockBytes != self.BlockBytes:
		return h.reject(wire.CodeBlockSize, "block size %d, want %d", c.BlockBytes, self.BlockBytes)
	case c.HashSeed != self.HashSeed:
		return h.reject(wire.CodeHashSeed, "hash seed differs")
	case c.Fingerprint != self.Fingerprint:
		return h.reject(wire.CodeFingerprint, "config fingerprint differs")
	case c.DataPlane != self.DataPlane:
		return h.reject(wire.CodeDataPlane, "data plane %q, want %q", c.DataPlane, self.DataPlane)
	}
	h.result.Peer = c
	if h.dialer {
		h.send(wire.ConnectAck{})
		h.succeed(h.s.Self.Node, h.nonce)
		return nil
	}
	h.send(self)
	h.wait = waitAck
	return nil
}

func (h *Handshake) succeed(dialer string, dialNonce [32]byte) {
	h.result.Dialer, h.result.DialNonce = dialer, dialNonce
	h.wait = shakeDone
}

// proof is this connection's proof in the direction label: the dialler's
// identity and nonce first whichever side computes it.
func (h *Handshake) proof(label string) [32]byte {
	d, a, dn, an := h.s.Self, h.peer, h.nonce, h.peerNonce
	if !h.dialer {
		d, a, dn, an = a, d, an, dn
	}
	if h.kind == wire.KindData {
		return Proof(SessionKey(h.s.Token, d, a), label, wire.KindData, d, a, dn, an, h.binding)
	}
	return h.s.ControlProof(label, d, a, dn, an, h.binding)
}

// verify checks a proof: a data connection's always, a control one's only
// with a cluster token.
func (h *Handshake) verify(got, want [32]byte) bool {
	if h.kind == wire.KindControl && len(h.s.Token) == 0 {
		return true
	}
	return hmac.Equal(got[:], want[:])
}
