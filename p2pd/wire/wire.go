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
	"unicode/utf8"
)

// Version is the protocol version; peers must match exactly. Version 2
// authenticates before anything large is read (docs/security.md).
const Version = 2

// Bounds (S8.1).
const (
	MaxPreAuthFrame   = 64 << 10 // hello, challenge, auth, and a reject before them
	MaxFrame          = 16 << 20 // control frames after the handshake
	MaxHandshakeFrame = 64 << 20 // Connect, read only once the peer authenticated
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
	TChallenge
	TAuth
)

var typeNames = map[Type]string{THello: "hello", TConnect: "connect", TConnectAck: "connect_ack", TLookup: "lookup",
	TLookupResp: "lookup_resp", TFetch: "fetch", TTransferDone: "transfer_done", TAbortFetch: "abort_fetch",
	TAbortAck: "abort_ack", TDisconnect: "disconnect", TPing: "ping", TPong: "pong", TChallenge: "challenge", TAuth: "auth"}

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

// Hello opens every connection, from the dialler. Nonce is the dialler's
// half of the handshake transcript.
type Hello struct {
	Version     uint16
	Kind        ConnKind
	NodeID      string
	Incarnation [16]byte
	Nonce       [32]byte
}

// Challenge answers a Hello, from the acceptor: its identity and its
// half of the transcript. It proves nothing and reveals no secret.
type Challenge struct {
	NodeID      string
	Incarnation [16]byte
	Nonce       [32]byte
}

// Auth carries a proof over the handshake transcript (docs/security.md):
// the dialler sends its proof first, the acceptor answers with its own
// only after verifying the dialler's. Zero without a cluster token.
type Auth struct{ Proof [32]byte }

// Connect carries the session's parameters (S6.1), sent by both sides of
// a control connection once both authenticated: the dialler first, the
// acceptor only after it validated the dialler's.
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
}

// ConnectAck is the dialler's acceptance of the acceptor's Connect: the
// last handshake message.
type ConnectAck struct{}

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

// Disconnect says goodbye, or why the peer is rejected: Code is one of a
// fixed set (counted and compared), Reason free text (logged truncated,
// never used as a key).
type Disconnect struct {
	Code   Code
	Reason string
}

// Code is why a connection ends.
type Code uint8

// Disconnect codes. A code this version does not know reads as "other"
// (String) and is counted as CodeOther.
const (
	CodeOther         Code = iota // none of the below
	CodeShutdown                  // the node is shutting down
	CodeDuplicate                 // a duplicate connection retires (S6.1): no more frames follow on it
	CodeVersion                   // protocol version differs
	CodeSelf                      // the peer has this node's id
	CodeBlockSize                 // block size differs
	CodeHashSeed                  // hash seed differs
	CodeFingerprint               // config fingerprint differs
	CodeDataPlane                 // data plane differs, or its info was refused
	CodeAuth                      // an authentication proof failed
	CodeProtocol                  // a malformed or unexpected frame
	CodeHandlerErrors             // five handler errors in a row (S8.2)
	CodeCapacity                  // a cap on sessions, handshakes or data connections
	CodeTimeout                   // handshake or keep-alive timed out
	NumCodes
)

var codeNames = [NumCodes]string{"other", "shutdown", "duplicate", "version", "self", "block_size", "hash_seed",
	"fingerprint", "data_plane", "auth", "protocol", "handler_errors", "capacity", "timeout"}

func (c Code) String() string {
	if c < NumCodes {
		return codeNames[c]
	}
	return codeNames[CodeOther]
}

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
func (Challenge) Type() Type    { return TChallenge }
func (Auth) Type() Type         { return TAuth }

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

// PrintableID says whether a node id is printable UTF-8 (no control
// characters): one a log line and a metric label can carry. A peer's id
// that is not is a protocol error at its Connect.
func PrintableID(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return false
		}
	}
	return true
}
