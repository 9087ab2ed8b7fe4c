package vllmwire

import (
	"encoding/binary"
	"math"
)

// vLLM's KV events (vllm/distributed/kv_events.py): a PUB socket sends
// each batch as three frames — the topic, an 8-byte big-endian sequence
// number counting batches from 0, and the batch as msgpack — so that a
// router indexing vLLM instances indexes a kvtier node the same way.
// A batch is vLLM's array_like EventBatch, the array [ts, events,
// data_parallel_rank] (as vLLM 0.26 sends it and its consumers — vLLM's
// example subscriber, llm-d's indexer — decode it); an event the map of a
// tagged struct, its "type" first: BlockStored {block_hashes,
// parent_block_hash, token_ids, block_size, lora_id, medium, lora_name},
// BlockRemoved {block_hashes, medium}, AllBlocksCleared {} — fields
// whose value is their default (extra_keys, group_idx, …) omitted, as
// vLLM's encoder does.

// Event kinds of vLLM's KV events.
const (
	BlockStored      = "BlockStored"
	BlockRemoved     = "BlockRemoved"
	AllBlocksCleared = "AllBlocksCleared"
)

// KVEvent is one of a batch's events. Hashes are vLLM's block hashes (32
// bytes each); the batch writes them as vLLM's ExternalBlockHash: the low
// 64 bits as an integer by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES),
// or the bytes.
type KVEvent struct {
	Kind      string
	Hashes    [][]byte
	Parent    []byte   // BlockStored: the hash before the first; nil for a sequence's first block
	TokenIDs  []uint32 // BlockStored
	BlockSize int      // BlockStored: tokens a block
	Medium    string   // "CPU", "DISK"
}

// EncodeEventBatch appends one batch to b.
func EncodeEventBatch(b []byte, ts float64, events []KVEvent, dpRank int, intHashes bool) []byte {
	e := &encoder{b: b}
	hash := func(h []byte) {
		if intHashes {
			e.uint(binary.BigEndian.Uint64(h[len(h)-8:])) // int.from_bytes(h, "big") & (2**64 - 1)
		} else {
			e.bin(h)
		}
	}
	e.arrayHead(3)
	e.b = append(e.b, 0xcb)
	e.b = binary.BigEndian.AppendUint64(e.b, math.Float64bits(ts))
	e.arrayHead(len(events))
	for _, ev := range events {
		switch ev.Kind {
		case BlockStored:
			e.mapHead(8)
		case BlockRemoved:
			e.mapHead(3)
		default:
			e.mapHead(1)
		}
		e.str("type")
		e.str(ev.Kind)
		if ev.Kind == AllBlocksCleared {
			continue
		}
		e.str("block_hashes")
		e.arrayHead(len(ev.Hashes))
		for _, h := range ev.Hashes {
			hash(h)
		}
		if ev.Kind == BlockStored {
			e.str("parent_block_hash")
			if ev.Parent == nil {
				e.b = append(e.b, 0xc0)
			} else {
				hash(ev.Parent)
			}
			e.str("token_ids")
			e.arrayHead(len(ev.TokenIDs))
			for _, t := range ev.TokenIDs {
				e.uint(uint64(t))
			}
			e.str("block_size")
			e.uint(uint64(ev.BlockSize))
			e.str("lora_id")
			e.b = append(e.b, 0xc0)
		}
		e.str("medium")
		e.str(ev.Medium)
		if ev.Kind == BlockStored {
			e.str("lora_name")
			e.b = append(e.b, 0xc0)
		}
	}
	e.uint(uint64(dpRank))
	return e.b
}
