// Package zmtp speaks ZMTP 3.1 (rfc.zeromq.org/spec/37), the wire of
// ZeroMQ, with the standard library only: the greeting, the NULL
// security handshake with its Socket-Type and Identity properties,
// frames and multipart messages, and the PING/PONG heartbeat — enough to
// be a ROUTER, DEALER or PUB peer of libzmq, which vLLM's P2P control
// plane and KV-events publisher use (docs/vllm.md). The NULL mechanism
// authenticates nothing: every byte is hostile, and every length is
// bounded before anything is allocated for it.
package zmtp

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"time"
)

// ErrProtocol is a peer that broke ZMTP: a bad greeting, handshake or
// frame, a frame over the limit, an incompatible socket type.
var ErrProtocol = errors.New("zmtp: protocol error")

func protoErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

// Socket types this package plays, and the peers each accepts (the
// spec's compatibility table).
const (
	Router = "ROUTER"
	Dealer = "DEALER"
	Pub    = "PUB"
	Sub    = "SUB"
)

var compatible = map[string][]string{
	Router: {"DEALER", "REQ", "ROUTER"},
	Dealer: {"ROUTER", "REP", "DEALER"},
	Pub:    {"SUB", "XSUB"},
	Sub:    {"PUB", "XPUB"},
}

// Limits of what a peer may send before and after the handshake.
const (
	// MaxCommand bounds a command frame (READY and its properties, PING).
	MaxCommand = 64 << 10
	// MaxParts bounds the frames of one message.
	MaxParts = 64
	// MaxIdentity bounds a peer's Identity property (the spec's 255).
	MaxIdentity = 255
)

const (
	flagMore    = 1
	flagLong    = 2
	flagCommand = 4
)

// Conn is one ZMTP connection after the handshake. ReadMessage is for
// one goroutine; WriteMessage and Ping may be called from any.
type Conn struct {
	c        net.Conn
	r        *bufio.Reader
	maxMsg   int
	peerType string
	peerID   []byte

	wmu  sync.Mutex
	wbuf []byte
	// pong is the context of the last PONG received (heartbeats).
	pongMu sync.Mutex
	pong   []byte
	pongAt time.Time
	onPong func(context []byte)
}

// greeting is the 64-byte ZMTP 3.1 greeting with the NULL mechanism.
func greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9] = 0xff, 0x7f
	g[10], g[11] = 3, 1
	copy(g[12:32], "NULL")
	return g
}

// Handshake runs the greeting and the NULL handshake on c as a socket of
// type socketType with identity (nil: none; a DEALER's is its address in
// vLLM), and returns the connection. maxMsg bounds one message's bytes
// (all its frames together). The caller bounds it with a deadline on c.
func Handshake(c net.Conn, socketType string, identity []byte, maxMsg int) (*Conn, error) {
	if compatible[socketType] == nil {
		return nil, fmt.Errorf("zmtp: socket type %q not supported", socketType)
	}
	if len(identity) > MaxIdentity {
		return nil, fmt.Errorf("zmtp: identity of %d bytes, at most %d", len(identity), MaxIdentity)
	}
	rbuf := 64 << 10
	if socketType == Pub {
		rbuf = 4 << 10 // a SUB sends only subscriptions: an idle one costs little
	}
	z := &Conn{c: c, r: bufio.NewReaderSize(c, rbuf), maxMsg: maxMsg}
	if _, err := c.Write(greeting()); err != nil {
		return nil, err
	}
	var g [64]byte
	if _, err := io.ReadFull(z.r, g[:]); err != nil {
		return nil, err
	}
	switch {
	case g[0] != 0xff || g[9]&1 != 1:
		return nil, protoErr("not a ZMTP greeting")
	case g[10] < 3:
		return nil, protoErr("ZMTP %d.%d: 3.0 or later wanted", g[10], g[11])
	case string(bytes.TrimRight(g[12:32], "\x00")) != "NULL":
		return nil, protoErr("security mechanism %q: only NULL is spoken", bytes.TrimRight(g[12:32], "\x00"))
	}
	props := []string{"Socket-Type", socketType}
	if identity != nil {
		props = append(props, "Identity", string(identity))
	}
	if err := z.writeCommand("READY", readyBody(props...)); err != nil {
		return nil, err
	}
	name, body, err := z.readCommand()
	if err != nil {
		return nil, err
	}
	if name == "ERROR" {
		return nil, protoErr("the peer refused: %q", errorReason(body))
	}
	if name != "READY" {
		return nil, protoErr("%s where READY was due", name)
	}
	p, err := parseProperties(body)
	if err != nil {
		return nil, err
	}
	z.peerType = p["socket-type"]
	if !slices.Contains(compatible[socketType], z.peerType) {
		z.writeCommand("ERROR", errorBody("invalid socket type"))
		return nil, protoErr("a %s peer for a %s socket", z.peerType, socketType)
	}
	if id, ok := p["identity"]; ok && id != "" { // libzmq sends an empty one for an anonymous socket
		if len(id) > MaxIdentity {
			return nil, protoErr("identity of %d bytes", len(id))
		}
		z.peerID = []byte(id)
	}
	return z, nil
}

