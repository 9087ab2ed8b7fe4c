package p2p

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/crc32c"
)

// node is a manager with a P2P tier.
type node struct {
	m    *offload.Manager
	tier *Tier
}

func tinyConfig(slots int) offload.Config {
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(slots * cfg.Geometry.BlockBytes())
	return cfg
}

func newNode(t testing.TB, n Network, edit func(*Config), slots int) *node {
	t.Helper()
	return newNodeWith(t, n, edit, tinyConfig(slots))
}

// newNodeWith is newNode with the manager's config cfg.
func newNodeWith(t testing.TB, n Network, edit func(*Config), cfg offload.Config) *node {
	t.Helper()
	pc := DefaultConfig()
	pc.Listen = "127.0.0.1:0"
	pc.DataConns = 2
	if edit != nil {
		edit(&pc)
	}
	nd := &node{}
	spec := Spec(pc, cfg, n)
	m, err := offload.New(cfg, spec)
	if err != nil {
		t.Fatal(err)
	}
	nd.m, nd.tier = m, m.Tier(spec.Name).(*Tier)
	t.Cleanup(func() { m.Close() })
	return nd
}

func testKeys(seq, n int) []offload.Key {
	tokens := make([]uint32, 16*n)
	for i := range tokens {
		tokens[i] = uint32(seq*100000 + i)
	}
	return offload.BlockKeys(offload.DefaultHashSeed, 16, tokens)
}

func blockOf(k offload.Key, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = k[i%32] ^ byte(i*7)
	}
	return b
}

// store puts keys into n's CPU tier as a finished request would, each
// block's checksum recorded as its writer does (S7.2), so the producer
// sends the kept one.
func (n *node) store(t testing.TB, keys []offload.Key) {
	t.Helper()
	req := &offload.Request{ID: fmt.Sprintf("writer-%v", keys[0])}
	n.m.Do(func(s *offload.Step) {
		s.OnNewRequest(req)
		p, err := s.PrepareStore(keys, req)
		if err != nil || p == nil {
			t.Fatalf("PrepareStore: %v %v", p, err)
		}
		for i, k := range p.Keys {
			b := blockOf(k, n.m.BlockBytes())
			copy(n.m.Arena().Slot(int(p.Slots[i])), b)
			n.m.Arena().SetSum(int(p.Slots[i]), crc32c.Checksum(b))
		}
		s.CompleteStore(p.Keys, req, true)
		s.OnRequestFinished(req)
	})
}

func source(kvID, addr string) map[string]any {
	host, port := splitAddr(addr)
	return map[string]any{"remote_kv_source": map[string]any{"kv_request_id": kvID, "remote_host": host, "remote_port": port}}
}

func splitAddr(a string) (string, string) {
	for i := len(a) - 1; i >= 0; i-- {
		if a[i] == ':' {
			return a[:i], a[i+1:]
		}
	}
	return a, ""
}

// prefix drives a consumer request the way an engine does: look the keys
// up each step; while the first non-hit is Retry or HitPending, sleep on
// the manager's progress; stop at the first Miss. It returns the answers
// and checks the bytes of the hits.
func (n *node) prefix(t testing.TB, req *offload.Request, keys []offload.Key, wait func() bool) []offload.Result {
	t.Helper()
	var out []offload.Result
	for {
		out = out[:0]
		again := false
		s := n.m.Begin()
		for _, k := range keys {
			r := s.Lookup(k, req)
			out = append(out, r)
			if r != offload.Hit {
				again = r == offload.Retry || r == offload.HitPending
				break
			}
		}
		if !again {
			hits := 0
			for _, r := range out {
				if r == offload.Hit {
					hits++
				}
			}
			if hits > 0 {
				slots, err := s.PrepareLoad(keys[:hits], req)
				if err != nil {
					t.Fatal(err)
				}
				for i, k := range keys[:hits] {
					if !bytes.Equal(n.m.Arena().Slot(int(slots[i])), blockOf(k, n.m.BlockBytes())) {
						t.Errorf("block %v fetched from the peer holds the wrong bytes", k)
					}
				}
				s.CompleteLoad(keys[:hits], req)
			}
			s.OnScheduleEnd()
			return out
		}
		s.OnScheduleEnd()
		if !wait() {
			t.Fatalf("no progress; answers so far %v", out)
		}
	}
}

// fetchFrom runs one consumer request for keys from the peer at addr, the
// way an engine does (prefix), finishes it and returns its answers.
func (n *node) fetchFrom(t testing.TB, kvID, addr string, keys []offload.Key) []offload.Result {
	t.Helper()
	req := &offload.Request{ID: "req-" + kvID, TransferParams: source(kvID, addr)}
	n.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
	got := n.prefix(t, req, keys, realWait(n.m))
	n.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	return got
}

// realWait waits on the progress signal with a real deadline.
func realWait(m *offload.Manager) func() bool {
	return func() bool {
		select {
		case <-m.Progress():
			return true
		case <-time.After(10 * time.Second):
			return false
		}
	}
}

// Two managers on loopback: the consumer fetches the producer's blocks,
// verified byte for byte; a partial hit loads only the hit prefix; both
// sides end with no pins.
func TestFetchLoopback(t *testing.T) {
	prod := newNode(t, nil, nil, 32)
	cons := newNode(t, nil, nil, 32)
	keys := testKeys(1, 6)
	prod.store(t, keys[:4])
	req := &offload.Request{ID: "r1", TransferParams: source("kv-1", prod.tier.Addr())}
	cons.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
	got := cons.prefix(t, req, keys, realWait(cons.m))
	want := []offload.Result{offload.Hit, offload.Hit, offload.Hit, offload.Hit, offload.Miss}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("answers %v, want %v", got, want)
	}
	cons.m.Do(func(s *offload.Step) {
		if src := s.LoadSource(keys[0], req); src != "p2p" {
			t.Errorf("load source %q, want p2p", src)
		}
		s.OnRequestFinished(req)
	})
	waitClean(t, prod)
	waitClean(t, cons)
	if n := cons.m.Metrics().Tiers[1].ReadBytes; n != uint64(4*cons.m.BlockBytes()) {
		t.Errorf("consumer read %d bytes from p2p, want %d", n, 4*cons.m.BlockBytes())
	}
}

// waitClean waits until a node holds no pins and no jobs.
func waitClean(t testing.TB, n *node) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		m := n.m.Metrics()
		if len(n.m.Audit(0)) == 0 && m.Tiers[1].ActiveCascades == 0 && m.Tiers[1].ActivePromotions == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("still busy: pins %v, jobs %+v", n.m.Audit(0), m.Tiers[1])
		}
		select {
		case <-n.m.Progress():
		case <-time.After(10 * time.Millisecond):
		}
	}
}
