package vllmwire

import (
	"slices"
	"unicode/utf8"
)

// Message types of vLLM's G2 wire.
const (
	TypeConnect      = "connect"
	TypeConnectAck   = "connect_ack"
	TypeDisconnect   = "disconnect"
	TypeLookup       = "lookup"
	TypeLookupResp   = "lookup_resp"
	TypeFetch        = "fetch"
	TypeTransferDone = "transfer_done"
	TypeAbortFetch   = "abort_fetch"
	TypeAbortAck     = "abort_ack"
)

// Bounds of a message (those vLLM's hardened revision states; G2 states
// none, and its messages stay well inside them).
const (
	MaxList     = 65536    // items of keys, hits, block_indexes
	MaxKey      = 4096     // bytes of one key (G2 sends 36)
	MaxString   = 4096     // bytes of a string field
	MaxMetadata = 64 << 20 // bytes of connect's agent_metadata
	maxFields   = 64       // entries of one message map
	maxDepth    = 8        // nesting of a value skipped (an unknown field's)
)

// Msg is one message: Type says which, and which fields it carries
// (field names as on the wire; the table in shared/reference/vllm-wire.md).
// Keys and AgentMetadata alias the decoded payload.
type Msg struct {
	Type string

	// connect
	PeerID            string // connect, connect_ack
	AgentMetadata     []byte
	BaseAddr          uint64
	NumBlocks         uint64
	BlockLen          uint64
	ConfigFingerprint string // optional: compared only when both sides send one
	HashSeed          string

	// lookup, lookup_resp, fetch, transfer_done, abort_fetch, abort_ack
	KVRequestID  string
	Keys         [][]byte
	RoundSeq     uint64
	Hits         []bool   // lookup_resp, parallel to Keys
	BlockIndexes []uint64 // fetch, parallel to Keys; an empty fetch ends the request
	Success      bool     // transfer_done
}

// field bits: which fields a message had on the wire.
type fields uint16

const (
	fPeerID fields = 1 << iota
	fAgentMetadata
	fBaseAddr
	fNumBlocks
	fBlockLen
	fConfigFingerprint
	fHashSeed
	fKVRequestID
	fKeys
	fRoundSeq
	fHits
	fBlockIndexes
	fSuccess
)

// required are each type's fields (G2's validators).
var required = map[string]fields{
	TypeConnect:      fPeerID | fAgentMetadata | fBaseAddr | fNumBlocks | fBlockLen | fHashSeed,
	TypeConnectAck:   fPeerID,
	TypeDisconnect:   0,
	TypeLookup:       fKVRequestID | fKeys | fRoundSeq,
	TypeLookupResp:   fKVRequestID | fKeys | fHits,
	TypeFetch:        fKVRequestID | fKeys | fBlockIndexes | fRoundSeq,
	TypeTransferDone: fKVRequestID | fSuccess | fRoundSeq,
	TypeAbortFetch:   fKVRequestID | fRoundSeq,
	TypeAbortAck:     fKVRequestID | fRoundSeq,
}

// Encode appends m as one msgpack map to b: the fields its type carries,
// keys and metadata as bin, integers in their shortest form.
func Encode(b []byte, m Msg) []byte {
	e := &encoder{b: b}
	want := required[m.Type]
	if m.Type == TypeConnect && m.ConfigFingerprint != "" {
		want |= fConfigFingerprint
	}
	n := 1
	for f := want; f != 0; f &= f - 1 {
		n++
	}
	e.mapHead(n)
	e.str("type")
	e.str(m.Type)
	put := func(f fields, name string, write func()) {
		if want&f != 0 {
			e.str(name)
			write()
		}
	}
	put(fPeerID, "peer_id", func() { e.str(m.PeerID) })
	put(fAgentMetadata, "agent_metadata", func() { e.bin(m.AgentMetadata) })
	put(fBaseAddr, "base_addr", func() { e.uint(m.BaseAddr) })
	put(fNumBlocks, "num_blocks", func() { e.uint(m.NumBlocks) })
	put(fBlockLen, "block_len", func() { e.uint(m.BlockLen) })
	put(fConfigFingerprint, "config_fingerprint", func() { e.str(m.ConfigFingerprint) })
	put(fHashSeed, "hash_seed", func() { e.str(m.HashSeed) })
	put(fKVRequestID, "kv_request_id", func() { e.str(m.KVRequestID) })
	put(fKeys, "keys", func() {
		e.arrayHead(len(m.Keys))
		for _, k := range m.Keys {
			e.bin(k)
		}
	})
	put(fHits, "hits", func() {
		e.arrayHead(len(m.Hits))
		for _, h := range m.Hits {
			e.boolean(h)
		}
	})
	put(fBlockIndexes, "block_indexes", func() {
		e.arrayHead(len(m.BlockIndexes))
		for _, i := range m.BlockIndexes {
			e.uint(i)
		}
	})
	put(fRoundSeq, "round_seq", func() { e.uint(m.RoundSeq) })
	put(fSuccess, "success", func() { e.boolean(m.Success) })
	return e.b
}