func readyBody(kv ...string) []byte {
	var b []byte
	for i := 0; i+1 < len(kv); i += 2 {
		b = append(b, byte(len(kv[i])))
		b = append(b, kv[i]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(kv[i+1])))
		b = append(b, kv[i+1]...)
	}
	return b
}

func errorBody(reason string) []byte { return append([]byte{byte(len(reason))}, reason...) }

func errorReason(body []byte) string {
	if len(body) == 0 || int(body[0]) > len(body)-1 {
		return ""
	}
	return string(body[1 : 1+body[0]])
}

// parseProperties reads READY's properties; names are case-insensitive.
func parseProperties(b []byte) (map[string]string, error) {
	p := map[string]string{}
	for len(b) > 0 {
		n := int(b[0])
		if 1+n+4 > len(b) {
			return nil, protoErr("a truncated property")
		}
		name := string(bytes.ToLower(b[1 : 1+n]))
		vl := binary.BigEndian.Uint32(b[1+n:])
		b = b[1+n+4:]
		if uint64(vl) > uint64(len(b)) {
			return nil, protoErr("a property value of %d bytes in %d", vl, len(b))
		}
		p[name] = string(b[:vl])
		b = b[vl:]
	}
	return p, nil
}

// PeerType is the peer's Socket-Type.
func (z *Conn) PeerType() string { return z.peerType }

// PeerIdentity is the peer's Identity property, nil when it sent none.
func (z *Conn) PeerIdentity() []byte { return z.peerID }

// Close closes the connection.
func (z *Conn) Close() error { return z.c.Close() }

// NetConn is the underlying connection (deadlines, addresses).
func (z *Conn) NetConn() net.Conn { return z.c }

// frameHead reads a frame's flags and size.
func (z *Conn) frameHead() (flags byte, size uint64, err error) {
	if flags, err = z.r.ReadByte(); err != nil {
		return 0, 0, err
	}
	if flags&^(flagMore|flagLong|flagCommand) != 0 {
		return 0, 0, protoErr("frame flags 0x%02x", flags)
	}
	if flags&flagLong != 0 {
		var b [8]byte
		if _, err := io.ReadFull(z.r, b[:]); err != nil {
			return 0, 0, err
		}
		size = binary.BigEndian.Uint64(b[:])
	} else {
		s, err := z.r.ReadByte()
		if err != nil {
			return 0, 0, err
		}
		size = uint64(s)
	}
	return flags, size, nil
}

// readN reads n bytes, growing the buffer with what arrives rather than
// to what a header claims.
func (z *Conn) readN(n uint64) ([]byte, error) {
	var buf bytes.Buffer
	if _, err := io.CopyN(&buf, z.r, int64(n)); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return buf.Bytes(), nil
}

// readCommand reads one command frame: its name and body.
func (z *Conn) readCommand() (string, []byte, error) {
	flags, size, err := z.frameHead()
	if err != nil {
		return "", nil, err
	}
	if flags&flagCommand == 0 || flags&flagMore != 0 {
		return "", nil, protoErr("a message frame where a command was due")
	}
	return z.commandBody(size)
}

func (z *Conn) commandBody(size uint64) (string, []byte, error) {
	if size > MaxCommand || size == 0 {
		return "", nil, protoErr("a command of %d bytes", size)
	}
	b, err := z.readN(size)
	if err != nil {
		return "", nil, err
	}
	n := int(b[0])
	if 1+n > len(b) {
		return "", nil, protoErr("a truncated command name")
	}
	return string(b[1 : 1+n]), b[1+n:], nil
}

