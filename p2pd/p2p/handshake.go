package p2p

import (
	"crypto/rand"
	"crypto/tls"
	"errors"
	"net"

	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// The handshake's I/O (S6.1): protocol.Handshake decides every frame
// (docs/security.md has the exchange); run frames them on the connection.
// The caller bounds each handshake with a deadline on the connection.

type (
	peerID      = protocol.PeerID
	rejectError = protocol.Reject
	shaken      = protocol.Shaken
)

// handshaker runs handshakes for one node. Its fields are fixed at start,
// so connection goroutines use it without a lock.
type handshaker struct {
	protocol.Shaker
	// nonces makes a control dialler's nonce; nil means crypto/rand
	// (tests fix it to choose which duplicate wins).
	nonces func() [32]byte
}

func newNonce() (n [32]byte) {
	rand.Read(n[:])
	return n
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

// run carries out h on c until it ends: it writes what h emits and
// reads each frame h is due, no larger than h.Limit. A frame that does not
// decode is h's protocol error, told to the peer; a read or write that
// fails ends the handshake with that error.
func run(c net.Conn, h *protocol.Handshake) error {
	var buf []byte
	flush := func() error {
		for _, m := range h.Take() {
			var err error
			if buf, err = wire.Write(c, buf, m); err != nil {
				return err
			}
		}
		return nil
	}
	for {
		if err := flush(); err != nil && h.Err() == nil {
			return err
		}
		if h.Done() {
			return h.Err()
		}
		p, err := wire.ReadFrame(c, nil, h.Limit())
		var m wire.Msg
		if err == nil {
			m, err = wire.Decode(p)
		}
		switch {
		case errors.Is(err, wire.ErrMalformed):
			h.Malformed(err)
		case err != nil:
			return err
		default:
			h.Receive(m)
		}
	}
}

func (hs *handshaker) nonce() [32]byte {
	if hs.nonces != nil {
		return hs.nonces()
	}
	return newNonce()
}

// dialControl runs the dialler's side of a control handshake on c.
func (hs *handshaker) dialControl(c net.Conn) (shaken, error) {
	h := hs.DialControl(hs.nonce(), func() []byte { return binding(c) })
	if err := run(c, h); err != nil {
		return shaken{}, err
	}
	return h.Result(), nil
}

// acceptControl runs the acceptor's side of a control handshake on c,
// whose Hello the caller read.
func (hs *handshaker) acceptControl(c net.Conn, hello wire.Hello) (shaken, error) {
	h := hs.AcceptControl(hello, newNonce(), func() []byte { return binding(c) })
	if err := run(c, h); err != nil {
		return shaken{}, err
	}
	return h.Result(), nil
}

// dialData authenticates a data connection this node dialled to peer
// (S7.1).
func (hs *handshaker) dialData(c net.Conn, peer peerID) error {
	return run(c, hs.DialData(peer, newNonce(), func() []byte { return binding(c) }))
}

// acceptData authenticates a data connection whose Hello the caller read;
// known says whether this node holds a session with a process, admit
// whether there is room for the connection (protocol.Shaker.AcceptData).
func (hs *handshaker) acceptData(c net.Conn, hello wire.Hello, known func(peerID) bool, admit func() bool) error {
	return run(c, hs.AcceptData(hello, newNonce(), known(peerID{Node: hello.NodeID, Inc: hello.Incarnation}), func() []byte { return binding(c) }, admit))
}
