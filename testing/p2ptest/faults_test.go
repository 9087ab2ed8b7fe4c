package p2ptest

import (
	"bytes"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/p2p"
)

var tiny = offload.Geometries["tiny"]

// End to end over real loopback sockets: the consumer fetches 24 blocks
// from the producer, verified byte for byte, and both nodes end clean.
func TestFetchEndToEnd(t *testing.T) {
	prod := NewNode(t, tiny, 64, nil, nil)
	cons := NewNode(t, tiny, 64, nil, nil)
	keys := Keys(1, 24, tiny.BlockTokens)
	prod.Store(t, keys)
	hits, bad := cons.Fetch(t, "kv-1", prod.Tier.Addr(), keys)
	if hits != 24 || bad != 0 {
		t.Errorf("fetched %d blocks, %d wrong; want 24, 0", hits, bad)
	}
	prod.WaitClean(t)
	cons.WaitClean(t)
}

// A static peer list connects at start, by DNS name; a request naming the
// same address reuses that session.
func TestStaticPeers(t *testing.T) {
	a := NewNode(t, tiny, 16, nil, nil)
	_, port, _ := net.SplitHostPort(a.Tier.Addr())
	addr := net.JoinHostPort("localhost", port)
	b := NewNode(t, tiny, 16, nil, func(c *p2p.Config) { c.Peers = []string{addr} })
	deadline := time.Now().Add(10 * time.Second)
	for a.Stat("kv_offload_p2p_sessions") != 1 || b.Stat("kv_offload_p2p_sessions") != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the static peer did not connect")
		}
		select {
		case <-b.M.Progress():
		case <-time.After(5 * time.Millisecond):
		}
	}
	keys := Keys(3, 4, tiny.BlockTokens)
	a.Store(t, keys)
	if hits, bad := b.Fetch(t, "kv-static", addr, keys); hits != 4 || bad != 0 {
		t.Errorf("fetched %d, %d wrong", hits, bad)
	}
	if v := b.Stat("kv_offload_p2p_sessions_opened_total"); v != 1 {
		t.Errorf("sessions opened %v, want 1 (the request reused the static one)", v)
	}
}

// The P2P tier's metrics (and the disk tier's) pass promtool's lint,
// the per-peer histogram included (issue 14): the consumer fetched once.
func TestMetricsLint(t *testing.T) {
	prod, n := NewNode(t, tiny, 8, nil, nil), NewNode(t, tiny, 8, nil, nil)
	keys := Keys(3, 4, tiny.BlockTokens)
	prod.Store(t, keys)
	if hits, bad := n.Fetch(t, "lint", prod.Tier.Addr(), keys); hits != 4 || bad != 0 {
		t.Fatalf("fetch: %d hits, %d mismatched", hits, bad)
	}
	var buf bytes.Buffer
	if err := n.M.Metrics().WritePrometheus(&buf); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`kv_offload_p2p_sessions{tier="p2p"} 1`, `kv_offload_p2p_peer_round_seconds_count{tier="p2p",peer="` + prod.Tier.NodeID() + `"} 1`,
		`kv_offload_p2p_peer_lookups_sent_total{tier="p2p",peer="`, `,le="+Inf"} 1`,
		`kv_offload_p2p_peer_bytes_total{tier="p2p",peer="` + prod.Tier.NodeID() + `",direction="in"} ` + strconv.Itoa(4*tiny.BlockBytes())} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("no %s in the text", want)
		}
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = &buf
	if out, err := cmd.CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("promtool: %v\n%s", err, out)
	}
}
