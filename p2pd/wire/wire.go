// Package wire is kvtier's P2P protocol encoding: length-prefixed frames
// carrying one message each, written and read with the standard library.
// Every field is bounded (SEMANTICS.md S8.1) and decoding never allocates
// more than the frame it decodes allows.
//
// A frame is a 4-byte big-endian length followed by that many bytes; the
// first byte is the message type. Every connection to a node's P2P port
// starts with a Hello frame saying whether it is the control connection or
// a data connection.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Version is the protocol version; peers must match exactly.
const Version = 1

// Bounds (S8.1).
const (
	MaxFrame          = 16 << 20 // control frames
	MaxHandshakeFrame = 64 << 20 // Connect, which carries data-plane info
	MaxKeys           = 65536    // keys a message
	MaxString         = 4096     // bytes of a string
	KeySize           = 32
)

// ErrMalformed is a frame that breaks the encoding or a bound: a protocol
// error that disconnects the peer.
var ErrMalformed = errors.New("wire: malformed frame")

// Type is a message's type byte.
type Type uint8

// Message types.
const (
	THello Type = iota + 1
	TConnect
	TConnectAck
	TLookup
	TLookupResp
	TFetch
	TTransferDone
	TAbortFetch
	TAbortAck
	TDisconnect
	TPing
	TPong
)

var typeNames = map[Type]string{THello: "hello", TConnect: "connect", TConnectAck: "connect_ack", TLookup: "lookup",
	TLookupResp: "lookup_resp", TFetch: "fetch", TTransferDone: "transfer_done", TAbortFetch: "abort_fetch",
	TAbortAck: "abort_ack", TDisconnect: "disconnect", TPing: "ping", TPong: "pong"}

func (t Type) String() string {
	if n, ok := typeNames[t]; ok {
		return n
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// Key is a block key.
type Key = [KeySize]byte

// ConnKind says what a connection carries.
type ConnKind uint8

// Connection kinds.
const (
	KindControl ConnKind = 1
	KindData    ConnKind = 2
)

// Msg is a message.
type Msg interface{ Type() Type }

// Hello opens every connection.
type Hello struct {
	Version     uint16
	Kind        ConnKind
	NodeID      string
	Incarnation [16]byte
}

// Connect is the handshake (S6.1), sent by both sides of a control
// connection.
type Connect struct {
	NodeID      string
	Incarnation [16]byte
	Version     uint16
	BlockBytes  uint64
	Fingerprint string
	HashSeed    string
	// Addr is where this node's P2P port can be reached.
	Addr string
	// DataPlane names the data plane; DataInfo is its opaque local info.
	DataPlane string
	DataInfo  []byte
	// Nonce is the challenge the peer's ConnectAck must answer.
	Nonce [32]byte
}

// ConnectAck accepts the peer's Connect; Proof is HMAC-SHA256 of the
// peer's nonce under the cluster token (zero without a token).
type ConnectAck struct{ Proof [32]byte }

// Lookup asks a producer which keys it can serve for a round.
type Lookup struct {
	ReqID string
	Round uint64
	Keys  []Key
}

// LookupResp answers one Lookup: Hits is parallel to Keys.
type LookupResp struct {
	ReqID string
	Round uint64
	Keys  []Key
	Hits  []bool
}

// Fetch asks the producer to write Keys into the consumer's Slots.
// An empty Fetch is terminal: it releases the request's state.
type Fetch struct {
	ReqID string
	Round uint64
	Keys  []Key
	Slots []uint32
}

// TransferDone ends a round on the producer's side.
type TransferDone struct {
	ReqID string
	Round uint64
	OK    bool
}

// AbortFetch asks the producer to stop writing a round.
type AbortFetch struct {
	ReqID string
	Round uint64
}

// AbortAck says the producer stopped writing a round.
type AbortAck struct {
	ReqID string
	Round uint64
}

// Disconnect says goodbye, or why the peer is rejected.
type Disconnect struct{ Reason string }

// Ping and Pong check liveness while work is outstanding (S6.9).
type (
	Ping struct{ Seq uint64 }
	Pong struct{ Seq uint64 }
)

func (Hello) Type() Type        { return THello }
func (Connect) Type() Type      { return TConnect }
func (ConnectAck) Type() Type   { return TConnectAck }
func (Lookup) Type() Type       { return TLookup }
func (LookupResp) Type() Type   { return TLookupResp }
func (Fetch) Type() Type        { return TFetch }
func (TransferDone) Type() Type { return TTransferDone }
func (AbortFetch) Type() Type   { return TAbortFetch }
func (AbortAck) Type() Type     { return TAbortAck }
func (Disconnect) Type() Type   { return TDisconnect }
func (Ping) Type() Type         { return TPing }
func (Pong) Type() Type         { return TPong }

// DataHeader precedes each block on a data connection; Len bytes of
// block follow, then the block's CRC32C (Castagnoli) as 4 bytes, so both
// sides checksum the bytes chunk by chunk while they are in cache.
type DataHeader struct {
	Round uint64
	Slot  uint32
	Len   uint32
}

// DataHeaderSize is the encoded size of a DataHeader; DataTrailerSize
// that of the CRC32C after the block.
const (
	DataHeaderSize  = 16
	DataTrailerSize = 4
)

// PutDataHeader encodes h into b (DataHeaderSize bytes).
func PutDataHeader(b []byte, h DataHeader) {
	binary.BigEndian.PutUint64(b[0:], h.Round)
	binary.BigEndian.PutUint32(b[8:], h.Slot)
	binary.BigEndian.PutUint32(b[12:], h.Len)
}

// ReadDataHeader reads one DataHeader.
func ReadDataHeader(r io.Reader) (DataHeader, error) {
	var b [DataHeaderSize]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return DataHeader{}, err
	}
	return DataHeader{Round: binary.BigEndian.Uint64(b[0:]), Slot: binary.BigEndian.Uint32(b[8:]),
		Len: binary.BigEndian.Uint32(b[12:])}, nil
}
