// Package route is a small KV-cache-aware router, the worked example of
// issue 14: it follows the event streams of N p2pd nodes (GET /v0/events,
// resynchronising from GET /v0/blocks at the start and after a lost
// marker), keeps a prefix index (key → nodes holding it), and for a prompt
// names the node with the longest cached prefix — the remote_kv_source to
// put in a request's kv_transfer_params. It uses the standard library and
// the admin API's client (ctl, p2pd/api) only, and hashes prompts itself
// as S1.1 defines block keys, as a router in any language would.
package route

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/kvtier/kvtier/ctl"
	"github.com/kvtier/kvtier/p2pd/api"
)

// Scheme is how the followed nodes compute block keys; a node whose
// status says otherwise is not followed (its keys would never match).
type Scheme struct {
	Algo        string // "kvtier" or "vllm-sha256-cbor"
	Seed        string
	BlockTokens int
}

// Keys returns the block keys of a prompt, as the nodes compute them:
// kvtier's (S1.1: the root is SHA-256 of "kvtier/root\x00" and the seed;
// a block's key SHA-256 of its parent's key and its token ids as
// little-endian uint32) or vLLM's sha256_cbor (the root SHA-256 of the
// seed as a CBOR text string; a block's SHA-256 of the CBOR array
// [parent, [token ids], null]).
func (s Scheme) Keys(tokens []uint32) []string {
	var parent []byte
	if s.Algo == "vllm-sha256-cbor" {
		root := sha256.Sum256(cborHead(nil, 3, len(s.Seed), s.Seed))
		parent = root[:]
	} else {
		root := sha256.Sum256(append([]byte("kvtier/root\x00"), s.Seed...))
		parent = root[:]
	}
	var keys []string
	for bt := s.BlockTokens; len(tokens) >= bt && bt > 0; tokens = tokens[bt:] {
		h := sha256.New()
		if s.Algo == "vllm-sha256-cbor" {
			b := cborHead([]byte{0x83}, 2, len(parent), string(parent))
			b = cborHead(b, 4, bt, "")
			for _, t := range tokens[:bt] {
				b = cborHead(b, 0, int(t), "")
			}
			h.Write(append(b, 0xf6))
		} else {
			h.Write(parent)
			for _, t := range tokens[:bt] {
				h.Write(binary.LittleEndian.AppendUint32(nil, t))
			}
		}
		parent = h.Sum(nil)
		keys = append(keys, hex.EncodeToString(parent))
	}
	return keys
}

// cborHead appends a canonical CBOR head (major type, the shortest
// argument) and then text.
func cborHead(b []byte, major byte, n int, text string) []byte {
	m := major << 5
	switch u := uint64(n); {
	case u < 24:
		b = append(b, m|byte(u))
	case u <= 0xff:
		b = append(b, m|24, byte(u))
	case u <= 0xffff:
		b = append(b, m|25)
		b = binary.BigEndian.AppendUint16(b, uint16(u))
	default:
		b = append(b, m|26)
		b = binary.BigEndian.AppendUint32(b, uint32(u))
	}
	return append(b, text...)
}

// Keys returns kvtier-scheme keys (Scheme.Keys).
func Keys(seed string, blockTokens int, tokens []uint32) []string {
	return Scheme{Algo: "kvtier", Seed: seed, BlockTokens: blockTokens}.Keys(tokens)
}

// Router follows nodes and answers routes. Its methods are safe for
// concurrent use.
type Router struct {
	scheme Scheme
	log    *slog.Logger

	mu    sync.Mutex
	nodes map[string]*nodeState
	index map[string]map[string]int // key → node → how many of its tiers hold it
}

type nodeState struct {
	p2p    string                         // host:port peers fetch from
	tiers  map[string]map[string]struct{} // tier → keys
	synced bool                           // the snapshot is in
}

// New returns a router for nodes computing keys by scheme.
func New(scheme Scheme, log *slog.Logger) *Router {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if scheme.Algo == "" {
		scheme.Algo = "kvtier"
	}
	return &Router{scheme: scheme, log: log, nodes: map[string]*nodeState{},
		index: map[string]map[string]int{}}
}

// Choice is a route: the node with the longest cached prefix and its
// length in blocks, or no node (Blocks 0).
type Choice struct {
	Node   string `json:"node,omitempty"`
	P2P    string `json:"p2p,omitempty"`
	Blocks int    `json:"blocks"`
	Of     int    `json:"of"` // the prompt's full blocks
}

// RemoteSource is the kv_transfer_params.remote_kv_source naming the
// chosen node, with kvID the id the producer knows the prefix by; nil
// when no node holds any of it.
func (c Choice) RemoteSource(kvID string) map[string]any {
	if c.Blocks == 0 {
		return nil
	}
	host, port, _ := net.SplitHostPort(c.P2P)
	p, _ := strconv.Atoi(port)
	return map[string]any{"kv_request_id": kvID, "remote_host": host, "remote_port": p}
}

