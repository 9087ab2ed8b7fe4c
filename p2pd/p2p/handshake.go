package p2p

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// The handshake (S6.1, docs/security.md). Every connection to the P2P
// port opens with the dialler's Hello (its id, incarnation and nonce) and
// the acceptor's Challenge (the same of its own). Then:
//
//   - control: the dialler sends Auth with its proof; the acceptor verifies
//     it before it answers with its own proof; the dialler verifies that.
//     Only then does either side read a frame larger than 64 KiB: the
//     dialler's Connect, the acceptor's Connect (sent only once it
//     validated the dialler's), the dialler's ConnectAck.
//   - data: the same two proofs, under the session key of the two
//     processes instead of the token; then blocks flow.
//
// A proof is HMAC-SHA256 over the transcript — both nonces, both node
// ids and incarnations, the connection kind, and, over TLS, keying
// material exported from the TLS session — and a label naming its
// direction, so no proof answers any other connection, kind or side. The
// acceptor never proves anything before the dialler did, so it cannot be
// used as an oracle for a relay.

// peerID names one process of a peer: its node id and incarnation.
type peerID struct {
	node string
	inc  [16]byte
}

// rejectError is a handshake that failed: Code says why; byPeer says the
// peer rejected us (its text in Text, truncated) rather than we it.
type rejectError struct {
	Code   wire.Code
	byPeer bool
	Text   string
}

func (e *rejectError) Error() string {
	if e.byPeer {
		return fmt.Sprintf("p2p: rejected by the peer (%v): %s", e.Code, e.Text)
	}
	return fmt.Sprintf("p2p: rejecting the peer (%v): %s", e.Code, e.Text)
}

// maxPeerText is how much of a peer's reject text is kept for a log.
const maxPeerText = 200

// shaken is a control handshake that succeeded.
type shaken struct {
	peer      wire.Connect // what the peer said of itself
	dialer    string       // node id of the side that dialled
	dialNonce [32]byte     // the dialler's nonce, the tie-break among one dialler's connections
}

// handshaker runs handshakes for one node. Its fields are fixed at start,
// so connection goroutines use it without a lock.
type handshaker struct {
	self    peerID
	token   []byte
	connect wire.Connect // this node's Connect
	// nonces makes a dialler's nonce; nil means crypto/rand (tests fix it
	// to choose which duplicate wins).
	nonces func() [32]byte
}

func (hs *handshaker) nonce() [32]byte {
	if hs.nonces != nil {
		return hs.nonces()
	}
	return newNonce()
}

func newNonce() (n [32]byte) {
	rand.Read(n[:])
	return n
}

// proof computes a transcript proof under key with a direction label.
func proof(key []byte, label string, kind wire.ConnKind, d, a peerID, dNonce, aNonce [32]byte, binding []byte) [32]byte {
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
	str(d.node)
	b = append(b, d.inc[:]...)
	str(a.node)
	b = append(b, a.inc[:]...)
	str(string(binding))
	m.Write(b)
	var out [32]byte
	copy(out[:], m.Sum(nil))
	return out
}

// sessionKey is the key data connections between two processes prove
// with: derived from the cluster token and both processes' identities,
// the same on both sides whichever control connection authenticated them.
func sessionKey(token []byte, a, b peerID) []byte {
	if a.node > b.node || (a.node == b.node && bytes.Compare(a.inc[:], b.inc[:]) > 0) {
		a, b = b, a
	}
	var zero [32]byte
	k := proof(token, "session key", wire.KindData, a, b, zero, zero, nil)
	return k[:]
}

// binding is the channel binding of c: keying material exported from its
// TLS session, or nothing on plain TCP.
func binding(c net.Conn) []byte {
	tc, ok := c.(interface{ ConnectionState() tls.ConnectionState })
	if !ok {
		return nil
	}
	st := tc.ConnectionState()
	km, err := st.ExportKeyingMaterial("EXPORTER-kvtier-p2p", nil, 32)
	if err != nil {
		return nil
	}
	return km
}

// conn frames one handshake's reads and writes.
type hsConn struct {
	c   net.Conn
	buf []byte
}

func (h *hsConn) write(m wire.Msg) error {
	var err error
	h.buf, err = wire.Write(h.c, h.buf, m)
	return err
}

// read reads one frame of at most limit bytes; a Disconnect becomes the
// peer's rejectError.
func (h *hsConn) read(limit int) (wire.Msg, error) {
	p, err := wire.ReadFrame(h.c, nil, limit)
	if err != nil {
		return nil, err
	}
	m, err := wire.Decode(p)
	if err != nil {
		return nil, err
	}
	if d, ok := m.(wire.Disconnect); ok {
		text := d.Reason
		if len(text) > maxPeerText {
			text = text[:maxPeerText]
		}
		return nil, &rejectError{Code: d.Code, byPeer: true, Text: text}
	}
	return m, nil
}

