// Command kvbench runs the daemon benchmarks side by side with their
// baselines (BENCHMARKS.md): B1 (a consumer p2pd fetching from a producer
// p2pd over each data plane asked for, beside plain TCP between two
// processes), B2 (pause latency, idle
// and under fetch load), B3 (idle context switches), B4 (SIGTERM → exit,
// idle and with a fetch in flight) and M1 (memory beyond the caches). It
// prints one table — project, baseline, ratio, target, verdict — and
// writes the same as JSON.
//
//	kvbench [-bin bin] [-blocks 576] [-data-planes tcp,tcp+token,tcp+token+tls,nixl] [-json kvbench.json] [-require-copies cuda]
//
// On a GPU host (make gpu-bundle; sh bin/gpu-bundle/kvbench.sh) the
// daemons' GPU caches are device memory and the whole request's CPU → GPU
// load is a DMA copy; the table's first row names the backend.
//
// A data plane named with a +token suffix (before any +tls) runs with a
// cluster token on both daemons, so every connection authenticates.
// A data plane named with a +tls suffix runs with the P2P tier's mutual
// TLS on (p2p_tls_*, certificates from a throwaway CA).
// B2–B4 and M1 run on the first data plane's daemons.
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/p2pd/api"
	"github.com/kvtier/kvtier/testing/daemon"
	"github.com/kvtier/kvtier/testing/pki"
)

// Row is one line of the table.
type Row struct {
	ID       string `json:"id"`
	What     string `json:"what"`
	Project  string `json:"project"`
	Baseline string `json:"baseline"`
	Ratio    string `json:"ratio"`
	Target   string `json:"target"`
	Verdict  string `json:"verdict"`
}

// daemonArgs are extra p2pd arguments (-p2pd-arg).
var daemonArgs argList

// requireCopies, when set, is the copy backend every daemon must report
// (its status's "copies" starts with it): a GPU host's run fails instead
// of measuring the host backend when the daemons found no GPU.
var requireCopies string

// loadWindow, when positive, is the load_window of a second consumer the
// whole request is timed on beside the first (-load-window).
var loadWindow int

type argList []string

func (a *argList) String() string     { return strings.Join(*a, " ") }
func (a *argList) Set(v string) error { *a = append(*a, v); return nil }

