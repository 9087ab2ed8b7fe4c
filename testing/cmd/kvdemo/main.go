// Command kvdemo is `make demo`: two p2pd processes on loopback with the
// qwen3-0.6b geometry. The producer computes 576 blocks (1,008 MiB) of a
// prompt; the consumer fetches them through the P2P tier; the producer is
// paused (mode=wait, no cache clear); the consumer drops its copy and
// fetches again from the paused producer; digests are compared; both shut
// down. A third act routes with events: three nodes, a prompt computed on
// one, a router (testing/route) that follows their event streams names
// that node as the source of a request sent to another, and the fetch
// comes from the peer. It prints what it measured and exits non-zero if
// anything was wrong.
package main

import (
	"context"
	"flag"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
	"github.com/kvtier/kvtier/p2pd/node"
	"github.com/kvtier/kvtier/testing/daemon"
	"github.com/kvtier/kvtier/testing/route"
)

func main() {
	binDir := flag.String("bin", "bin", "directory with p2pd (make build)")
	blocks := flag.Int("blocks", 576, "blocks in the prompt")
	flag.Parse()
	if err := run(*binDir, *blocks); err != nil {
		fmt.Fprintln(os.Stderr, "kvdemo:", err)
		os.Exit(1)
	}
}

func run(bin string, blocks int) error {
	dir, err := os.MkdirTemp("", "kvdemo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	// The whole prompt is promoted as one 1 GiB batch; a slow machine may
	// need longer than the default 5 s HitPending bound for it.
	prod, err := daemon.Start(dir, bin, "producer", blocks+64, "-hit-pending-timeout", "60s")
	if err != nil {
		return err
	}
	defer prod.Kill()
	cons, err := daemon.Start(dir, bin, "consumer", blocks+64, "-hit-pending-timeout", "60s")
	if err != nil {
		return err
	}
	defer cons.Kill()
	total := float64(blocks * daemon.BlockBytes)
	fmt.Printf("kvdemo: two p2pd on loopback (producer %s, consumer %s), qwen3-0.6b, a prompt of %d blocks (%.0f MiB)\n\n",
		prod.P2P, cons.P2P, blocks, total/(1<<20))

	var failures []string
	check := func(ok bool, what string) {
		if !ok {
			failures = append(failures, what)
		}
	}
	computed, err := prod.Submit(daemon.Prompt(42, blocks, "", ""))
	if err != nil {
		return fmt.Errorf("producer prefill: %w", err)
	}
	check(computed.Sources.Computed == blocks, "the producer computed every block")
	fetch := func(id string) (api.Result, error) { return cons.Submit(daemon.Prompt(42, blocks, id, prod.P2P)) }
	first, err := fetch("demo-1")
	if err != nil {
		return fmt.Errorf("consumer fetch: %w", err)
	}
	check(first.Sources.Peer == blocks && first.KVDigest == computed.KVDigest, "the first fetch came from the peer with the producer's digest")

	// Idle: context switches of the whole producer process over 5 s.
	c0, err := prod.CtxSwitches()
	if err != nil {
		return err
	}
	time.Sleep(5 * time.Second)
	c1, _ := prod.CtxSwitches()
	idleCS := float64(c1-c0) / 5
	rss, beyond := prod.RSS(), prod.RSSBeyondCaches()

	// B2: 20 pauses (mode=wait, no cache clear) of the idle producer, each
	// timed through the admin API; all but the last are resumed.
	var lat []time.Duration
	var paused map[string]any
	for i := range 20 {
		t0 := time.Now()
		err = prod.C.Do(context.Background(), "POST", "/v0/pause", url.Values{"mode": {"wait"}, "clear_cache": {"false"}, "timeout": {"10s"}}, nil, &paused)
		lat = append(lat, time.Since(t0))
		if err != nil {
			return fmt.Errorf("pausing the producer: %w", err)
		}
		if i < 19 {
			if err := prod.C.Do(context.Background(), "POST", "/v0/resume", nil, nil, nil); err != nil {
				return fmt.Errorf("resuming the producer: %w", err)
			}
		}
	}
	slices.Sort(lat)
	if err := cons.C.Do(context.Background(), "POST", "/v0/reset-cache", nil, nil, nil); err != nil {
		return fmt.Errorf("consumer reset-cache: %w", err)
	}
	second, err := fetch("demo-2")
	if err != nil {
		return fmt.Errorf("fetch from the paused producer: %w", err)
	}
	check(second.Sources.Peer == blocks && second.KVDigest == computed.KVDigest, "the paused producer served the second fetch with the same digest")
	st, _ := prod.C.Status(context.Background())
	check(st.State == "paused", "the producer stayed paused")

	pc, pt := prod.Stop()
	cc, ct := cons.Stop()
	check(pc == 0 && cc == 0, "both nodes exited 0")

	// elapsed_ms is the request's prefill (lookup, fetch, CPU → GPU load),
	// without the digest.
	gbps := func(r api.Result) float64 { return total / (r.ElapsedMS / 1000) / 1e9 }
	fmt.Printf("%-52s %s\n", "check", "result")
	fmt.Printf("%-52s %s\n", strings.Repeat("-", 52), strings.Repeat("-", 30))
	row := func(k, v string) { fmt.Printf("%-52s %s\n", k, v) }
	row("producer prefill (computed)", fmt.Sprintf("%d blocks in %.0f ms", computed.Sources.Computed, computed.ElapsedMS))
	row("P2P fetch 1 (running producer)", fmt.Sprintf("%d/%d blocks from peer, %.2f GB/s, digest %s", first.Sources.Peer, blocks, gbps(first), match(first, computed)))
	row("idle producer: context switches/s (all threads, 5 s)", fmt.Sprintf("%.1f", idleCS))
	row("idle producer: RSS beyond CPU arena and GPU cache", fmt.Sprintf("%.1f MiB (VmRSS %.0f MiB)", float64(beyond)/(1<<20), float64(rss)/(1<<20)))
	row("pause mode=wait clear_cache=false, idle producer, 20×", fmt.Sprintf("p50 %.2f ms, p99 %.2f ms through the admin API", ms(lat[9]), ms(lat[19])))
	row("P2P fetch 2 (paused producer)", fmt.Sprintf("%d/%d blocks from peer, %.2f GB/s, digest %s", second.Sources.Peer, blocks, gbps(second), match(second, computed)))
	row("SIGTERM → exit (producer, consumer)", fmt.Sprintf("%.0f ms exit %d, %.0f ms exit %d", ms(pt), pc, ms(ct), cc))

	fmt.Println("\nact 3: routing with events (three nodes, a router following their /v0/events)")
	lines, err := routing(dir, bin, check)
	if err != nil {
		return fmt.Errorf("routing: %w", err)
	}
	for _, l := range lines {
		row(l[0], l[1])
	}
	if len(failures) > 0 {
		return fmt.Errorf("failed: %s (logs were in %s)", strings.Join(failures, "; "), dir)
	}
	fmt.Println("\nall checks passed")
	return nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func match(a, b api.Result) string {
	if a.KVDigest == b.KVDigest {
		return "matches"
	}
	return "DIFFERS"
}

// routing is the third act: three nodes, a prompt computed on node-b,
// the router's choice for a request sent to node-c, and where node-c's
// blocks came from.
func routing(dir, bin string, check func(bool, string)) ([][2]string, error) {
	const blocks = 64
	var nodes []*daemon.Proc
	defer func() {
		for _, p := range nodes {
			p.Kill()
		}
	}()
	for _, name := range []string{"node-a", "node-b", "node-c"} {
		p, err := daemon.Start(dir, bin, name, blocks+16)
		if err != nil {
			return nil, err
		}
		nodes = append(nodes, p)
	}
	r := route.New(route.Scheme{Algo: offload.HashKvtier, Seed: offload.DefaultHashSeed, BlockTokens: 16}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	for _, p := range nodes {
		wg.Go(func() { r.Follow(ctx, p.Name, p.C, 100*time.Millisecond) })
	}
	computed, err := nodes[1].Submit(daemon.Prompt(7, blocks, "", ""))
	if err != nil {
		return nil, fmt.Errorf("prefill on node-b: %w", err)
	}
	tokens := node.SeededTokens(7, blocks*16)
	t0 := time.Now()
	var choice route.Choice
	for deadline := t0.Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if choice = r.Route(tokens, "node-c"); choice.Blocks == blocks || time.Now().After(deadline) {
			break
		}
	}
	seen := time.Since(t0)
	check(choice.Node == "node-b" && choice.Blocks == blocks, "the router named node-b, which computed the prompt")
	res, err := nodes[2].Submit(daemon.Prompt(7, blocks, "routed-1", choice.P2P))
	if err != nil {
		return nil, fmt.Errorf("node-c's request: %w", err)
	}
	check(res.Sources.Peer == blocks && res.KVDigest == computed.KVDigest, "node-c fetched every block from the router's choice, same digest")
	for _, p := range nodes {
		code, _ := p.Stop()
		check(code == 0, p.Name+" exited 0")
	}
	nodes = nil
	return [][2]string{
		{"prefill on node-b (computed)", fmt.Sprintf("%d blocks in %.0f ms", computed.Sources.Computed, computed.ElapsedMS)},
		{"router: the prompt's source for node-c", fmt.Sprintf("%s (%s), %d/%d blocks cached, in its index %.0f ms after the prefill answered", choice.Node, choice.P2P, choice.Blocks, choice.Of, ms(seen))},
		{"node-c's request with that remote_kv_source", fmt.Sprintf("cpu %d, disk %d, peer %d, computed %d; digest %s", res.Sources.CPU, res.Sources.Disk, res.Sources.Peer, res.Sources.Computed, match(res, computed))},
	}, nil
}
