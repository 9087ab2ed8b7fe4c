// Package api holds the request and answer types of p2pd's admin API
// (docs/operations.md, "The admin API"), shared by the daemon and its
// client (ctl, kvctl), so that neither mirrors the other by hand. It uses
// the standard library only and is the one kvtier package ctl imports.
package api

import "time"

// Request is the body of POST /v0/requests: prompt token ids, or a seed
// and a token count that the daemon expands (deterministic prompts for
// tests and demos); kv_transfer_params as vLLM passes them (a
// remote_kv_source names the peer that holds the prefix); kv_digest is
// crc32c (default), sha256 or none.
type Request struct {
	RequestID      string         `json:"request_id,omitempty"`
	PromptTokenIDs []uint32       `json:"prompt_token_ids,omitempty"`
	Seed           *uint64        `json:"seed,omitempty"`
	Tokens         int            `json:"tokens,omitempty"`
	TransferParams map[string]any `json:"kv_transfer_params,omitempty"`
	Digest         string         `json:"kv_digest,omitempty"`
	// FetchOnly loads what the tiers and peers hold of the prompt's
	// prefix and computes nothing: what a cache node does to take a
	// prefix from a vLLM instance (its own engine's stand-in KV must not
	// be served as a model's). The rest is reported as missed.
	FetchOnly bool `json:"fetch_only,omitempty"`
}

// Result answers POST /v0/requests once the request's prefill is done.
type Result struct {
	RequestID string  `json:"request_id"`
	Blocks    int     `json:"blocks"`
	Sources   Sources `json:"sources"`
	KVDigest  string  `json:"kv_digest"`
	ElapsedMS float64 `json:"elapsed_ms"`
}

// Sources counts where a request's blocks came from.
type Sources struct {
	CPU      int `json:"cpu"`
	Disk     int `json:"disk"`
	Peer     int `json:"peer"`
	Computed int `json:"computed"`
	// Missed are blocks a fetch_only request found nowhere (not computed).
	Missed int `json:"missed,omitempty"`
}

// Status answers GET /v0/status.
type Status struct {
	Node     string `json:"node"`
	State    string `json:"state"`
	Requests struct {
		Running int `json:"running"`
		Waiting int `json:"waiting"`
	} `json:"requests"`
	CPUTier struct {
		Slots  int `json:"slots"`
		Used   int `json:"used"`
		Pinned int `json:"pinned"`
	} `json:"cpu_tier"`
	Peers          int    `json:"peers"`
	HasPendingWork bool   `json:"has_pending_work"`
	Poll           string `json:"poll"`
	P2P            string `json:"p2p"`
	// P2PAuth is how peers on the P2P port are authenticated: "token",
	// "tls", "token+tls" or "none" (anyone who reaches the port).
	P2PAuth string `json:"p2p_auth"`
	// P2PDialect is the P2P wire, "kvtier" or "vllm" (vLLM's G2 P2P
	// wire); P2PDataPlane what moves blocks ("tcp", "nixl", or "none":
	// nothing); P2PChecksums whether each block is checked with CRC32C
	// (not on vLLM's wire, which carries no checksum).
	P2PDialect   string `json:"p2p_dialect"`
	P2PDataPlane string `json:"p2p_data_plane"`
	P2PChecksums bool   `json:"p2p_checksums"`
	P2PHealth    Health `json:"p2p_health"`
	Copies       string `json:"copies"`
	// BlockBytes is one block's size, which a peer must match; BlockTokens
	// its tokens; HashAlgo and HashSeed how its keys are computed (a peer
	// or a router with another seed finds nothing).
	BlockBytes  int    `json:"block_bytes"`
	BlockTokens int    `json:"block_tokens"`
	HashAlgo    string `json:"hash_algo"`
	HashSeed    string `json:"hash_seed"`
	// KVEvents is where vLLM-format KV events are published (empty: not),
	// KVEventsSubscribers how many subscribers follow them, and
	// KVEventsAcceptErrors how often accepting one failed (retried).
	KVEvents             string `json:"kv_events,omitempty"`
	KVEventsSubscribers  int    `json:"kv_events_subscribers,omitempty"`
	KVEventsAcceptErrors uint64 `json:"kv_events_accept_errors,omitempty"`
}

// KeysRequest is the body of POST /v0/keys: a prompt, as for a request.
type KeysRequest struct {
	PromptTokenIDs []uint32 `json:"prompt_token_ids,omitempty"`
	Seed           *uint64  `json:"seed,omitempty"`
	Tokens         int      `json:"tokens,omitempty"`
}