// Decode reads one message: a map with a known "type" and every field
// that type requires, of the right msgpack types and within the bounds;
// fields it does not know are skipped, as vLLM does. An unknown type is
// returned with only Type set (vLLM logs and ignores it). Keys and
// AgentMetadata alias p.
func Decode(p []byte) (Msg, error) {
	d := &decoder{b: p}
	n, err := d.mapHead()
	if err != nil {
		return Msg{}, err
	}
	if n > maxFields {
		return Msg{}, malformed("a map of %d fields", n)
	}
	var m Msg
	var have fields
	seen := make([]string, 0, n)
	for range n {
		name, err := d.str(MaxString)
		if err != nil {
			return Msg{}, err
		}
		if slices.Contains(seen, name) {
			return Msg{}, malformed("field %q twice", name)
		}
		seen = append(seen, name)
		if err := m.field(d, name, &have); err != nil {
			return Msg{}, err
		}
	}
	if len(d.b) != 0 {
		return Msg{}, malformed("%d bytes after the message", len(d.b))
	}
	want, known := required[m.Type]
	switch {
	case m.Type == "":
		return Msg{}, malformed("no type")
	case !known:
		return Msg{Type: m.Type}, nil
	case have&want != want:
		return Msg{}, malformed("%s without %s", m.Type, missing(want&^have))
	}
	switch m.Type {
	case TypeConnect:
		if m.NumBlocks == 0 || m.BlockLen == 0 {
			return Msg{}, malformed("connect with num_blocks %d, block_len %d: both must be positive", m.NumBlocks, m.BlockLen)
		}
	case TypeLookupResp:
		if len(m.Hits) != len(m.Keys) {
			return Msg{}, malformed("%d hits for %d keys", len(m.Hits), len(m.Keys))
		}
	case TypeFetch:
		if len(m.BlockIndexes) != len(m.Keys) {
			return Msg{}, malformed("%d block indexes for %d keys", len(m.BlockIndexes), len(m.Keys))
		}
	}
	return m, nil
}

var fieldNames = []string{"peer_id", "agent_metadata", "base_addr", "num_blocks", "block_len", "config_fingerprint",
	"hash_seed", "kv_request_id", "keys", "round_seq", "hits", "block_indexes", "success"}

func missing(f fields) string {
	for i, name := range fieldNames {
		if f&(1<<i) != 0 {
			return name
		}
	}
	return "?"
}

// field reads the value of the field name into m.
func (m *Msg) field(d *decoder, name string, have *fields) error {
	var err error
	mark := func(f fields) { *have |= f }
	switch name {
	case "type":
		m.Type, err = d.str(MaxString)
	case "peer_id":
		m.PeerID, err = d.text()
		mark(fPeerID)
	case "agent_metadata":
		m.AgentMetadata, err = d.bin(MaxMetadata)
		mark(fAgentMetadata)
	case "base_addr":
		m.BaseAddr, err = d.uint()
		mark(fBaseAddr)
	case "num_blocks":
		m.NumBlocks, err = d.uint()
		mark(fNumBlocks)
	case "block_len":
		m.BlockLen, err = d.uint()
		mark(fBlockLen)
	case "config_fingerprint":
		m.ConfigFingerprint, err = d.str(MaxString)
		mark(fConfigFingerprint)
	case "hash_seed":
		m.HashSeed, err = d.str(MaxString)
		mark(fHashSeed)
	case "kv_request_id":
		m.KVRequestID, err = d.text()
		mark(fKVRequestID)
	case "round_seq":
		m.RoundSeq, err = d.uint()
		mark(fRoundSeq)
	case "success":
		m.Success, err = d.boolean()
		mark(fSuccess)
	case "keys":
		var n int
		if n, err = d.arrayHead(MaxList); err == nil {
			// grown as items are read: a count claims nothing (review)
			m.Keys = make([][]byte, 0, min(n, 64))
			for range n {
				var k []byte
				if k, err = d.bin(MaxKey); err != nil {
					break
				}
				m.Keys = append(m.Keys, k)
			}
		}
		mark(fKeys)
	case "hits":
		var n int
		if n, err = d.arrayHead(MaxList); err == nil {
			m.Hits = make([]bool, n)
			for i := range m.Hits {
				if m.Hits[i], err = d.boolean(); err != nil {
					break
				}
			}
		}
		mark(fHits)
	case "block_indexes":
		var n int
		if n, err = d.arrayHead(MaxList); err == nil {
			m.BlockIndexes = make([]uint64, 0, min(n, 64))
			for range n {
				var i uint64
				if i, err = d.uint(); err != nil {
					break
				}
				m.BlockIndexes = append(m.BlockIndexes, i)
			}
		}
		mark(fBlockIndexes)
	default:
		err = d.skip(maxDepth)
	}
	if err != nil {
		return malformed("%s: %v", name, err)
	}
	return nil
}

// text reads a non-empty UTF-8 string of at most MaxString bytes (ids).
func (d *decoder) text() (string, error) {
	s, err := d.str(MaxString)
	switch {
	case err != nil:
		return "", err
	case s == "" || !utf8.ValidString(s):
		return "", malformed("an empty or invalid UTF-8 string")
	}
	return s, nil
}