func main() {
	if len(os.Args) > 1 && os.Args[1] == "sink" {
		sink()
		return
	}
	bin := flag.String("bin", "bin", "directory with p2pd (make build)")
	blocks := flag.Int("blocks", 576, "blocks in the prompt")
	rounds := flag.Int("rounds", 3, "timed rounds of B1")
	planes := flag.String("data-planes", "tcp", "P2P data planes to measure B1 over: tcp, tcp+token (a cluster token on both daemons), tcp+tls (mutual TLS on, certificates from a throwaway CA), tcp+token+tls, nixl (needs p2pd built with make build-nixl)")
	out := flag.String("json", "kvbench.json", "where to write the table as JSON")
	flag.Var(&daemonArgs, "p2pd-arg", "an argument for both p2pd daemons (repeatable), e.g. -p2pd-arg=-data-conns=1")
	flag.IntVar(&loadWindow, "load-window", 64, "also time the whole request with a second consumer whose load_window is this, alternating with the first (0: skip)")
	flag.StringVar(&requireCopies, "require-copies", "", "fail unless every daemon's copy backend (status \"copies\") starts with this, e.g. cuda")
	flag.Parse()
	rows, err := run(*bin, strings.Split(*planes, ","), *blocks, *rounds)
	print(rows)
	if b, jerr := json.MarshalIndent(rows, "", "  "); jerr == nil {
		os.WriteFile(*out, b, 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvbench:", err)
		os.Exit(1)
	}
}

func print(rows []Row) {
	fmt.Printf("\n%-4s %-52s %-22s %-20s %-8s %-14s %s\n", "id", "what", "project", "baseline", "ratio", "target", "verdict")
	for _, r := range rows {
		fmt.Printf("%-4s %-52s %-22s %-20s %-8s %-14s %s\n", r.ID, r.What, r.Project, r.Baseline, r.Ratio, r.Target, r.Verdict)
	}
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT MET"
}

// pauseRuns is how many pauses each B2 row times: enough that p99 is not
// simply the maximum (with 20 it swung 1.4 – 14.6 ms between runs).
const pauseRuns = 200

// The loaded row and its baseline (CPU hogs) time pauseBlocks blocks of
// blockPauses pauses each, alternating, so that both see the same
// machine: run one after the other, the hogs' p99 alone swung from 0.38
// to 4.7 ms between runs (issue 12, ninth steps).
const (
	pauseBlocks = 5
	blockPauses = 100
)

// pct is the p-th percentile of sorted v.
func pct(v []float64, p int) float64 { return v[(len(v)-1)*p/100] }

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// pair is a producer and a consumer p2pd; fetch makes the consumer fetch
// the producer's prompt after resetting its cache.
type pair struct {
	prod, cons *daemon.Proc
	want       api.Result
	blocks     int
	round      int
	dir, bin   string
	consArgs   []string // the consumer's arguments
}

// withConsumer is the pair's producer with a second consumer, started
// with the first's arguments and extra after them (-require-copies holds
// for it too). Stop it with its cons.Kill: the pair's kill would stop the
// producer as well.
func (p *pair) withConsumer(name string, extra ...string) (*pair, error) {
	cons, err := daemon.Start(p.dir, p.bin, name, p.prod.Slots, append(slices.Clip(p.consArgs), extra...)...)
	if err != nil {
		return nil, err
	}
	if !strings.HasPrefix(cons.Copies, requireCopies) {
		cons.Kill()
		return nil, fmt.Errorf("%s copies with %q, not %s (-require-copies)", cons.Name, cons.Copies, requireCopies)
	}
	q := &pair{prod: p.prod, cons: cons, want: p.want, blocks: p.blocks, round: 1 << 20}
	if _, err := q.fetch(); err != nil { // warm-up
		cons.Kill()
		return nil, err
	}
	return q, nil
}

// windowRates times the whole request (crc32c, client's wall time) rounds
// times on p and on q alternately, and returns the medians in GB/s.
func windowRates(p, q *pair, rounds int) (pr, qr float64, err error) {
	var ps, qs []float64
	for range rounds {
		a, err := p.wallRate(1, "")
		if err != nil {
			return 0, 0, err
		}
		b, err := q.wallRate(1, "")
		if err != nil {
			return 0, 0, err
		}
		ps, qs = append(ps, a), append(qs, b)
	}
	return median(ps), median(qs), nil
}

func startPair(dir, bin, plane string, blocks int) (*pair, error) {
	slots := blocks + 64
	// A whole 1 GiB prompt is promoted as one batch; on a slow machine that
	// can take longer than the default 5 s HitPending bound, which would
	// (correctly) make the consumer recompute instead of fetching.
	base, withTLS := strings.CutSuffix(plane, "+tls")
	base, withToken := strings.CutSuffix(base, "+token")
	args := append([]string{"-hit-pending-timeout", "60s", "-data-plane", base}, daemonArgs...)
	if withToken {
		tok := filepath.Join(dir, "token-"+plane)
		if err := os.WriteFile(tok, []byte("kvbench-token\n"), 0o600); err != nil {
			return nil, err
		}
		args = append(args, "-cluster-token-file", tok)
	}
	var prodTLS, consTLS []string
	if withTLS {
		// Mutual TLS between the two daemons, from a throwaway CA.
		ca, err := pki.NewCA(dir, "kvbench-"+plane)
		if err != nil {
			return nil, err
		}
		for _, x := range []struct {
			name string
			args *[]string
		}{{"producer-" + plane, &prodTLS}, {"consumer-" + plane, &consTLS}} {
			f, err := ca.Node(x.name)
			if err != nil {
				return nil, err
			}
			*x.args = f.Args()
		}
	}
	prod, err := daemon.Start(dir, bin, "producer-"+plane, slots, append(args, prodTLS...)...)
	if err != nil {
		return nil, err
	}
	consArgs := append(slices.Clip(args), consTLS...)
	cons, err := daemon.Start(dir, bin, "consumer-"+plane, slots, consArgs...)
	if err != nil {
		prod.Kill()
		return nil, err
	}
	p := &pair{prod: prod, cons: cons, blocks: blocks, dir: dir, bin: bin, consArgs: consArgs}
	for _, d := range []*daemon.Proc{prod, cons} {
		if !strings.HasPrefix(d.Copies, requireCopies) {
			p.kill()
			return nil, fmt.Errorf("%s copies with %q, not %s (-require-copies)", d.Name, d.Copies, requireCopies)
		}
	}
	if p.want, err = prod.Submit(daemon.Prompt(42, blocks, "", "")); err == nil {
		_, err = p.fetch() // warm-up
	}
	if err != nil {
		p.kill()
		return nil, err
	}
	return p, nil
}

func (p *pair) kill() {
	p.prod.Kill()
	p.cons.Kill()
}

func (p *pair) fetch() (api.Result, error) {
	r, _, err := p.fetchDigest("")
	return r, err
}

// fetchDigest is fetch with a kv_digest kind ("" for the default), also
// returning the client's wall time for the whole request, digest included.
func (p *pair) fetchDigest(digest string) (api.Result, time.Duration, error) {
	if err := p.cons.C.Do(context.Background(), "POST", "/v0/reset-cache", nil, nil, nil); err != nil {
		return api.Result{}, 0, err
	}
	p.round++
	body := daemon.Prompt(42, p.blocks, fmt.Sprintf("bench-%d", p.round), p.prod.P2P)
	if digest != "" {
		body["kv_digest"] = digest
	}
	t0 := time.Now()
	r, err := p.cons.Submit(body)
	wall := time.Since(t0)
	if err == nil && (r.Sources.Peer != p.blocks || (digest == "" && r.KVDigest != p.want.KVDigest)) {
		err = fmt.Errorf("fetch %d: %d of %d blocks from the peer (%+v), digest equal %v", p.round, r.Sources.Peer, p.blocks, r.Sources, r.KVDigest == p.want.KVDigest)
	}
	return r, wall, err
}

// wallRate is the median GB/s of the whole request as its client sees it
// (lookups, fetch, CPU → GPU load, and the digest of that kind).
func (p *pair) wallRate(rounds int, digest string) (float64, error) {
	total := float64(p.blocks * daemon.BlockBytes)
	var rs []float64
	for range rounds {
		_, wall, err := p.fetchDigest(digest)
		if err != nil {
			return 0, err
		}
		rs = append(rs, total/wall.Seconds()/1e9)
	}
	return median(rs), nil
}

// b1 is what rates measured: median GB/s of the P2P tier's own transfer
// time, of the whole request and of the plain TCP baseline, and the CPU
// seconds per GB the whole requests took in both daemons and the baseline
// in both of its processes, over all rounds.
type b1 struct {
	project, whole, base float64
	cpuWhole, cpuBase    float64
}

// rates runs rounds timed fetches, each followed by a round of the plain
// TCP baseline (B1 alternates them, so both see the same machine): the
// P2P tier's own transfer time (promotion job submitted → result: fetch,
// data plane, checksums) from the consumer's metrics, the whole request
// (lookups, fetch and the CPU → GPU load), the baseline, and the CPU
// time of each side's two processes.
func (p *pair) rates(rounds int, plain *plainBase) (b1, error) {
	total := float64(p.blocks * daemon.BlockBytes)
	var ps, ws, bs []float64
	var cpuWhole, cpuBase float64
	for range rounds {
		s0, err := p2pReadSeconds(p.cons)
		if err != nil {
			return b1{}, err
		}
		c0, err := cpuSeconds(p.prod.Cmd.Process.Pid, p.cons.Cmd.Process.Pid)
		if err != nil {
			return b1{}, err
		}
		r, err := p.fetch()
		if err != nil {
			return b1{}, err
		}
		c1, err := cpuSeconds(p.prod.Cmd.Process.Pid, p.cons.Cmd.Process.Pid)
		if err != nil {
			return b1{}, err
		}
		s1, err := p2pReadSeconds(p.cons)
		if err != nil {
			return b1{}, err
		}
		ps = append(ps, total/(s1-s0)/1e9)
		ws = append(ws, total/(r.ElapsedMS/1000)/1e9)
		cpuWhole += c1 - c0
		c0, err = cpuSeconds(os.Getpid(), plain.cmd.Process.Pid)
		if err != nil {
			return b1{}, err
		}
		d, err := plain.round()
		if err != nil {
			return b1{}, err
		}
		c1, err = cpuSeconds(os.Getpid(), plain.cmd.Process.Pid)
		if err != nil {
			return b1{}, err
		}
		cpuBase += c1 - c0
		bs = append(bs, total/d.Seconds()/1e9)
	}
	gb := float64(rounds) * total / 1e9
	return b1{median(ps), median(ws), median(bs), cpuWhole / gb, cpuBase / gb}, nil
}

// cpuSeconds is the CPU time the processes used, together.
func cpuSeconds(pids ...int) (float64, error) {
	var sum float64
	for _, pid := range pids {
		s, err := daemon.CPUSeconds(pid)
		if err != nil {
			return 0, err
		}
		sum += s
	}
	return sum, nil
}

func run(bin string, planes []string, blocks, rounds int) ([]Row, error) {
	var rows []Row
	dir, err := os.MkdirTemp("", "kvbench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	slots := blocks + 64
	total := float64(blocks * daemon.BlockBytes)
	ctx := context.Background()

	// B1, over each data plane, alternating with the plain TCP baseline;
	// the first plane's pair stays for the rest.
	plain, err := startPlain(int(total), 4, len(planes)*rounds)
	if err != nil {
		return rows, err
	}
	defer plain.close()
	var first *pair
	var b float64 // the first plane's baseline, for the rows after B1
	for i, plane := range planes {
		p, err := startPair(dir, bin, plane, blocks)
		if err != nil {
			return rows, fmt.Errorf("data plane %s: %w", plane, err)
		}
		if i == 0 {
			first = p
			defer p.kill()
			// What the numbers were measured on: the GPU cache's backend
			// decides what the whole request's CPU → GPU load costs.
			copies := p.prod.Copies
			if p.cons.Copies != copies {
				copies = "producer " + copies + ", consumer " + p.cons.Copies
			}
			rows = append(rows, Row{"—", "machine: CPUs; copy backend of both daemons", fmt.Sprintf("%d CPUs; %s", runtime.NumCPU(), copies), "", "", "", ""})
		}
		m, err := p.rates(rounds, plain)
		if i > 0 {
			p.kill()
		}
		if err != nil {
			return rows, fmt.Errorf("data plane %s: %w", plane, err)
		}
		if i == 0 {
			b = m.base
		}
		rows = append(rows, Row{"B1", fmt.Sprintf("P2P fetch over %s, %d blocks, two processes (median of %d, alternating)", plane, blocks, rounds),
			fmt.Sprintf("%.2f GB/s", m.project), fmt.Sprintf("%.2f GB/s plain TCP", m.base), fmt.Sprintf("%.3f", m.project/m.base), "≥ 0.9", verdict(m.project/m.base >= 0.9)})
		rows = append(rows, Row{"B1", "  the whole request (lookups, fetch, CPU → GPU load)", fmt.Sprintf("%.2f GB/s", m.whole), "", fmt.Sprintf("%.2f", m.whole/m.base), "", ""})
		// Where the transfer fills every core (a small host on loopback),
		// the whole request's wall ratio cannot exceed its CPU ratio.
		rows = append(rows, Row{"B1", "  the whole request's CPU, both p2pd, against plain TCP's two processes", fmt.Sprintf("%.3f CPU-s/GB", m.cpuWhole),
			fmt.Sprintf("%.3f CPU-s/GB", m.cpuBase), fmt.Sprintf("%.2f", m.cpuBase/m.cpuWhole), "", ""})
	}
	// The whole request again, alternating between the first pair's
	// consumer and one with -load-window (engine.Config.LoadWindow): its
	// loads overlap the fetch, which pays where the CPU → GPU load is the
	// GPU's own copy and costs where it is a memcpy on the fetch's cores.
	// (Before the rows below: the producer's session with the second
	// consumer ends while they run, not during B3's idle count.)
	if loadWindow > 0 {
		// Optional rows: a failure is reported in the table, and the
		// benchmarks after them still run.
		what := fmt.Sprintf("  the whole request, crc32c, load_window %d (client's wall time, alternating)", loadWindow)
		alt, err := first.withConsumer("consumer-window", fmt.Sprintf("-load-window=%d", loadWindow))
		var fr, ar float64
		if err == nil {
			fr, ar, err = windowRates(first, alt, rounds)
			alt.cons.Kill()
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "kvbench: the load_window rows:", err)
			rows = append(rows, Row{"B1", what, "failed: " + err.Error(), "", "", "", ""})
		} else {
			rows = append(rows,
				Row{"B1", "  the whole request, crc32c, the consumer's load_window as above (client's wall time, alternating)", fmt.Sprintf("%.2f GB/s", fr), "", fmt.Sprintf("%.2f", fr/b), "", ""},
				Row{"B1", what, fmt.Sprintf("%.2f GB/s", ar), "", fmt.Sprintf("%.2f", ar/b), "", ""})
		}
	}
	// The whole request as its client sees it, with each kind of digest,
	// on the first plane's daemons.
	// The target is the default digest's (crc32c, off the copies).
	for _, d := range []string{"crc32c", "sha256", "none"} {
		w, err := first.wallRate(rounds, d)
		if err != nil {
			return rows, err
		}
		row := Row{"B1", fmt.Sprintf("  the whole request with kv_digest %s (client's wall time, %s)", d, planes[0]),
			fmt.Sprintf("%.2f GB/s", w), "", fmt.Sprintf("%.2f", w/b), "", ""}
		if d == "crc32c" {
			row.What = fmt.Sprintf("  the whole request with kv_digest crc32c, the default (client's wall time, %s)", planes[0])
			row.Target, row.Verdict = "≥ 0.8", verdict(w/b >= 0.8)
		}
		rows = append(rows, row)
	}
	prod, cons := first.prod, first.cons
	// The load of B2, B4 and M1 asks for no digest: on a machine with many
	// cores the consumer's digest would hash on all but one of them, beside
	// the producer whose pauses B2 times. B1 checked the digests.
	fetch := func() (api.Result, error) {
		r, _, err := first.fetchDigest("none")
		return r, err
	}
	// M1's target is for the host backend; on CUDA the driver's own host
	// memory (its context, pinned staging) counts as beyond the caches.
	m1 := func(what string, mib float64) Row {
		r := Row{"M1", what, fmt.Sprintf("%.1f MiB", mib), "—", "—", "< 64 MiB", verdict(mib < 64)}
		if prod.Copies != "host" {
			r.What += " (with the CUDA driver's)"
			r.Target, r.Verdict = "< 64 MiB on host", "—"
		}
		return r
	}

	// B3 and M1, idle.
	c0, err := prod.CtxSwitches()
	if err != nil {
		return rows, err
	}
	time.Sleep(5 * time.Second)
	c1, _ := prod.CtxSwitches()
	cs := float64(c1-c0) / 5
	rows = append(rows, Row{"B3", "idle producer: context switches/s, all threads, 5 s", fmt.Sprintf("%.1f/s", cs), "—", "—", "≤ 1/s", verdict(cs <= 1)})
	idleRSS := float64(prod.RSSBeyondCaches()) / (1 << 20)
	rows = append(rows, m1("producer RSS beyond CPU arena and GPU cache, idle", idleRSS))

	// B2, idle and under fetch load.
	pauses := func(n int) ([]float64, error) {
		var lat []float64
		for range n {
			t0 := time.Now()
			err := prod.C.Do(ctx, "POST", "/v0/pause", url.Values{"mode": {"wait"}, "clear_cache": {"false"}, "timeout": {"10s"}}, nil, nil)
			lat = append(lat, ms(time.Since(t0)))
			if err != nil {
				return lat, err
			}
			if err := prod.C.Do(ctx, "POST", "/v0/resume", nil, nil, nil); err != nil {
				return lat, err
			}
		}
		slices.Sort(lat)
		return lat, nil
	}
	lat, err := pauses(pauseRuns)
	if err != nil {
		return rows, err
	}
	rows = append(rows, Row{"B2", fmt.Sprintf("pause wait, idle P2P-only producer (p50/p99 of %d)", pauseRuns), fmt.Sprintf("%.2f / %.2f ms", pct(lat, 50), pct(lat, 99)), "—", "—", "p99 ≤ 2 ms", verdict(pct(lat, 99) <= 2)})
	var peakRSS atomic.Int64
	// Pauses while fetches load the producer, for one block.
	loaded := func(n int) ([]float64, error) {
		var stop atomic.Bool
		var wg sync.WaitGroup
		var loadErr error
		wg.Go(func() {
			for !stop.Load() {
				if _, err := fetch(); err != nil {
					loadErr = err
					return
				}
				peakRSS.Store(max(peakRSS.Load(), prod.RSSBeyondCaches()))
			}
		})
		time.Sleep(200 * time.Millisecond) // the load under way
		lat, err := pauses(n)
		peakRSS.Store(max(peakRSS.Load(), prod.RSSBeyondCaches()))
		stop.Store(true)
		wg.Wait()
		return lat, cmp.Or(err, loadErr)
	}
	// The same pauses while two CPU hogs at nice 0 run instead of fetches:
	// what waiting for a CPU alone costs on this machine (issue 12's
	// baseline), for one block.
	hogged := func(n int) ([]float64, error) {
		var hogs []*exec.Cmd
		defer func() {
			for _, h := range hogs {
				h.Process.Kill()
				h.Wait()
			}
		}()
		for range 2 {
			h := exec.Command("sh", "-c", "while :; do :; done")
			if err := h.Start(); err != nil {
				return nil, err
			}
			hogs = append(hogs, h)
		}
		return pauses(n)
	}
	var hogLat []float64
	lat = nil
	for range pauseBlocks {
		l, err := loaded(blockPauses)
		if err != nil {
			return rows, err
		}
		h, err := hogged(blockPauses)
		if err != nil {
			return rows, err
		}
		lat, hogLat = append(lat, l...), append(hogLat, h...)
	}
	slices.Sort(lat)
	slices.Sort(hogLat)
	ratio := pct(lat, 99) / pct(hogLat, 99)
	// On a machine with 8 cores or more the p99 must also be ≤ 5 ms.
	met := ratio <= 2 && (runtime.NumCPU() < 8 || pct(lat, 99) <= 5)
	rows = append(rows, Row{"B2", fmt.Sprintf("pause wait, producer under fetch load (p50/p99 of %d in %d blocks, alternating with the hogs')", pauseBlocks*blockPauses, pauseBlocks), fmt.Sprintf("%.2f / %.2f ms", pct(lat, 50), pct(lat, 99)),
		fmt.Sprintf("%.2f / %.2f ms with 2 CPU hogs", pct(hogLat, 50), pct(hogLat, 99)), fmt.Sprintf("%.2f", ratio), "p99 ≤ 2× hogs' (≤ 5 ms on ≥ 8 cores)", verdict(met)})
	loadRSS := float64(peakRSS.Load()) / (1 << 20)
	rows = append(rows, m1("producer RSS beyond the caches, under fetch load", loadRSS))

	// B4, with a fetch in flight: SIGTERM the producer mid-transfer.
	done := make(chan error, 1)
	go func() { _, err := fetch(); done <- err }()
	for {
		st, err := cons.C.Status(ctx)
		if err != nil {
			return rows, err
		}
		if st.Requests.Running > 0 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	code, took := prod.Stop()
	<-done // fails or recomputes: the producer went away
	rows = append(rows, Row{"B4", "SIGTERM → exit, producer with a fetch in flight", fmt.Sprintf("%.0f ms, exit %d", ms(took), code), "—", "—", "≤ 1 s, exit 0", verdict(code == 0 && took <= time.Second)})

	// B4, idle: a fresh node of the same size.
	idle, err := daemon.Start(dir, bin, "idle", slots)
	if err != nil {
		return rows, err
	}
	time.Sleep(time.Second)
	code, took = idle.Stop()
	rows = append(rows, Row{"B4", "SIGTERM → exit, idle node", fmt.Sprintf("%.0f ms, exit %d", ms(took), code), "—", "—", "≤ 100 ms, exit 0", verdict(code == 0 && took <= 100*time.Millisecond)})
	cons.Stop()
	return rows, nil
}

// p2pReadSeconds reads the consumer's P2P promotion time from /metrics.
func p2pReadSeconds(p *daemon.Proc) (float64, error) {
	var text string
	if err := p.C.Do(context.Background(), "GET", "/metrics", nil, nil, &text); err != nil {
		return 0, err
	}
	const name = `kv_offload_tiering_transfer_seconds_total{tier="p2p",direction="read"} `
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(line, name); ok {
			return strconv.ParseFloat(v, 64)
		}
	}
	return 0, fmt.Errorf("no %s in the consumer's metrics", name)
}

// plainBase is B1's baseline: n bytes over conns loopback connections to
// a sink in another process, a round at a time over new connections.
type plainBase struct {
	ln     *net.TCPListener
	cmd    *exec.Cmd
	exited chan error // the sink's exit; its listener is closed then, so a round fails at once
	buf    []byte
	conns  int
}

// roundTimeout bounds a baseline round, connections accepted and every
// byte acknowledged: a round takes well under a second.
const roundTimeout = 60 * time.Second

// startPlain starts the sink for rounds timed rounds and runs one untimed
// round first, which warms both processes' buffers up like p2pd's warm-up
// fetch.
func startPlain(n, conns, rounds int) (*plainBase, error) {
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		ln.Close()
		return nil, err
	}
	cmd := exec.Command(self, "sink", ln.Addr().String(), strconv.Itoa(conns), strconv.Itoa(n/conns), strconv.Itoa(rounds+1))
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		ln.Close()
		return nil, err
	}
	p := &plainBase{ln: ln, cmd: cmd, exited: make(chan error, 1), buf: make([]byte, n/conns), conns: conns}
	go func() {
		err := cmd.Wait()
		ln.Close()
		p.exited <- err
	}()
	for i := range p.buf {
		p.buf[i] = byte(i)
	}
	if _, err := p.round(); err != nil {
		p.close()
		return nil, err
	}
	return p, nil
}

