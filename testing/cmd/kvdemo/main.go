// Command kvdemo is `make demo`: two p2pd processes on loopback with the
// qwen3-0.6b geometry. The producer computes 576 blocks (1,008 MiB) of a
// prompt; the consumer fetches them through the P2P tier; the producer is
// paused (mode=wait, no cache clear); the consumer drops its copy and
// fetches again from the paused producer; digests are compared; both shut
// down. It prints what it measured and exits non-zero if anything was
// wrong.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/ctl"
)

type proc struct {
	name   string
	cmd    *exec.Cmd
	c      *ctl.Client
	p2p    string
	exited chan error
	log    *os.File
}

var readyRE = regexp.MustCompile(`msg=ready .*p2p=(\S+)`)

func main() {
	binDir := flag.String("bin", "bin", "directory with p2pd (make build)")
	blocks := flag.Int("blocks", 576, "blocks in the prompt")
	flag.Parse()
	if err := run(*binDir, *blocks); err != nil {
		fmt.Fprintln(os.Stderr, "kvdemo:", err)
		os.Exit(1)
	}
}

func start(dir, bin, name string, blocks int) (*proc, error) {
	logf, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, name+".sock")
	slots := strconv.Itoa(blocks + 64)
	cmd := exec.Command(filepath.Join(bin, "p2pd"), "-model", "qwen3-0.6b", "-cpu-slots", slots, "-gpu-blocks", slots,
		"-admin", sock, "-p2p-listen", "127.0.0.1:0", "-node-id", name)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting p2pd (run make build first): %w", err)
	}
	p := &proc{name: name, cmd: cmd, c: ctl.New(sock, ""), exited: make(chan error, 1), log: logf}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			fmt.Fprintln(logf, sc.Text())
			if m := readyRE.FindStringSubmatch(sc.Text()); m != nil {
				ready <- m[1]
			}
		}
		p.exited <- cmd.Wait()
	}()
	select {
	case p.p2p = <-ready:
		return p, nil
	case err := <-p.exited:
		return nil, fmt.Errorf("%s exited before ready: %v (log: %s)", name, err, logf.Name())
	case <-time.After(60 * time.Second):
		cmd.Process.Kill()
		return nil, fmt.Errorf("%s not ready in 60 s (log: %s)", name, logf.Name())
	}
}

type result struct {
	Blocks  int `json:"blocks"`
	Sources struct {
		CPU, Disk, Peer, Computed int
	} `json:"sources"`
	KVDigest  string  `json:"kv_digest"`
	ElapsedMS float64 `json:"elapsed_ms"`
}

func (p *proc) submit(body map[string]any) (result, error) {
	var r result
	err := p.c.Do(context.Background(), "POST", "/v0/requests", nil, body, &r)
	return r, err
}

// ctxSwitches sums the context switches of every thread of pid.
func ctxSwitches(pid int) (int64, error) {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil || len(tasks) == 0 {
		return 0, fmt.Errorf("reading /proc/%d/task: %v", pid, err)
	}
	var n int64
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // a thread that just exited
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) == 2 && strings.HasSuffix(f[0], "ctxt_switches:") {
				v, _ := strconv.ParseInt(f[1], 10, 64)
				n += v
			}
		}
	}
	return n, nil
}

func rssBytes(pid int) int64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			return v << 10
		}
	}
	return 0
}