// Keys answers POST /v0/keys: the node's block keys for the prompt's full
// blocks, 64 hex digits each, in order.
type Keys struct {
	HashAlgo string   `json:"hash_algo"`
	Keys     []string `json:"keys"`
}

// Health is the P2P port's state: OK unless its accept loop stopped or
// failed in the last 10 s.
type Health struct {
	OK              bool      `json:"ok"`
	Accepting       bool      `json:"accepting"`
	AcceptErrors    uint64    `json:"accept_errors"`
	LastAcceptError string    `json:"last_accept_error,omitempty"`
	LastErrorAt     time.Time `json:"last_accept_error_at,omitzero"`
}

// HealthAnswer answers GET /v0/health: 200 while the node serves, 503
// when its P2P port does not accept.
type HealthAnswer struct {
	OK  bool   `json:"ok"`
	P2P Health `json:"p2p"`
}

// Peers answers GET /v0/peers.
type Peers struct {
	Node  string     `json:"node"`
	P2P   string     `json:"p2p"`
	Peers []PeerInfo `json:"peers"`
}

// PeerInfo is one P2P session.
type PeerInfo struct {
	Node     string `json:"node"`
	Addr     string `json:"addr"`
	Ready    bool   `json:"ready"`
	Dialed   bool   `json:"dialed"`
	Requests int    `json:"requests"`
	Rounds   int    `json:"rounds"`
}

// State answers POST /v0/resume and /v0/shutdown: the engine's state
// after the call.
type State struct {
	State string `json:"state"`
}

// Paused answers POST /v0/pause: the engine's state and how long the
// pause took.
type Paused struct {
	State     string  `json:"state"`
	ElapsedMS float64 `json:"elapsed_ms"`
}

// Scrub answers POST /v0/scrub: the ready CPU blocks checked against
// their checksums, those that disagreed (removed) and those that had
// none kept (now recorded).
type Scrub struct {
	Checked    int     `json:"checked"`
	Mismatched int     `json:"mismatched"`
	Unrecorded int     `json:"unrecorded"`
	ElapsedMS  float64 `json:"elapsed_ms"`
}

// Reset answers POST /v0/reset-cache.
type Reset struct {
	Reset     bool    `json:"reset"`
	ElapsedMS float64 `json:"elapsed_ms"`
}

// Error is the body of every answer other than 200 (and 503 from
// /v0/health, which is a HealthAnswer).
type Error struct {
	Error string `json:"error"`
}

// Event is one line of GET /v0/events (newline-delimited JSON, S2.8):
// blocks a tier stored or removed, a cache reset ("cleared", with the new
// epoch), or a gap ("lost": Lost events after the reader's last were no
// longer held, Seq the last of them; resynchronise from /v0/blocks). Keys
// are 64 lowercase hex digits. A store of a request's prompt blocks
// carries the parent of its first key and the blocks' token ids.
type Event struct {
	Seq      uint64   `json:"seq"`
	Kind     string   `json:"kind"` // stored, removed, cleared, lost
	Tier     string   `json:"tier,omitempty"`
	Keys     []string `json:"keys,omitempty"`
	Parent   string   `json:"parent,omitempty"`
	TokenIDs []uint32 `json:"token_ids,omitempty"`
	Epoch    uint64   `json:"epoch,omitempty"`
	Lost     uint64   `json:"lost,omitempty"`
}

// Blocks answers GET /v0/blocks: one page of the blocks a tier holds, in
// key order. Seq is the last event numbered before the page was read: a
// reader that lists every page and then follows /v0/events?since=Seq of
// the first page holds what the tier holds. Next is the cursor of the
// next page, empty on the last.
type Blocks struct {
	Tier string   `json:"tier"`
	Seq  uint64   `json:"seq"`
	Keys []string `json:"keys"`
	Next string   `json:"next,omitempty"`
}

// Pins answers GET /v0/pins: the CPU tier's pins held at least
// older_than, oldest first (S1.3).
type Pins struct {
	Pins []Pin `json:"pins"`
}

// Pin is one pin: its block, slot, owner (a request id, or "job N" for a
// transfer) and age.
type Pin struct {
	Key      string  `json:"key"`
	Slot     int     `json:"slot"`
	Owner    string  `json:"owner"`
	AgeMS    float64 `json:"age_ms"`
	Detached bool    `json:"detached,omitempty"`
}
