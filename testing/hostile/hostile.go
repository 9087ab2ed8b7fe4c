// Package hostile plays the attacker (and the broken peer) against a real
// p2pd's P2P port, for the hardening tests: it speaks kvtier's wire with
// package wire and computes handshake proofs from their description in
// docs/protocol.md — a second implementation written from the document,
// so a test also checks that the document matches the daemon.
package hostile

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// Ident is one process: node id and incarnation.
type Ident struct {
	Node string
	Inc  [16]byte
}

// NewIdent makes a random process identity named node.
func NewIdent(node string) Ident {
	id := Ident{Node: node}
	rand.Read(id.Inc[:])
	return id
}

// Proof is the handshake proof of docs/protocol.md: HMAC-SHA256 under key
// over the transcript, labelled with its direction.
func Proof(key []byte, label string, kind wire.ConnKind, dialer, acceptor Ident, dNonce, aNonce [32]byte) [32]byte {
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
	str(dialer.Node)
	b = append(b, dialer.Inc[:]...)
	str(acceptor.Node)
	b = append(b, acceptor.Inc[:]...)
	str("") // no TLS binding
	m := hmac.New(sha256.New, key)
	m.Write(b)
	var out [32]byte
	copy(out[:], m.Sum(nil))
	return out
}

// Conn is one connection to a P2P port.
type Conn struct {
	net.Conn
	buf []byte
}

// Dial connects to addr with a deadline for everything that follows.
func Dial(addr string, d time.Duration) (*Conn, error) {
	c, err := net.DialTimeout("tcp", addr, d)
	if err != nil {
		return nil, err
	}
	c.SetDeadline(time.Now().Add(d))
	return &Conn{Conn: c}, nil
}

// Send writes one message.
func (c *Conn) Send(m wire.Msg) error {
	var err error
	c.buf, err = wire.Write(c, c.buf, m)
	return err
}

// ReadMsg reads one message (frames up to the handshake bound).
func (c *Conn) ReadMsg() (wire.Msg, error) {
	p, err := wire.ReadFrame(c.Conn, nil, wire.MaxHandshakeFrame)
	if err != nil {
		return nil, err
	}
	return wire.Decode(p)
}

// Hello sends a hello as id and returns the node's challenge.
func (c *Conn) Hello(kind wire.ConnKind, id Ident, nonce [32]byte) (wire.Challenge, error) {
	if err := c.Send(wire.Hello{Version: wire.Version, Kind: kind, NodeID: id.Node, Incarnation: id.Inc, Nonce: nonce}); err != nil {
		return wire.Challenge{}, err
	}
	m, err := c.ReadMsg()
	if err != nil {
		return wire.Challenge{}, err
	}
	ch, ok := m.(wire.Challenge)
	if !ok {
		return wire.Challenge{}, fmt.Errorf("hostile: %v where a challenge was due", m.Type())
	}
	return ch, nil
}

// Probe learns a node's identity from its challenge, as anyone can.
func Probe(addr string) (Ident, error) {
	c, err := Dial(addr, 5*time.Second)
	if err != nil {
		return Ident{}, err
	}
	defer c.Close()
	ch, err := c.Hello(wire.KindControl, NewIdent("probe"), [32]byte{})
	return Ident{ch.NodeID, ch.Incarnation}, err
}

// ErrRejected is a handshake the node refused.
var ErrRejected = errors.New("hostile: rejected")

// Outcome reads what the node sends after a proof until it closes: nil
// if it answered with a proof of its own (the attack got somewhere), else
// ErrRejected wrapping its disconnect code.
func (c *Conn) Outcome() error {
	for {
		m, err := c.ReadMsg()
		if err != nil {
			return fmt.Errorf("%w: connection closed (%v)", ErrRejected, err)
		}
		switch m := m.(type) {
		case wire.Auth:
			return nil
		case wire.Disconnect:
			return fmt.Errorf("%w: %v", ErrRejected, m.Code)
		}
	}
}

// SilentProducer accepts one control connection on l as a cluster member
// holding token and completes the handshake, copying the session
// parameters from the dialler's connect; then it answers pings and
// nothing else, like a producer whose manager hangs. It returns when the
// connection closes.
func SilentProducer(l net.Listener, token string, self Ident) error {
	nc, err := l.Accept()
	if err != nil {
		return err
	}
	c := &Conn{Conn: nc}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	m, err := c.ReadMsg()
	if err != nil {
		return err
	}
	h, ok := m.(wire.Hello)
	if !ok {
		return fmt.Errorf("hostile: %v first", m.Type())
	}
	var nonce [32]byte
	rand.Read(nonce[:])
	if err := c.Send(wire.Challenge{NodeID: self.Node, Incarnation: self.Inc, Nonce: nonce}); err != nil {
		return err
	}
	if _, err := c.ReadMsg(); err != nil { // the dialler's proof: trusted
		return err
	}
	d := Ident{h.NodeID, h.Incarnation}
	if err := c.Send(wire.Auth{Proof: Proof([]byte(token), "acceptor", wire.KindControl, d, self, h.Nonce, nonce)}); err != nil {
		return err
	}
	m, err = c.ReadMsg()
	if err != nil {
		return err
	}
	pc, ok := m.(wire.Connect)
	if !ok {
		return fmt.Errorf("hostile: %v where connect was due", m.Type())
	}
	mine := pc
	mine.NodeID, mine.Incarnation, mine.Addr, mine.DataInfo = self.Node, self.Inc, l.Addr().String(), nil
	if err := c.Send(mine); err != nil {
		return err
	}
	if _, err := c.ReadMsg(); err != nil { // connect_ack
		return err
	}
	c.SetDeadline(time.Time{})
	for {
		m, err := c.ReadMsg()
		if err != nil {
			return nil
		}
		if p, ok := m.(wire.Ping); ok {
			c.Send(wire.Pong{Seq: p.Seq})
		}
	}
}