func run(bin string, blocks int) error {
	dir, err := os.MkdirTemp("", "kvdemo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	prod, err := start(dir, bin, "producer", blocks)
	if err != nil {
		return err
	}
	defer prod.cmd.Process.Kill()
	cons, err := start(dir, bin, "consumer", blocks)
	if err != nil {
		return err
	}
	defer cons.cmd.Process.Kill()
	const blockBytes = 28 * 2 * 16 * 8 * 128 * 2
	total := float64(blocks * blockBytes)
	prompt := map[string]any{"seed": 42, "tokens": blocks * 16}
	fmt.Printf("kvdemo: two p2pd on loopback (producer %s, consumer %s), qwen3-0.6b, a prompt of %d blocks (%.0f MiB)\n\n",
		prod.p2p, cons.p2p, blocks, total/(1<<20))

	var failures []string
	check := func(ok bool, what string) {
		if !ok {
			failures = append(failures, what)
		}
	}
	computed, err := prod.submit(prompt)
	if err != nil {
		return fmt.Errorf("producer prefill: %w", err)
	}
	check(computed.Sources.Computed == blocks, "the producer computed every block")
	fetch := func(id string) (result, error) {
		body := map[string]any{"seed": 42, "tokens": blocks * 16, "request_id": id,
			"kv_transfer_params": map[string]any{"remote_kv_source": map[string]any{"kv_request_id": id, "remote_host": "127.0.0.1",
				"remote_port": prod.p2p[strings.LastIndexByte(prod.p2p, ':')+1:]}}}
		return cons.submit(body)
	}
	first, err := fetch("demo-1")
	if err != nil {
		return fmt.Errorf("consumer fetch: %w", err)
	}
	check(first.Sources.Peer == blocks && first.KVDigest == computed.KVDigest, "the first fetch came from the peer with the producer's digest")

	// Idle: context switches of the whole producer process over 5 s.
	pid := prod.cmd.Process.Pid
	c0, err := ctxSwitches(pid)
	if err != nil {
		return err
	}
	time.Sleep(5 * time.Second)
	c1, _ := ctxSwitches(pid)
	idleCS := float64(c1-c0) / 5
	rss := rssBytes(pid)
	// The CPU arena and the host-memory GPU cache are both populated at
	// start: blocks+64 slots and blocks+64 GPU blocks.
	arenaAndGPU := int64((blocks+64)*((blockBytes+4095)/4096*4096) + (blocks+64)*blockBytes)

	// B2: 20 pauses (mode=wait, no cache clear) of the idle producer, each
	// timed through the admin API; all but the last are resumed.
	var lat []time.Duration
	var paused map[string]any
	for i := range 20 {
		t0 := time.Now()
		err = prod.c.Do(context.Background(), "POST", "/v0/pause", url.Values{"mode": {"wait"}, "clear_cache": {"false"}, "timeout": {"10s"}}, nil, &paused)
		lat = append(lat, time.Since(t0))
		if err != nil {
			return fmt.Errorf("pausing the producer: %w", err)
		}
		if i < 19 {
			if err := prod.c.Do(context.Background(), "POST", "/v0/resume", nil, nil, nil); err != nil {
				return fmt.Errorf("resuming the producer: %w", err)
			}
		}
	}
	slices.Sort(lat)
	if err := cons.c.Do(context.Background(), "POST", "/v0/reset-cache", nil, nil, nil); err != nil {
		return fmt.Errorf("consumer reset-cache: %w", err)
	}
	second, err := fetch("demo-2")
	if err != nil {
		return fmt.Errorf("fetch from the paused producer: %w", err)
	}
	check(second.Sources.Peer == blocks && second.KVDigest == computed.KVDigest, "the paused producer served the second fetch with the same digest")
	st, _ := prod.c.Status(context.Background())
	check(st.State == "paused", "the producer stayed paused")

	type exit struct {
		code int
		took time.Duration
	}
	stop := func(p *proc) exit {
		t0 := time.Now()
		p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-p.exited:
			code := 0
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				code = ee.ExitCode()
			}
			return exit{code, time.Since(t0)}
		case <-time.After(30 * time.Second):
			p.cmd.Process.Kill()
			return exit{-1, time.Since(t0)}
		}
	}
	ep, ec := stop(prod), stop(cons)
	check(ep.code == 0 && ec.code == 0, "both nodes exited 0")

	// elapsed_ms is the request's prefill (lookup, fetch, CPU → GPU load),
	// without the digest.
	gbps := func(r result) float64 { return total / (r.ElapsedMS / 1000) / 1e9 }
	fmt.Printf("%-52s %s\n", "check", "result")
	fmt.Printf("%-52s %s\n", strings.Repeat("-", 52), strings.Repeat("-", 30))
	row := func(k, v string) { fmt.Printf("%-52s %s\n", k, v) }
	row("producer prefill (computed)", fmt.Sprintf("%d blocks in %.0f ms", computed.Sources.Computed, computed.ElapsedMS))
	row("P2P fetch 1 (running producer)", fmt.Sprintf("%d/%d blocks from peer, %.2f GB/s, digest %s", first.Sources.Peer, blocks, gbps(first), match(first, computed)))
	row("idle producer: context switches/s (all threads, 5 s)", fmt.Sprintf("%.1f", idleCS))
	row("idle producer: RSS beyond CPU arena and GPU cache", fmt.Sprintf("%.1f MiB (VmRSS %.0f MiB)", float64(rss-arenaAndGPU)/(1<<20), float64(rss)/(1<<20)))
	row("pause mode=wait clear_cache=false, idle producer, 20×", fmt.Sprintf("p50 %.2f ms, p99 %.2f ms through the admin API", ms(lat[9]), ms(lat[19])))
	row("P2P fetch 2 (paused producer)", fmt.Sprintf("%d/%d blocks from peer, %.2f GB/s, digest %s", second.Sources.Peer, blocks, gbps(second), match(second, computed)))
	row("SIGTERM → exit (producer, consumer)", fmt.Sprintf("%.0f ms exit %d, %.0f ms exit %d", ms(ep.took), ep.code, ms(ec.took), ec.code))
	if len(failures) > 0 {
		return fmt.Errorf("failed: %s (logs were in %s)", strings.Join(failures, "; "), dir)
	}
	fmt.Println("\nall checks passed")
	return nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func match(a, b result) string {
	if a.KVDigest == b.KVDigest {
		return "matches"
	}
	return "DIFFERS"
}