// reject tells the peer why (best effort) and returns the error.
func (h *hsConn) reject(code wire.Code, format string, args ...any) error {
	e := &rejectError{Code: code, Text: fmt.Sprintf(format, args...)}
	h.write(wire.Disconnect{Code: code, Reason: e.Text})
	return e
}

// expect reads a message of type M, else rejects it as a protocol error.
func expectMsg[M wire.Msg](h *hsConn, limit int) (M, error) {
	var zero M
	m, err := h.read(limit)
	if err != nil {
		var re *rejectError
		if errors.Is(err, wire.ErrMalformed) {
			return zero, h.reject(wire.CodeProtocol, "%v", err)
		} else if errors.As(err, &re) {
			return zero, err
		}
		return zero, err
	}
	v, ok := m.(M)
	if !ok {
		return zero, h.reject(wire.CodeProtocol, "%v where %v was due", m.Type(), zero.Type())
	}
	return v, nil
}

// check validates the peer's Connect against this node (S6.1).
func (hs *handshaker) check(h *hsConn, want peerID, m wire.Connect) error {
	self := hs.connect
	switch {
	case m.NodeID != want.node || m.Incarnation != want.inc:
		return h.reject(wire.CodeProtocol, "connect names another process than the hello")
	case m.Version != wire.Version:
		return h.reject(wire.CodeVersion, "protocol version %d, want %d", m.Version, wire.Version)
	case m.BlockBytes != self.BlockBytes:
		return h.reject(wire.CodeBlockSize, "block size %d, want %d", m.BlockBytes, self.BlockBytes)
	case m.HashSeed != self.HashSeed:
		return h.reject(wire.CodeHashSeed, "hash seed differs")
	case m.Fingerprint != self.Fingerprint:
		return h.reject(wire.CodeFingerprint, "config fingerprint differs")
	case m.DataPlane != self.DataPlane:
		return h.reject(wire.CodeDataPlane, "data plane %q, want %q", m.DataPlane, self.DataPlane)
	}
	return nil
}

// verify checks a proof; without a token every proof passes (the node
// warned at start that its port is unauthenticated).
func (hs *handshaker) verify(got, want [32]byte) bool {
	return len(hs.token) == 0 || hmac.Equal(got[:], want[:])
}

// dialControl runs the dialler's side of a control handshake on c. The
// caller bounds it with a deadline on c.
func (hs *handshaker) dialControl(c net.Conn) (shaken, error) {
	h := &hsConn{c: c}
	nonce := hs.nonce()
	if err := h.write(wire.Hello{Version: wire.Version, Kind: wire.KindControl, NodeID: hs.self.node,
		Incarnation: hs.self.inc, Nonce: nonce}); err != nil {
		return shaken{}, err
	}
	ch, err := expectMsg[wire.Challenge](h, wire.MaxPreAuthFrame)
	if err != nil {
		return shaken{}, err
	}
	peer := peerID{ch.NodeID, ch.Incarnation}
	if peer.node == hs.self.node {
		return shaken{}, h.reject(wire.CodeSelf, "same node id as this node")
	}
	bind := binding(c)
	if err := h.write(wire.Auth{Proof: hs.controlProof("dialer", hs.self, peer, nonce, ch.Nonce, bind)}); err != nil {
		return shaken{}, err
	}
	a, err := expectMsg[wire.Auth](h, wire.MaxPreAuthFrame)
	if err != nil {
		return shaken{}, err
	}
	if !hs.verify(a.Proof, hs.controlProof("acceptor", hs.self, peer, nonce, ch.Nonce, bind)) {
		return shaken{}, h.reject(wire.CodeAuth, "the acceptor's proof failed")
	}
	if err := h.write(hs.connect); err != nil {
		return shaken{}, err
	}
	pc, err := expectMsg[wire.Connect](h, wire.MaxHandshakeFrame)
	if err != nil {
		return shaken{}, err
	}
	if err := hs.check(h, peer, pc); err != nil {
		return shaken{}, err
	}
	if err := h.write(wire.ConnectAck{}); err != nil {
		return shaken{}, err
	}
	return shaken{peer: pc, dialer: hs.self.node, dialNonce: nonce}, nil
}

