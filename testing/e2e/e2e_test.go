// Package e2e starts real p2pd processes (tiny geometry) and drives them
// with real kvctl processes.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/p2pd/api"
)

var bin string // directory of the built p2pd, kvctl and kvroute

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "kvtier-e2e-")
	if err != nil {
		panic(err)
	}
	goTool := filepath.Join(runtime.GOROOT(), "bin", "go")
	build := append(append([]string{"build"}, buildTags...), "-o", dir+"/", "github.com/kvtier/kvtier/p2pd/cmd/p2pd",
		"github.com/kvtier/kvtier/ctl/cmd/kvctl", "github.com/kvtier/kvtier/testing/cmd/kvroute")
	out, err := exec.Command(goTool, build...).CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "building p2pd and kvctl: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	bin = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

type node struct {
	t      *testing.T
	cmd    *exec.Cmd
	admin  string
	p2p    string
	mu     sync.Mutex
	log    bytes.Buffer
	exited chan error
}

var readyRE = regexp.MustCompile(`msg=ready .*p2p=(\S+)`)

// start runs p2pd with the tiny geometry and its admin socket in a temp
// dir, and waits for its ready line.
func start(t *testing.T, args ...string) *node {
	t.Helper()
	return startLimited(t, 0, args...)
}

// startLimited is start with the process's fd limit set to fds (0: as
// inherited), through the shell's ulimit.
func startLimited(t *testing.T, fds int, args ...string) *node {
	t.Helper()
	dir := t.TempDir()
	n := &node{t: t, admin: filepath.Join(dir, "p2pd.sock"), exited: make(chan error, 1)}
	args = append([]string{"-model", "tiny", "-cpu-slots", "256", "-gpu-blocks", "128", "-admin", n.admin,
		"-p2p-listen", "127.0.0.1:0"}, append(planeArgs, args...)...)
	n.cmd = exec.Command(filepath.Join(bin, "p2pd"), args...)
	if fds > 0 {
		n.cmd = exec.Command("sh", append([]string{"-c", fmt.Sprintf(`ulimit -n %d && exec "$0" "$@"`, fds), filepath.Join(bin, "p2pd")}, args...)...)
	}
	stderr, err := n.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			n.mu.Lock()
			n.log.WriteString(line + "\n")
			n.mu.Unlock()
			if m := readyRE.FindStringSubmatch(line); m != nil {
				ready <- m[1]
			}
		}
		n.exited <- n.cmd.Wait()
	}()
	select {
	case n.p2p = <-ready:
	case <-time.After(20 * time.Second):
		n.cmd.Process.Kill()
		t.Fatalf("p2pd not ready:\n%s", n.logs())
	}
	t.Cleanup(func() {
		n.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-n.exited:
		case <-time.After(20 * time.Second):
			n.cmd.Process.Kill()
			t.Errorf("p2pd did not stop on SIGTERM:\n%s", n.logs())
		}
	})
	return n
}

func (n *node) logs() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.log.String()
}

// kvctl runs kvctl against the node and returns stdout and the exit code.
func (n *node) kvctl(args ...string) (string, int) {
	n.t.Helper()
	cmd := exec.Command(filepath.Join(bin, "kvctl"), append([]string{"-admin", n.admin}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		n.t.Fatal(err)
	}
	return out.String() + errb.String(), code
}

// submit runs a request through kvctl and decodes its JSON answer.
func (n *node) submit(args ...string) (api.Result, string, int) {
	n.t.Helper()
	out, code := n.kvctl(append([]string{"submit", "--json"}, args...)...)
	var r api.Result
	if code == 0 {
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			n.t.Fatalf("submit answer %q: %v", out, err)
		}
	}
	return r, out, code
}

