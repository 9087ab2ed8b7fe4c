package vllmwire

import (
	"encoding/binary"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// The dialect's edge (issue 15): vLLM's role messages translated to and
// from the kvtier protocol messages that p2pd/p2p/protocol's machines
// take, so that one set of machines serves both wires.
//
//   - A vLLM key is the block hash (32 bytes, kvtier's key when the node
//     computes vLLM's keys: hash_algo vllm-sha256-cbor) and the KV cache
//     group index (4 bytes, big-endian). kvtier has one group: index 0;
//     another index is a protocol error (its blocks are not this node's).
//   - round_seq is the round; block_indexes are the consumer's slots.
//   - G2's lookup_resp carries no round_seq: its Round is 0 here, and the
//     session glue fills in the round of the request's open lookup.
//   - connect, connect_ack and disconnect belong to the session, not the
//     machines: ToWire refuses them.

// KeyLen is the length of a vLLM key: the block hash and the group index.
const KeyLen = wire.KeySize + 4

// ToWire translates a role message from a vLLM peer.
func ToWire(m Msg) (wire.Msg, error) {
	keys, err := toKeys(m.Keys)
	if err != nil {
		return nil, err
	}
	switch m.Type {
	case TypeLookup:
		return wire.Lookup{ReqID: m.KVRequestID, Round: m.RoundSeq, Keys: keys}, nil
	case TypeLookupResp:
		return wire.LookupResp{ReqID: m.KVRequestID, Keys: keys, Hits: m.Hits}, nil
	case TypeFetch:
		slots := make([]uint32, len(m.BlockIndexes))
		for i, b := range m.BlockIndexes {
			if b > 1<<32-1 {
				return nil, malformed("block index %d", b)
			}
			slots[i] = uint32(b)
		}
		return wire.Fetch{ReqID: m.KVRequestID, Round: m.RoundSeq, Keys: keys, Slots: slots}, nil
	case TypeTransferDone:
		return wire.TransferDone{ReqID: m.KVRequestID, Round: m.RoundSeq, OK: m.Success}, nil
	case TypeAbortFetch:
		return wire.AbortFetch{ReqID: m.KVRequestID, Round: m.RoundSeq}, nil
	case TypeAbortAck:
		return wire.AbortAck{ReqID: m.KVRequestID, Round: m.RoundSeq}, nil
	}
	return nil, malformed("%s is not a role message", m.Type)
}

func toKeys(ks [][]byte) ([]wire.Key, error) {
	if ks == nil {
		return nil, nil
	}
	out := make([]wire.Key, len(ks))
	for i, k := range ks {
		if len(k) != KeyLen {
			return nil, malformed("a key of %d bytes, want %d (sha256_cbor block hash and group index)", len(k), KeyLen)
		}
		if g := binary.BigEndian.Uint32(k[wire.KeySize:]); g != 0 {
			return nil, malformed("KV cache group %d: this node holds group 0 only", g)
		}
		out[i] = wire.Key(k[:wire.KeySize])
	}
	return out, nil
}

// FromWire translates a machine's frame for a vLLM peer; false for a
// frame vLLM's wire has no equivalent of (ping, pong: ZMTP heartbeats
// stand for them; the handshake's).
func FromWire(m wire.Msg) (Msg, bool) {
	keys := func(ks []wire.Key) [][]byte {
		out := make([][]byte, len(ks))
		for i, k := range ks {
			out[i] = append(k[:], 0, 0, 0, 0) // group 0
		}
		return out
	}
	switch v := m.(type) {
	case wire.Lookup:
		return Msg{Type: TypeLookup, KVRequestID: v.ReqID, RoundSeq: v.Round, Keys: keys(v.Keys)}, true
	case wire.LookupResp:
		return Msg{Type: TypeLookupResp, KVRequestID: v.ReqID, Keys: keys(v.Keys), Hits: v.Hits}, true
	case wire.Fetch:
		idx := make([]uint64, len(v.Slots))
		for i, s := range v.Slots {
			idx[i] = uint64(s)
		}
		return Msg{Type: TypeFetch, KVRequestID: v.ReqID, RoundSeq: v.Round, Keys: keys(v.Keys), BlockIndexes: idx}, true
	case wire.TransferDone:
		return Msg{Type: TypeTransferDone, KVRequestID: v.ReqID, RoundSeq: v.Round, Success: v.OK}, true
	case wire.AbortFetch:
		return Msg{Type: TypeAbortFetch, KVRequestID: v.ReqID, RoundSeq: v.Round}, true
	case wire.AbortAck:
		return Msg{Type: TypeAbortAck, KVRequestID: v.ReqID, RoundSeq: v.Round}, true
	case wire.Disconnect:
		return Msg{Type: TypeDisconnect}, true // vLLM's carries no reason
	}
	return Msg{}, false
}