// acceptControl runs the acceptor's side of a control handshake on c,
// whose Hello the caller read. The caller bounds it with a deadline.
func (hs *handshaker) acceptControl(c net.Conn, hello wire.Hello) (shaken, error) {
	h := &hsConn{c: c}
	peer := peerID{hello.NodeID, hello.Incarnation}
	if peer.node == hs.self.node {
		return shaken{}, h.reject(wire.CodeSelf, "same node id as this node")
	}
	nonce := newNonce()
	if err := h.write(wire.Challenge{NodeID: hs.self.node, Incarnation: hs.self.inc, Nonce: nonce}); err != nil {
		return shaken{}, err
	}
	a, err := expectMsg[wire.Auth](h, wire.MaxPreAuthFrame)
	if err != nil {
		return shaken{}, err
	}
	bind := binding(c)
	if !hs.verify(a.Proof, hs.controlProof("dialer", peer, hs.self, hello.Nonce, nonce, bind)) {
		return shaken{}, h.reject(wire.CodeAuth, "cluster token proof failed")
	}
	if err := h.write(wire.Auth{Proof: hs.controlProof("acceptor", peer, hs.self, hello.Nonce, nonce, bind)}); err != nil {
		return shaken{}, err
	}
	pc, err := expectMsg[wire.Connect](h, wire.MaxHandshakeFrame)
	if err != nil {
		return shaken{}, err
	}
	if err := hs.check(h, peer, pc); err != nil {
		return shaken{}, err
	}
	if err := h.write(hs.connect); err != nil {
		return shaken{}, err
	}
	if _, err := expectMsg[wire.ConnectAck](h, wire.MaxPreAuthFrame); err != nil {
		return shaken{}, err
	}
	return shaken{peer: pc, dialer: peer.node, dialNonce: hello.Nonce}, nil
}

func (hs *handshaker) controlProof(label string, d, a peerID, dNonce, aNonce [32]byte, bind []byte) [32]byte {
	if len(hs.token) == 0 {
		return [32]byte{}
	}
	return proof(hs.token, label, wire.KindControl, d, a, dNonce, aNonce, bind)
}

// dialData authenticates a data connection this node dialled to peer
// (S7.1): both sides prove they hold the session key of the two
// processes; the acceptor proves only after the dialler did.
func (hs *handshaker) dialData(c net.Conn, peer peerID) error {
	h := &hsConn{c: c}
	nonce := newNonce()
	if err := h.write(wire.Hello{Version: wire.Version, Kind: wire.KindData, NodeID: hs.self.node,
		Incarnation: hs.self.inc, Nonce: nonce}); err != nil {
		return err
	}
	ch, err := expectMsg[wire.Challenge](h, wire.MaxPreAuthFrame)
	if err != nil {
		return err
	}
	if (peerID{ch.NodeID, ch.Incarnation}) != peer {
		return h.reject(wire.CodeAuth, "data connection answered by another process")
	}
	key, bind := sessionKey(hs.token, hs.self, peer), binding(c)
	if err := h.write(wire.Auth{Proof: proof(key, "dialer", wire.KindData, hs.self, peer, nonce, ch.Nonce, bind)}); err != nil {
		return err
	}
	a, err := expectMsg[wire.Auth](h, wire.MaxPreAuthFrame)
	if err != nil {
		return err
	}
	if want := proof(key, "acceptor", wire.KindData, hs.self, peer, nonce, ch.Nonce, bind); !hmac.Equal(a.Proof[:], want[:]) {
		return h.reject(wire.CodeAuth, "the data acceptor's proof failed")
	}
	return nil
}

// acceptData authenticates a data connection whose Hello the caller read:
// it must come from a process this node holds a session with (known says
// whether it does), and prove the session key before anything else is
// read from it.
func (hs *handshaker) acceptData(c net.Conn, hello wire.Hello, known func(peerID) bool) error {
	h := &hsConn{c: c}
	peer := peerID{hello.NodeID, hello.Incarnation}
	if !known(peer) {
		return h.reject(wire.CodeAuth, "no session with that process")
	}
	nonce := newNonce()
	if err := h.write(wire.Challenge{NodeID: hs.self.node, Incarnation: hs.self.inc, Nonce: nonce}); err != nil {
		return err
	}
	a, err := expectMsg[wire.Auth](h, wire.MaxPreAuthFrame)
	if err != nil {
		return err
	}
	key, bind := sessionKey(hs.token, peer, hs.self), binding(c)
	if want := proof(key, "dialer", wire.KindData, peer, hs.self, hello.Nonce, nonce, bind); !hmac.Equal(a.Proof[:], want[:]) {
		return h.reject(wire.CodeAuth, "data connection proof failed")
	}
	return h.write(wire.Auth{Proof: proof(key, "acceptor", wire.KindData, peer, hs.self, hello.Nonce, nonce, bind)})
}