// ReadMessage reads the next message, all its frames. It answers a
// peer's PING with PONG and notes a PONG; a SUBSCRIBE or CANCEL command
// (a ZMTP 3.1 SUB's) is returned as ZMTP 3.0's subscription message, a
// frame of 1 or 0 and the topic; other commands are ignored, as the spec
// allows. A message over maxMsg bytes or MaxParts frames is a
// protocol error (the connection should be closed).
func (z *Conn) ReadMessage() ([][]byte, error) {
	var parts [][]byte
	total := uint64(0)
	for {
		flags, size, err := z.frameHead()
		if err != nil {
			return nil, err
		}
		if flags&flagCommand != 0 {
			if len(parts) > 0 {
				return nil, protoErr("a command inside a multipart message")
			}
			name, body, err := z.commandBody(size)
			if err != nil {
				return nil, err
			}
			if err := z.command(name, body); err != nil {
				return nil, err
			}
			switch name { // ZMTP 3.1 subscriptions, as 3.0's messages
			case "SUBSCRIBE":
				return [][]byte{append([]byte{1}, body...)}, nil
			case "CANCEL":
				return [][]byte{append([]byte{0}, body...)}, nil
			}
			continue
		}
		if size > uint64(z.maxMsg)-total { // not total+size: a huge size would wrap
			return nil, protoErr("a message of more than %d bytes", z.maxMsg)
		}
		total += size
		if len(parts) == MaxParts {
			return nil, protoErr("a message of more than %d frames", MaxParts)
		}
		p, err := z.readN(size)
		if err != nil {
			return nil, err
		}
		parts = append(parts, p)
		if flags&flagMore == 0 {
			return parts, nil
		}
	}
}

func (z *Conn) command(name string, body []byte) error {
	switch name {
	case "PING":
		if len(body) < 2 || len(body) > 2+16 {
			return protoErr("a PING of %d bytes", len(body))
		}
		return z.writeCommand("PONG", body[2:]) // echo its context
	case "PONG":
		if len(body) > 16 { // a PING's context is at most 16 bytes, and so its echo
			return protoErr("a PONG of %d bytes", len(body))
		}
		body = bytes.Clone(body) // not the read buffer, kept for the connection's life
		z.pongMu.Lock()
		z.pong, z.pongAt = body, time.Now()
		f := z.onPong
		z.pongMu.Unlock()
		if f != nil {
			f(body)
		}
	case "ERROR":
		return protoErr("the peer reports %q", errorReason(body))
	}
	return nil // SUBSCRIBE, CANCEL and others: the socket above decides
}

// OnPong has f called with each PONG's context, on the reading
// goroutine (a heartbeat's answer, for a keep-alive above).
func (z *Conn) OnPong(f func(context []byte)) {
	z.pongMu.Lock()
	z.onPong = f
	z.pongMu.Unlock()
}

// LastPong is when the last PONG arrived and its context.
func (z *Conn) LastPong() (time.Time, []byte) {
	z.pongMu.Lock()
	defer z.pongMu.Unlock()
	return z.pongAt, z.pong
}

func appendFrame(b []byte, flags byte, p []byte) []byte {
	if len(p) > 255 {
		b = append(b, flags|flagLong)
		b = binary.BigEndian.AppendUint64(b, uint64(len(p)))
	} else {
		b = append(b, flags, byte(len(p)))
	}
	return append(b, p...)
}

func (z *Conn) writeCommand(name string, body []byte) error {
	cmd := append(append([]byte{byte(len(name))}, name...), body...)
	z.wmu.Lock()
	defer z.wmu.Unlock()
	z.wbuf = appendFrame(z.wbuf[:0], flagCommand, cmd)
	_, err := z.c.Write(z.wbuf)
	return err
}

// WriteMessage sends one message of the given frames.
func (z *Conn) WriteMessage(parts ...[]byte) error {
	if len(parts) == 0 {
		return errors.New("zmtp: a message has at least one frame")
	}
	z.wmu.Lock()
	defer z.wmu.Unlock()
	b := z.wbuf[:0]
	for i, p := range parts {
		var flags byte
		if i < len(parts)-1 {
			flags = flagMore
		}
		b = appendFrame(b, flags, p)
	}
	z.wbuf = b
	_, err := z.c.Write(b)
	if cap(z.wbuf) > 1<<20 {
		z.wbuf = nil // a large message's buffer is not kept
	}
	return err
}

// Ping sends a PING with the given time-to-live (in the spec's tenths of
// a second, at most 6553.5 s) and context (at most 16 bytes).
func (z *Conn) Ping(ttl time.Duration, context []byte) error {
	if len(context) > 16 {
		return errors.New("zmtp: a PING context is at most 16 bytes")
	}
	ds := min(ttl/(100*time.Millisecond), 0xffff)
	return z.writeCommand("PING", append(binary.BigEndian.AppendUint16(nil, uint16(ds)), context...))
}