// S3.6, S5.3: pause (wait, no cache clear) on an idle P2P-only producer
// returns at once — well within a 2 s timeout — and the paused producer
// still serves a consumer, with equal digests.
func TestPausedProducerServes(t *testing.T) {
	prod, cons := start(t), start(t)
	want, out, code := prod.submit("--tokens-seed", "7", "--tokens", "200")
	if code != 0 || want.Sources.Computed != 12 {
		t.Fatalf("producer prefill: %d %s", code, out)
	}
	if out, code := prod.kvctl("pause", "--timeout", "2s"); code != 0 {
		t.Fatalf("pause of an idle producer: %d %s", code, out)
	}
	got, out, code := cons.submit("--tokens-seed", "7", "--tokens", "200", "--remote-kv-source", prod.p2p, "--kv-request-id", "kv-7")
	if code != 0 {
		t.Fatalf("consumer: %d %s", code, out)
	}
	if got.Sources.Peer != 12 || got.KVDigest != want.KVDigest {
		t.Errorf("consumer got %+v; want 12 blocks from the peer and digest %s", got, want.KVDigest)
	}
	if out, _ := prod.kvctl("status", "--json"); !strings.Contains(out, `"state": "paused"`) {
		t.Errorf("producer status %s", out)
	}
}

// blackHole accepts connections and never answers: a peer whose handshake
// hangs, so a consumer request stays in flight until handshake_timeout.
func blackHole(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	return ln.Addr().String()
}

// inFlight starts a consumer request against a black hole and waits
// until the node reports it running.
func inFlight(t *testing.T, n *node, hole string) chan string {
	done := make(chan string, 1)
	go func() {
		_, out, code := n.submit("--tokens-seed", "9", "--tokens", "64", "--remote-kv-source", hole, "--kv-request-id", "kv-hole")
		done <- fmt.Sprintf("%d %s", code, out)
	}()
	if out := n.waitRunning(); out != "" {
		t.Fatalf("request never ran: %s", out)
	}
	return done
}