// round times one round: until the sink had every byte.
func (p *plainBase) round() (time.Duration, error) {
	deadline := time.Now().Add(roundTimeout)
	p.ln.SetDeadline(deadline)
	var cs []net.Conn
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	for range p.conns {
		c, err := p.ln.Accept()
		if err != nil {
			return 0, fmt.Errorf("plain TCP baseline: the sink did not connect: %w", err)
		}
		c.SetDeadline(deadline)
		cs = append(cs, c)
	}
	t0 := time.Now()
	errs := make([]error, len(cs))
	var wg sync.WaitGroup
	for i, c := range cs {
		wg.Go(func() {
			if _, err := c.Write(p.buf); err != nil {
				errs[i] = err
				return
			}
			var ack [1]byte
			_, errs[i] = io.ReadFull(c, ack[:])
		})
	}
	wg.Wait()
	took := time.Since(t0)
	if err := errors.Join(errs...); err != nil {
		return 0, fmt.Errorf("plain TCP baseline: %w", err)
	}
	return took, nil
}

// close stops the sink (it has rounds left if a run failed) and waits
// for it.
func (p *plainBase) close() {
	p.cmd.Process.Kill()
	<-p.exited
}

// sink is the baseline's receiving process: for each round it dials conns
// connections and reads n bytes on each into its buffers, then acks.
func sink() {
	addr := os.Args[2]
	conns, _ := strconv.Atoi(os.Args[3])
	n, _ := strconv.Atoi(os.Args[4])
	rounds, _ := strconv.Atoi(os.Args[5])
	bufs := make([][]byte, conns)
	for i := range bufs {
		bufs[i] = make([]byte, n)
	}
	for range rounds {
		var wg sync.WaitGroup
		for _, buf := range bufs {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				fmt.Fprintln(os.Stderr, "kvbench sink:", err)
				os.Exit(1)
			}
			wg.Go(func() {
				defer c.Close()
				io.ReadFull(c, buf)
				c.Write([]byte{1})
			})
		}
		wg.Wait()
	}
}
