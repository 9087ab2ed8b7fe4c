// Command kvdemo is `make demo`: two p2pd processes on loopback with the
// qwen3-0.6b geometry. The producer computes 576 blocks (1,008 MiB) of a
// prompt; the consumer fetches them through the P2P tier; the producer is
// paused (mode=wait, no cache clear); the consumer drops its copy and
// fetches again from the paused producer; digests are compared; both shut
// down. It prints what it measured and exits non-zero if anything was
// wrong.
package main

import (
	"context"
	"flag"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/kvtier/kvtier/p2pd/api"
	"github.com/kvtier/kvtier/testing/daemon"
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
