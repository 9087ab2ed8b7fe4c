package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/ctl"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
	p2pdnode "github.com/kvtier/kvtier/p2pd/node"
)

// eventSet is a follower's view of the CPU tier, rebuilt from events.
type eventSet struct {
	keys map[string]bool
	last uint64
	lost int
}

func (s *eventSet) apply(e api.Event) {
	switch {
	case e.Kind == "lost":
		s.lost++
	case e.Tier != "cpu":
	case e.Kind == "stored":
		for _, k := range e.Keys {
			s.keys[k] = true
		}
	case e.Kind == "removed":
		for _, k := range e.Keys {
			delete(s.keys, k)
		}
	case e.Kind == "cleared":
		clear(s.keys)
	}
	s.last = e.Seq
}

// Issue 14, S2.8: a client that follows /v0/events (Go's HTTP client over
// the admin socket) from the start while requests run — enough of them to
// evict, and a cache reset among them — rebuilds exactly the node's
// /v0/blocks listing; the stream's numbers run without a gap; the stream
// ends cleanly when the node shuts down.
func TestEventsRebuildBlocks(t *testing.T) {
	n := start(t, "-cpu-slots", "24")
	c := ctl.New(n.admin, "")
	events := make(chan api.Event, 1024)
	ended := make(chan error, 1)
	var zero uint64
	go func() {
		ended <- c.Events(context.Background(), &zero, true, func(e api.Event) error { events <- e; return nil })
		close(events)
	}()
	for i := range 6 {
		if _, out, code := n.submit("--tokens-seed", strconv.Itoa(i), "--tokens", "160"); code != 0 {
			t.Fatalf("request %d: %s", i, out)
		}
		if i == 2 {
			if out, code := n.kvctl("reset-cache"); code != 0 {
				t.Fatalf("reset-cache: %s", out)
			}
		}
	}
	keys, seq, err := c.AllBlocks(context.Background(), "cpu")
	if err != nil {
		t.Fatal(err)
	}
	got := &eventSet{keys: map[string]bool{}}
	var kinds []string
	deadline := time.After(10 * time.Second)
	for got.last < seq {
		select {
		case e := <-events:
			if got.last == 0 {
				got.last = e.Seq - 1 // numbers start at the node's start time (docs/operations.md)
			}
			if e.Seq != got.last+1 {
				t.Fatalf("event %d after %d: a gap", e.Seq, got.last)
			}
			if !slices.Contains(kinds, e.Kind) {
				kinds = append(kinds, e.Kind)
			}
			got.apply(e)
		case <-deadline:
			t.Fatalf("the stream reached event %d, the listing is at %d", got.last, seq)
		}
	}
	if want := slices.Sorted(slices.Values(keys)); !slices.Equal(slices.Sorted(maps.Keys(got.keys)), want) || got.lost != 0 {
		t.Errorf("rebuilt from events (%d lost markers): %d keys; /v0/blocks: %d keys at event %d", got.lost, len(got.keys), len(keys), seq)
	}
	slices.Sort(kinds)
	if fmt.Sprint(kinds) != "[cleared removed stored]" {
		t.Errorf("event kinds %v, want stored, removed (evictions) and cleared (the reset)", kinds)
	}
	if len(keys) != 24 {
		t.Errorf("the listing holds %d keys, want the full CPU tier of 24", len(keys))
	}
	n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-ended:
		if err != nil {
			t.Errorf("the stream ended with %v, want a clean end", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the event stream did not end when the node shut down")
	}
}

// Issue 14: kvroute follows two real nodes; a prompt computed on a is
// routed to a for a request sent to b, and b's fetch with the router's
// remote_kv_source comes from the peer; once a evicted the prefix the
// router stops naming it. kvroute ends cleanly on SIGTERM.
func TestRouterFollowsEviction(t *testing.T) {
	a, b := start(t, "-node-id", "a", "-cpu-slots", "16"), start(t, "-node-id", "b")
	router := startRouter(t, "-node", "a="+a.admin, "-node", "b="+b.admin)
	prompt := nodeTokens(7, 192) // 12 blocks
	if _, out, code := a.submit("--tokens-seed", "7", "--tokens", "192"); code != 0 {
		t.Fatalf("prefill on a: %s", out)
	}
	choice := router.wait(t, prompt, "b", func(c routeAnswer) bool { return c.Node == "a" && c.Blocks == 12 })
	src, _ := json.Marshal(choice.Source)
	if !strings.Contains(string(src), `"remote_host":"127.0.0.1"`) || choice.Of != 12 {
		t.Errorf("the router's answer %+v: want a remote_kv_source on loopback for 12 of 12 blocks", choice)
	}
	got, out, code := b.submit("--tokens-seed", "7", "--tokens", "192", "--remote-kv-source", choice.P2P, "--kv-request-id", "kv-7")
	if code != 0 || got.Sources.Peer != 12 {
		t.Fatalf("b's request with the router's source %s: %d %s", choice.P2P, code, out)
	}
	// a holds 16 blocks: another 12-block prompt evicts the first's head.
	if _, out, code := a.submit("--tokens-seed", "8", "--tokens", "192"); code != 0 {
		t.Fatalf("second prefill on a: %s", out)
	}
	router.wait(t, prompt, "b", func(c routeAnswer) bool { return c.Node != "a" })
	router.wait(t, nodeTokens(8, 192), "b", func(c routeAnswer) bool { return c.Node == "a" && c.Blocks == 12 })
	// b fetched all 12: routed for a request to a, b is the source.
	router.wait(t, prompt, "a", func(c routeAnswer) bool { return c.Node == "b" && c.Blocks == 12 })
}

func nodeTokens(seed uint64, n int) []uint32 { return p2pdnode.SeededTokens(seed, n) }

type routeAnswer struct {
	Node, P2P  string
	Blocks, Of int
	Source     map[string]any `json:"remote_kv_source"`
}

type routerProc struct {
	addr string
}

var routerReadyRE = regexp.MustCompile(`kvroute: ready.* listen=(\S+)`)

// startRouter runs kvroute and waits for its ready line; it is stopped
// with SIGTERM at the end of the test and must exit 0.
func startRouter(t *testing.T, args ...string) *routerProc {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, "kvroute"), append([]string{"-listen", "127.0.0.1:0"}, args...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready, exited := make(chan string, 1), make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if m := routerReadyRE.FindStringSubmatch(sc.Text()); m != nil {
				ready <- m[1]
			}
		}
		exited <- cmd.Wait()
	}()
	r := &routerProc{}
	select {
	case r.addr = <-ready:
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatal("kvroute not ready")
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("kvroute exited with %v", err)
			}
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			t.Error("kvroute did not stop on SIGTERM")
		}
	})
	return r
}

