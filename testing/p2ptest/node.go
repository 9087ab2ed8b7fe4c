// Package p2ptest runs P2P nodes in one process over real loopback
// sockets, for end-to-end tests and the B1a benchmark, and injects faults
// into their connections.
package p2ptest

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/p2p"
	"github.com/kvtier/kvtier/testing/pki"
)

// Node is a tiering manager with a P2P tier.
type Node struct {
	M    *offload.Manager
	Tier *p2p.Tier
	// SkipVerify makes Fetch skip the byte-for-byte check (benchmarks
	// check an untimed round instead).
	SkipVerify bool
}

// NewNode starts a node with slots CPU slots of geometry g on loopback;
// n nil means plain TCP. The node closes with t.
func NewNode(t testing.TB, g offload.Geometry, slots int, n p2p.Network, edit func(*p2p.Config)) *Node {
	t.Helper()
	pc := p2p.DefaultConfig()
	pc.Listen = "127.0.0.1:0"
	pc.DataPlane = DataPlane
	if edit != nil {
		edit(&pc)
	}
	cfg := offload.DefaultConfig()
	cfg.Geometry = g
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(slots * offload.SlotStride(g.BlockBytes()))
	nd := &Node{}
	spec := p2p.Spec(pc, cfg, n)
	m, err := offload.New(cfg, spec)
	if err != nil {
		t.Fatal(err)
	}
	nd.M, nd.Tier = m, m.Tier(spec.Name).(*p2p.Tier)
	t.Cleanup(func() { m.Close() })
	return nd
}

// Keys returns n chained keys of sequence seq.
func Keys(seq, n, blockTokens int) []offload.Key {
	tokens := make([]uint32, blockTokens*n)
	for i := range tokens {
		tokens[i] = uint32(seq*1_000_003 + i)
	}
	return offload.BlockKeys(offload.DefaultHashSeed, blockTokens, tokens)
}

// Block returns the bytes stored for k.
func Block(k offload.Key, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = k[i%len(k)] ^ byte(i>>5)
	}
	return b
}

// Store puts keys into the node's CPU tier as a finished request would.
func (n *Node) Store(t testing.TB, keys []offload.Key) {
	t.Helper()
	req := &offload.Request{ID: fmt.Sprintf("writer-%v", keys[0])}
	var err error
	n.M.Do(func(s *offload.Step) {
		s.OnNewRequest(req)
		var p *offload.StorePlan
		if p, err = s.PrepareStore(keys, req); err != nil || p == nil {
			err = fmt.Errorf("PrepareStore: %v %v", p, err)
			return
		}
		for i, k := range p.Keys {
			copy(n.M.Arena().Slot(int(p.Slots[i])), Block(k, n.M.BlockBytes()))
		}
		err = s.CompleteStore(p.Keys, req, true)
		s.OnRequestFinished(req)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Source is kv_transfer_params naming addr as the remote KV source.
func Source(kvID, addr string) map[string]any {
	i := bytes.LastIndexByte([]byte(addr), ':')
	return map[string]any{"remote_kv_source": map[string]any{"kv_request_id": kvID, "remote_host": addr[:i], "remote_port": addr[i+1:]}}
}

// Fetch runs a consumer request for keys from the producer at addr the
// way an engine does, and returns how many leading blocks it loaded; each
// is checked byte for byte (Mismatched counts the bad ones).
func (n *Node) Fetch(t testing.TB, id, addr string, keys []offload.Key) (hits, mismatched int) {
	t.Helper()
	req := &offload.Request{ID: id, TransferParams: Source(id, addr)}
	n.M.Do(func(s *offload.Step) { s.OnNewRequest(req) })
	defer n.M.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	deadline := time.After(60 * time.Second)
	for {
		// Like an engine, the request waits while its prefix is not settled.
		s := n.M.Begin()
		var settled bool
		hits, settled = s.LookupPrefix(keys, req)
		if settled {
			slots, err := s.PrepareLoad(keys[:hits], req)
			if err != nil {
				s.OnScheduleEnd()
				t.Fatal(err)
			}
			for i, k := range keys[:hits] {
				if !n.SkipVerify && !bytes.Equal(n.M.Arena().Slot(int(slots[i])), Block(k, n.M.BlockBytes())) {
					mismatched++
				}
			}
			s.CompleteLoad(keys[:hits], req)
			s.OnScheduleEnd()
			return hits, mismatched
		}
		s.OnScheduleEnd()
		select {
		case <-n.M.Progress():
		case <-deadline:
			t.Fatalf("request %s: no progress for a minute", id)
		}
	}
}

// WaitClean waits until the node holds no pins, no jobs and no reserved
// slots, and fails the test if that does not happen within 10 s.
func (n *Node) WaitClean(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		m := n.M.Metrics()
		if len(n.M.Audit(0)) == 0 && m.Tiers[1].ActiveCascades == 0 && m.Tiers[1].ActivePromotions == 0 && m.CPU.Writing == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("node not clean: pins %v, p2p jobs %d/%d, writing %d", n.M.Audit(0),
				m.Tiers[1].ActivePromotions, m.Tiers[1].ActiveCascades, m.CPU.Writing)
		}
		select {
		case <-n.M.Progress():
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// Stat returns a P2P tier metric of the node.
func (n *Node) Stat(name string) float64 {
	for _, s := range n.M.Metrics().Tiers[1].Stats {
		if s.Name == name {
			return s.Value
		}
	}
	return -1
}

// TLS returns config edits that give each node a certificate of one
// throwaway cluster CA (files in t's temporary directory), turning on the
// P2P tier's mutual TLS.
func TLS(t testing.TB) func(name string) func(*p2p.Config) {
	t.Helper()
	dir := t.TempDir()
	ca, err := pki.NewCA(dir, "kvtier-test-ca")
	if err != nil {
		t.Fatal(err)
	}
	return func(name string) func(*p2p.Config) {
		f, err := ca.Node(name)
		if err != nil {
			t.Fatal(err)
		}
		return func(c *p2p.Config) { c.TLSCert, c.TLSKey, c.TLSCA = f.Cert, f.Key, f.CA }
	}
}