// waitRunning polls the node's status until it reports one running
// request; after 10 s it gives up and returns the last status.
func (n *node) waitRunning() string {
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, _ := n.kvctl("status", "--json")
		if strings.Contains(out, `"running": 1`) {
			return ""
		}
		if time.Now().After(deadline) {
			return out
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fastConfig writes a config that makes a hung peer's handshake give up
// after 2 s, and returns the -config flag for it.
func fastConfig(t *testing.T) []string {
	path := filepath.Join(t.TempDir(), "p2pd.json")
	if err := os.WriteFile(path, []byte(`{"handshake_timeout": "2s"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	return []string{"-config", path, "-model", "tiny"}
}

// waitLog waits until the node logged s.
func (n *node) waitLog(s string) {
	n.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(n.logs(), s) {
		if time.Now().After(deadline) {
			n.t.Fatalf("never logged %q:\n%s", s, n.logs())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// S5.3: a pause that times out returns an error (504, exit 1) and never
// hangs, and the node goes on running.
func TestPauseTimeout(t *testing.T) {
	n := start(t, fastConfig(t)...)
	done := inFlight(t, n, blackHole(t))
	out, code := n.kvctl("pause", "--timeout", "300ms")
	if code != 1 || !strings.Contains(out, "timed out") {
		t.Errorf("pause with a request running: exit %d, %q; want 1 and a timeout error", code, out)
	}
	if res := <-done; !strings.HasPrefix(res, "0 ") {
		t.Errorf("the request after a timed-out pause: %s", res)
	}
}

// S5.3: mode=abort aborts the running request, then pauses.
func TestPauseAbort(t *testing.T) {
	n := start(t, fastConfig(t)...)
	done := inFlight(t, n, blackHole(t))
	if out, code := n.kvctl("pause", "--mode", "abort", "--timeout", "10s"); code != 0 {
		t.Fatalf("pause abort: %d %s", code, out)
	}
	if res := <-done; !strings.HasPrefix(res, "1 ") || !strings.Contains(res, "aborted") {
		t.Errorf("the running request: %s; want it aborted", res)
	}
}

// S5.3, S5.4: mode=keep freezes the running request — it does not finish
// while paused, even once its peer gave up — and resume lets it finish.
func TestPauseKeepResume(t *testing.T) {
	n := start(t, fastConfig(t)...)
	done := inFlight(t, n, blackHole(t))
	if out, code := n.kvctl("pause", "--mode", "keep", "--timeout", "10s"); code != 0 {
		t.Fatalf("pause keep: %d %s", code, out)
	}
	n.waitLog("handshake timed out")
	select {
	case res := <-done:
		t.Fatalf("a frozen request finished while paused: %s", res)
	default:
	}
	if out, _ := n.kvctl("status", "--json"); !strings.Contains(out, `"running": 1`) {
		t.Errorf("status while frozen: %s", out)
	}
	if out, code := n.kvctl("resume"); code != 0 {
		t.Fatalf("resume: %d %s", code, out)
	}
	if res := <-done; !strings.HasPrefix(res, "0 ") {
		t.Errorf("the request after resume: %s", res)
	}
}

// S5.5: SIGTERM with a request in flight exits 0 once it finished.
func TestSigtermInFlight(t *testing.T) {
	n := start(t, fastConfig(t)...)
	done := inFlight(t, n, blackHole(t))
	n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-n.exited:
		n.exited <- err
		if err != nil {
			t.Errorf("exit after SIGTERM: %v\n%s", err, n.logs())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("p2pd did not exit")
	}
	<-done
	if !strings.Contains(n.logs(), "msg=stopped") {
		t.Errorf("no clean stop in the log:\n%s", n.logs())
	}
}

// S8.3: bad parameters get 400 with a message; the admin socket is 0600.
func TestAdminAPI(t *testing.T) {
	n := start(t)
	fi, err := os.Stat(n.admin)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("admin socket mode %v (%v), want 0600", fi.Mode().Perm(), err)
	}
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", n.admin)
	}}}
	for _, tc := range []struct {
		method, path, body string
		code               int
	}{
		{"POST", "/v0/requests", `{}`, 400},
		{"POST", "/v0/requests", `{"seed": 1, "tokens": 0}`, 400},
		{"POST", "/v0/requests", `{"prompt_token_ids": [1], "seed": 1, "tokens": 5}`, 400},
		{"POST", "/v0/requests", `{"nope": 1}`, 400},
		{"POST", "/v0/requests", `{"seed": 1, "tokens": 32, "kv_transfer_params": {"remote_kv_source": {"kv_request_id": "x"}}}`, 400},
		{"POST", "/v0/pause?mode=sometimes", ``, 400},
		{"POST", "/v0/pause?timeout=soon", ``, 400},
		{"POST", "/v0/pause?color=red", ``, 400},
		{"POST", "/v0/shutdown?grace=-1s", ``, 400},
		{"POST", "/v0/resume", ``, 409},
		{"GET", "/v0/health", ``, 200},
		{"GET", "/debug/vars", ``, 200},
		{"POST", "/v0/requests", `{"seed": 1, "tokens": 48}`, 200},
		{"POST", "/v0/requests", `{"seed": 2, "tokens": 48, "kv_digest": "md5"}`, 400},
		{"POST", "/v0/requests", `{"seed": 2, "tokens": 48, "kv_digest": "crc32c"}`, 200},
		{"POST", "/v0/scrub", ``, 200},
	} {
		req, _ := http.NewRequest(tc.method, "http://p2pd"+tc.path, strings.NewReader(tc.body))
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body map[string]any
		json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if resp.StatusCode != tc.code {
			t.Errorf("%s %s %s: %d %v, want %d", tc.method, tc.path, tc.body, resp.StatusCode, body, tc.code)
		}
		if tc.code == 400 && body["error"] == "" {
			t.Errorf("%s %s: 400 without an error message", tc.method, tc.path)
		}
		if tc.path == "/v0/health" && body["ok"] != true {
			t.Errorf("health %v, want ok", body)
		}
		if tc.path == "/v0/scrub" && (body["checked"] != float64(6) || body["mismatched"] != float64(0)) {
			t.Errorf("scrub %v, want the 6 stored blocks checked, none mismatched", body)
		}
	}
	if out, code := n.kvctl("scrub"); code != 0 || !strings.Contains(out, "scrubbed 6 blocks") {
		t.Errorf("kvctl scrub: %d %q", code, out)
	}
}

// S5.5: SIGTERM to a producer while a consumer fetches from it: the
// producer exits 0, and the consumer's request still answers with the
// same KV (fetched, or recomputed where the fetch was cut).
func TestSigtermDuringFetch(t *testing.T) {
	big := []string{"-cpu-slots", "2200", "-gpu-blocks", "2100"}
	prod, cons := start(t, big...), start(t, big...)
	want, out, code := prod.submit("--tokens-seed", "11", "--tokens", "32000")
	if code != 0 {
		t.Fatalf("producer: %d %s", code, out)
	}
	done := make(chan string, 1)
	go func() {
		r, out, code := cons.submit("--tokens-seed", "11", "--tokens", "32000", "--remote-kv-source", prod.p2p, "--kv-request-id", "kv-term")
		if code != 0 {
			done <- fmt.Sprintf("exit %d: %s", code, out)
			return
		}
		if r.KVDigest != want.KVDigest {
			done <- fmt.Sprintf("digest %s, want %s (sources %+v)", r.KVDigest, want.KVDigest, r.Sources)
			return
		}
		done <- ""
	}()
	cons.waitRunning() // or not yet: the test holds either way
	prod.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-prod.exited:
		prod.exited <- err
		if err != nil {
			t.Errorf("producer exit: %v\n%s", err, prod.logs())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the producer did not exit")
	}
	if msg := <-done; msg != "" {
		t.Errorf("consumer request: %s\n%s", msg, cons.logs())
	}
}

// S6.8: a consumer killed (SIGKILL) while it fetches from a producer: the
// producer notices the dead peer, keeps running, and serves the same
// prompt to a new consumer, whose KV matches.
func TestConsumerKilledDuringFetch(t *testing.T) {
	big := []string{"-cpu-slots", "2200", "-gpu-blocks", "2100"}
	prod, cons := start(t, big...), start(t, big...)
	want, out, code := prod.submit("--tokens-seed", "12", "--tokens", "32000")
	if code != 0 {
		t.Fatalf("producer: %d %s", code, out)
	}
	fetch := exec.Command(filepath.Join(bin, "kvctl"), "-admin", cons.admin, "submit", "--tokens-seed", "12", "--tokens", "32000",
		"--remote-kv-source", prod.p2p, "--kv-request-id", "kv-kill")
	if err := fetch.Start(); err != nil {
		t.Fatal(err)
	}
	defer fetch.Wait() // it fails once its daemon is gone
	cons.waitRunning() // or not yet: the test holds either way
	cons.cmd.Process.Kill()
	err := <-cons.exited
	cons.exited <- err
	again := start(t, big...)
	r, out, code := again.submit("--tokens-seed", "12", "--tokens", "32000", "--remote-kv-source", prod.p2p, "--kv-request-id", "kv-again")
	if code != 0 {
		t.Fatalf("second consumer: %d %s\nproducer:\n%s", code, out, prod.logs())
	}
	if r.KVDigest != want.KVDigest || r.Sources.Peer == 0 {
		t.Errorf("second consumer: digest equal %v, %d blocks from the peer (%+v); want the same KV, fetched",
			r.KVDigest == want.KVDigest, r.Sources.Peer, r.Sources)
	}
	select {
	case err := <-prod.exited:
		t.Fatalf("the producer exited: %v\n%s", err, prod.logs())
	default:
	}
}

// S5.5: a second signal during the shutdown drain exits at once, non-zero.
func TestSecondSignal(t *testing.T) {
	n := start(t, fastConfig(t)...)
	done := inFlight(t, n, blackHole(t))
	n.cmd.Process.Signal(syscall.SIGTERM)
	n.waitLog("shutting down")
	n.cmd.Process.Signal(syscall.SIGINT)
	select {
	case err := <-n.exited:
		n.exited <- err
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 1 {
			t.Errorf("exit after a second signal: %v, want status 1", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a second signal did not end p2pd")
	}
	<-done
}

// Issue 15: a fetch_only request (kvctl submit --fetch-only) loads what
// its peer holds of the prompt and computes nothing — how a cache node
// takes a prefix from a vLLM instance without storing its own engine's
// stand-in KV. The fetched blocks stay in the CPU tier (a later request
// finds them there); a prompt nobody holds is missed, and nothing of it is
// stored.
func TestFetchOnly(t *testing.T) {
	prod, cons := start(t), start(t)
	want, out, code := prod.submit("--tokens-seed", "21", "--tokens", "200")
	if code != 0 {
		t.Fatalf("producer: %d %s", code, out)
	}
	got, out, code := cons.submit("--tokens-seed", "21", "--tokens", "200", "--remote-kv-source", prod.p2p, "--kv-request-id", "kv-f", "--fetch-only")
	if code != 0 || got.Sources.Peer != 12 || got.Sources.Computed != 0 || got.Sources.Missed != 0 || got.KVDigest != want.KVDigest {
		t.Fatalf("fetch_only from the producer: %d %s; want 12 blocks from the peer, none computed, the producer's digest", code, out)
	}
	if again, out, _ := cons.submit("--tokens-seed", "21", "--tokens", "200"); again.Sources.CPU != 12 {
		t.Errorf("the fetched blocks are not in the consumer's CPU tier: %s", out)
	}
	none, out, code := cons.submit("--tokens-seed", "22", "--tokens", "200", "--remote-kv-source", prod.p2p, "--kv-request-id", "kv-g", "--fetch-only")
	if code != 0 || none.Sources.Missed != 12 || none.Sources.Computed != 0 {
		t.Fatalf("fetch_only of a prompt nobody holds: %d %s; want 12 missed, none computed", code, out)
	}
	if text, _ := cons.kvctl("submit", "--tokens-seed", "22", "--tokens", "200", "--fetch-only"); !strings.Contains(text, "missed 12") {
		t.Errorf("kvctl's line does not say what was missed: %s", text)
	}
	if later, out, _ := cons.submit("--tokens-seed", "22", "--tokens", "200"); later.Sources.Computed != 12 {
		t.Errorf("a fetch_only request stored blocks it did not fetch: %s", out)
	}
}

// engine.Config.LoadWindow over a real peer: a consumer with a window of 5
// blocks fetches a 12-block prompt in three rounds of one request (5, 5
// and 2 blocks, each a lookup and a fetch), loading each part while the
// next arrives; the answer is the producer's, and so is a fetch_only one.
func TestFetchInWindows(t *testing.T) {
	prod, cons := start(t), start(t, "-load-window", "5")
	fetch(t, prod, cons, 23, "kv-w")
	if n := cons.metric("kv_offload_p2p_rounds_ok_total"); n != 3 {
		t.Errorf("the consumer loaded %v rounds, want 3 (12 blocks in windows of 5)", n)
	}
	want, out, code := prod.submit("--tokens-seed", "24", "--tokens", "200")
	if code != 0 {
		t.Fatalf("producer: %d %s", code, out)
	}
	got, out, code := cons.submit("--tokens-seed", "24", "--tokens", "200", "--remote-kv-source", prod.p2p, "--kv-request-id", "kv-w2", "--fetch-only")
	if code != 0 || got.Sources.Peer != 12 || got.Sources.Missed != 0 || got.KVDigest != want.KVDigest {
		t.Fatalf("fetch_only in windows: %d %s; want 12 blocks from the peer, the producer's digest", code, out)
	}
}