// Route answers the node holding the longest prefix of tokens' blocks
// (ties: the first by name), skipping except (the node the request goes
// to, which needs no peer for what it holds).
func (r *Router) Route(tokens []uint32, except string) Choice {
	keys := r.scheme.Keys(tokens)
	r.mu.Lock()
	defer r.mu.Unlock()
	best := Choice{Of: len(keys)}
	for _, name := range slices.Sorted(maps.Keys(r.nodes)) {
		if name == except || !r.nodes[name].synced {
			continue
		}
		n := 0
		for _, k := range keys {
			if r.index[k][name] == 0 {
				break
			}
			n++
		}
		if n > best.Blocks {
			best = Choice{Node: name, P2P: r.nodes[name].p2p, Blocks: n, Of: len(keys)}
		}
	}
	return best
}

// Holds reports how many of keys the node's index has, for tests.
func (r *Router) Holds(node string, keys []string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, k := range keys {
		if r.index[k][node] > 0 {
			n++
		}
	}
	return n
}

// Follow keeps the router's view of one node current until ctx ends: the
// node's status (its P2P address), a snapshot of every tier it lists, then
// its events; a lost marker, a dropped stream or a node that is not up
// yet starts over after retry. It returns ctx's error.
func (r *Router) Follow(ctx context.Context, name string, c *ctl.Client, retry time.Duration) error {
	defer r.forget(name)
	for {
		err := r.followOnce(ctx, name, c)
		r.forget(name) // unfollowed, its view is stale: not routed to until resynchronised
		if ctx.Err() != nil {
			return ctx.Err()
		}
		r.log.Info("route: resynchronising", "node", name, "why", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(retry):
		}
	}
}

var (
	errLost   = errors.New("events lost")
	errScheme = errors.New("another key scheme")
)

func (r *Router) followOnce(ctx context.Context, name string, c *ctl.Client) error {
	st, err := c.Status(ctx)
	if err != nil {
		return err
	}
	if got := (Scheme{Algo: st.HashAlgo, Seed: st.HashSeed, BlockTokens: st.BlockTokens}); got != r.scheme {
		// its keys would never match the router's: a silent 0 % hit rate
		return fmt.Errorf("%w: the node computes keys as %+v, the router as %+v", errScheme, got, r.scheme)
	}
	snap := map[string]map[string]struct{}{}
	var since uint64
	for i, tier := range []string{"cpu", "disk"} {
		keys, seq, err := c.AllBlocks(ctx, tier)
		var ae *ctl.APIError
		if errors.As(err, &ae) && ae.Code == 400 && tier != "cpu" {
			continue // the node has no such tier
		} else if err != nil {
			return err
		}
		if i == 0 {
			since = seq // the events after the first page apply over every page
		}
		set := make(map[string]struct{}, len(keys))
		for _, k := range keys {
			set[k] = struct{}{}
		}
		snap[tier] = set
	}
	r.replace(name, st.P2P, snap)
	return c.Events(ctx, &since, true, func(e api.Event) error {
		if e.Kind == "lost" {
			return fmt.Errorf("%w: %d after event %d", errLost, e.Lost, e.Seq-e.Lost)
		}
		r.apply(name, e)
		return nil
	})
}

// replace installs a node's snapshot.
func (r *Router) replace(name, p2p string, snap map[string]map[string]struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.dropLocked(name)
	n := &nodeState{p2p: p2p, tiers: map[string]map[string]struct{}{}, synced: true}
	r.nodes[name] = n
	for tier, keys := range snap {
		for k := range keys {
			r.addLocked(n, name, tier, k)
		}
	}
}

func (r *Router) forget(name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.dropLocked(name)
	delete(r.nodes, name)
}

func (r *Router) dropLocked(name string) {
	n := r.nodes[name]
	if n == nil {
		return
	}
	for tier, keys := range n.tiers {
		for k := range keys {
			r.removeLocked(n, name, tier, k)
		}
	}
}

func (r *Router) addLocked(n *nodeState, name, tier, k string) {
	t := n.tiers[tier]
	if t == nil {
		t = map[string]struct{}{}
		n.tiers[tier] = t
	}
	if _, ok := t[k]; ok {
		return
	}
	t[k] = struct{}{}
	if r.index[k] == nil {
		r.index[k] = map[string]int{}
	}
	r.index[k][name]++
}

func (r *Router) removeLocked(n *nodeState, name, tier, k string) {
	if _, ok := n.tiers[tier][k]; !ok {
		return
	}
	delete(n.tiers[tier], k)
	if r.index[k][name]--; r.index[k][name] <= 0 {
		delete(r.index[k], name)
		if len(r.index[k]) == 0 {
			delete(r.index, k)
		}
	}
}

// apply is one event of node name.
func (r *Router) apply(name string, e api.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.nodes[name]
	if n == nil {
		return
	}
	switch e.Kind {
	case "stored":
		for _, k := range e.Keys {
			r.addLocked(n, name, e.Tier, k)
		}
	case "removed":
		for _, k := range e.Keys {
			r.removeLocked(n, name, e.Tier, k)
		}
	case "cleared":
		for k := range n.tiers[e.Tier] {
			r.removeLocked(n, name, e.Tier, k)
		}
	}
}