// wait asks POST /route until ok, for at most 10 s (the router's view
// follows the streams).
func (r *routerProc) wait(t *testing.T, prompt []uint32, except string, ok func(routeAnswer) bool) routeAnswer {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"prompt_token_ids": prompt, "except": except, "kv_request_id": "kv"})
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Post("http://"+r.addr+"/route", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		var c routeAnswer
		err = json.NewDecoder(resp.Body).Decode(&c)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if ok(c) {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("the router still answers %+v", c)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Issue 15: `kvctl keys` prints a node's block keys for a prompt. In
// vLLM's scheme (-hash-algo vllm-sha256-cbor, vLLM's default seed) they
// are the block hashes Python's cbor2 and hashlib compute as vLLM's
// sha256_cbor does; in kvtier's they are offload's. status shows the
// block size and scheme a peer must match.
func TestKeysAsVLLM(t *testing.T) {
	py := "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import cbor2").Run(); err != nil {
		t.Skip("python3-cbor2 is not installed (.ci/run installs it)")
	}
	vllm := start(t, "-hash-algo", "vllm-sha256-cbor", "-hash-seed", "vllm-none-hash")
	tokens := p2pdnode.SeededTokens(3, 16*4+7)
	file := filepath.Join(t.TempDir(), "tokens.txt")
	var txt []string
	for _, tok := range tokens {
		txt = append(txt, strconv.Itoa(int(tok)))
	}
	if err := os.WriteFile(file, []byte(strings.Join(txt, " ")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, code := vllm.kvctl("keys", "--tokens-file", file)
	if code != 0 {
		t.Fatalf("kvctl keys: %d %s", code, out)
	}
	js, _ := json.Marshal(tokens)
	want, err := exec.Command(py, "-c", `
import sys, json, hashlib, cbor2
h = lambda o: hashlib.sha256(cbor2.dumps(o, canonical=True)).digest()
toks, parent = json.loads(sys.argv[1]), h("vllm-none-hash")
for i in range(len(toks) // 16):
    parent = h((parent, tuple(toks[i*16:(i+1)*16]), None))
    print(parent.hex())
`, string(js)).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, want)
	}
	if strings.Fields(out) == nil || !slices.Equal(strings.Fields(out), strings.Fields(string(want))) {
		t.Errorf("kvctl keys (vLLM scheme):\n%s\ncbor2:\n%s", out, want)
	}
	st, _ := vllm.kvctl("status", "--json")
	if !strings.Contains(st, `"block_bytes": 8192`) || !strings.Contains(st, `"hash_algo": "vllm-sha256-cbor"`) {
		t.Errorf("status %s: want block_bytes and hash_algo", st)
	}
	native := start(t)
	out, _ = native.kvctl("keys", "--tokens-file", file)
	var kv []string
	for _, k := range offload.BlockKeys(offload.DefaultHashSeed, 16, tokens) {
		kv = append(kv, hex.EncodeToString(k[:]))
	}
	if !slices.Equal(strings.Fields(out), kv) {
		t.Errorf("kvctl keys (kvtier scheme) %s, want offload's %v", out, kv)
	}
}

// Issue 15: with vLLM's keys, the node publishes its events as vLLM's
// KV-events publisher does — ZMQ PUB, [topic, 8-byte sequence, msgpack
// batch] — and a libzmq SUB decoding them as vLLM's consumers do sees
// BlockStored with vLLM's block hashes (the low 64 bits, vLLM's default),
// the parent of a later block, the token ids; BlockRemoved for evictions;
// AllBlocksCleared for a reset; sequence numbers without a gap (the
// subscriber asserts it; how events fall into batches is timing).
func TestKVEventsAsVLLM(t *testing.T) {
	py := "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import zmq, msgpack").Run(); err != nil {
		t.Skip("python3-zmq or python3-msgpack is not installed (.ci/run installs them)")
	}
	n := start(t, "-hash-algo", "vllm-sha256-cbor", "-hash-seed", "vllm-none-hash", "-cpu-slots", "8",
		"-kv-events-endpoint", "127.0.0.1:0", "-kv-events-topic", "kv@n1")
	var st api.Status
	out, _ := n.kvctl("status", "--json")
	if err := json.Unmarshal([]byte(out), &st); err != nil || st.KVEvents == "" {
		t.Fatalf("status %s: %v", out, err)
	}
	sub := exec.Command(py, "testdata/kvevents_sub.py", st.KVEvents, "kv@n1", "2")
	stdout, _ := sub.StdoutPipe()
	sub.Stderr = os.Stderr
	if err := sub.Start(); err != nil {
		t.Fatal(err)
	}
	defer sub.Wait()
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "ready" {
		t.Fatalf("the subscriber said %q", lines.Text())
	}
	deadline := time.Now().Add(10 * time.Second)
	for st.KVEventsSubscribers == 0 { // libzmq subscribes asynchronously
		if time.Now().After(deadline) {
			t.Fatal("the subscriber never subscribed")
		}
		time.Sleep(10 * time.Millisecond)
		out, _ = n.kvctl("status", "--json")
		json.Unmarshal([]byte(out), &st)
	}
	scheme := offload.KeyScheme{Algo: offload.HashVLLMSHA256CBOR, Seed: "vllm-none-hash"}
	low := func(k offload.Key) string { return strconv.FormatUint(binary.BigEndian.Uint64(k[24:]), 10) }
	first := scheme.Keys(16, p2pdnode.SeededTokens(3, 64))
	second := scheme.Keys(16, p2pdnode.SeededTokens(4, 96))
	for _, seed := range []string{"3", "4"} {
		if _, out, code := n.submit("--tokens-seed", seed, "--tokens", map[string]string{"3": "64", "4": "96"}[seed]); code != 0 {
			t.Fatalf("request: %s", out)
		}
	}
	if out, code := n.kvctl("reset-cache"); code != 0 {
		t.Fatal(out)
	}
	// A prompt whose prefix is cached stores its new blocks only, under
	// the parent of the first.
	for _, tokens := range []string{"64", "96"} {
		if _, out, code := n.submit("--tokens-seed", "3", "--tokens", tokens); code != 0 {
			t.Fatalf("request: %s", out)
		}
	}
	if out, code := n.kvctl("reset-cache"); code != 0 {
		t.Fatal(out)
	}
	longer := scheme.Keys(16, p2pdnode.SeededTokens(3, 96))
	var got []string
	for lines.Scan() && lines.Text() != "end" {
		got = append(got, lines.Text())
	}
	join := func(ks []offload.Key) string {
		var s []string
		for _, k := range ks {
			s = append(s, low(k))
		}
		return strings.Join(s, ",")
	}
	want := []string{
		"BlockStored medium=CPU hashes=" + join(first) + " parent=None tokens=64 block_size=16",
		"BlockRemoved medium=CPU hashes=" + join(first[:2]),
		"BlockStored medium=CPU hashes=" + join(second) + " parent=None tokens=96 block_size=16",
		"AllBlocksCleared",
		"BlockStored medium=CPU hashes=" + join(first) + " parent=None tokens=64 block_size=16",
		"BlockStored medium=CPU hashes=" + join(longer[4:]) + " parent=" + low(longer[3]) + " tokens=32 block_size=16",
		"AllBlocksCleared",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("the subscriber decoded:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
