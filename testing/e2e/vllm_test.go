package e2e

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/p2pd/api"
	p2pdnode "github.com/kvtier/kvtier/p2pd/node"
)

// vllmArgs run a node in vLLM's dialect with vLLM's keys.
func vllmArgs(plane string) []string {
	return []string{"-p2p-dialect", "vllm", "-data-plane", plane, "-hash-algo", "vllm-sha256-cbor", "-hash-seed", "vllm-none-hash"}
}

func (n *node) status() api.Status {
	n.t.Helper()
	out, code := n.kvctl("status", "--json")
	var st api.Status
	if err := json.Unmarshal([]byte(out), &st); code != 0 || err != nil {
		n.t.Fatalf("status: %d %s %v", code, out, err)
	}
	return st
}

// Issue 15: a live p2pd in vLLM's dialect against a vLLM G2 peer played
// over the real third-party parts — libzmq (python3-zmq) for ROUTER and
// DEALER framing, identities and heartbeats, python3-msgpack for the
// payloads, python3-cbor2 and hashlib for vLLM's sha256_cbor keys of the
// prompt the node computed. The peer (testdata/vllm_peer.py) asserts each
// answer: handshake, heartbeats answered, lookup hits in wire order, a
// fetch failing on data_plane none, abort, pins released by the terminal
// fetch (checked here), an unknown type dropped, a reconnect with the
// same identity; the node fetching from the peer (vLLM's keys and round on
// its lookup, its load failing unsent on none, the terminal fetch at its
// end); a mismatched block_len refused.
func TestVLLMPeerOverLibzmq(t *testing.T) {
	py := "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import zmq, msgpack, cbor2").Run(); err != nil {
		t.Skip("python3-zmq, python3-msgpack or python3-cbor2 is not installed (.ci/run installs them)")
	}
	n := start(t, vllmArgs("none")...)
	if _, out, code := n.submit("--tokens-seed", "7", "--tokens", "200"); code != 0 {
		t.Fatalf("submit: %d %s", code, out)
	}
	st := n.status()
	if st.P2PDialect != "vllm" || st.P2PDataPlane != "none" || st.P2PChecksums || st.P2PAuth != "none" {
		t.Errorf("status: dialect %q, data plane %q, checksums %v, auth %q", st.P2PDialect, st.P2PDataPlane, st.P2PChecksums, st.P2PAuth)
	}
	if out, _ := n.kvctl("status"); !strings.Contains(out, "P2P wire: vllm, data plane none, no blocks move") {
		t.Errorf("kvctl status does not name the wire:\n%s", out)
	}
	toks, _ := json.Marshal([][]uint32{p2pdnode.SeededTokens(7, 200), p2pdnode.SeededTokens(8, 200)})
	peer := exec.Command(py, "testdata/vllm_peer.py", n.p2p, strconv.Itoa(st.BlockBytes), string(toks))
	stdin, _ := peer.StdinPipe()
	stdout, _ := peer.StdoutPipe()
	peer.Stderr = os.Stderr
	if err := peer.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.Process.Kill(); peer.Wait() })
	lines := bufio.NewScanner(stdout)
	var steps []string
	for lines.Scan() {
		steps = append(steps, lines.Text())
		if from, ok := strings.CutPrefix(lines.Text(), "serve "); ok {
			steps[len(steps)-1] = "serve"
			if r, out, code := n.submit("--tokens-seed", "8", "--tokens", "200", "--remote-kv-source", from, "--kv-request-id", "kv-9"); code != 0 || r.Sources.Computed != 12 {
				t.Errorf("the node's request from the peer: %d %s; want 12 blocks recomputed (data_plane none)", code, out)
			}
			continue
		}
		switch lines.Text() {
		case "pinned 4":
			if got := n.status().CPUTier.Pinned; got != 4 {
				t.Errorf("%d CPU slots pinned after the peer's lookup of 4 blocks, want 4", got)
			}
		case "terminal":
			deadline := time.Now().Add(10 * time.Second)
			for n.status().CPUTier.Pinned != 0 {
				if time.Now().After(deadline) {
					t.Fatalf("the terminal fetch released no pins: %d pinned", n.status().CPUTier.Pinned)
				}
				time.Sleep(10 * time.Millisecond)
			}
		default:
			continue
		}
		stdin.Write([]byte("go on\n"))
	}
	err := peer.Wait()
	want := []string{"handshake", "heartbeats", "lookup 12", "fetch failed", "abort", "pinned 4", "terminal", "unknown type", "reconnect", "serve", "terminal from the node", "refused", "ok"}
	if err != nil || !slices.Equal(steps, want) {
		t.Fatalf("the vLLM peer: %v; steps %q, want %q\nnode log:\n%s", err, steps, want, n.logs())
	}
	if v := n.metric("kv_offload_p2p_handshake_rejects_total", "code", "block_size"); v != 1 {
		t.Errorf("block_size rejects %v, want 1", v)
	}
}

// Issue 15: two kvtier nodes speaking vLLM's dialect move blocks the way
// vLLM does — NIXL WRITEs into the consumer's slots with no notification
// and no checksum, completion by transfer_done — and the consumer's KV is
// the producer's. vLLM's wire has no other data plane, so this runs in a
// NIXL build (make test-nixl).
func TestVLLMDialectOverNIXL(t *testing.T) {
	if !slices.Contains(planeArgs, "nixl") {
		t.Skip("vLLM's data plane is NIXL: make test-nixl runs this")
	}
	prod, cons := start(t, vllmArgs("nixl")...), start(t, vllmArgs("nixl")...)
	fetch(t, prod, cons, 11, "kv-vllm")
	if t.Failed() {
		t.Logf("producer:\n%s\nconsumer:\n%s", prod.logs(), cons.logs())
	}
	if st := cons.status(); st.P2PDialect != "vllm" || st.P2PDataPlane != "nixl" || st.P2PChecksums {
		t.Errorf("status %+v", st)
	}
	if v := cons.metric("kv_offload_p2p_crc_errors_total"); v != 0 {
		t.Errorf("%v CRC errors on a wire without checksums", v)
	}
}

// Issue 15, outside CI: `make test-vllm VLLM_SRC=<a vLLM checkout>` runs
// vLLM's own P2P session, protocol and ZeroMQ control modules (G2),
// imported unchanged from the checkout by testing/vllmharness/harness.py,
// against live p2pd nodes in vLLM's dialect. vLLM as the consumer:
// handshake, lookup answered key by key, a load, the terminal fetch
// releasing the node's pins (checked here). vLLM as the producer: a
// node's lookups served by vLLM's ServerRole and a fake ParentManager,
// every store job and served request ended when the node's request
// finished. In a NIXL build with NIXL_PREFIX (make test-vllm … NIXL_PREFIX=…)
// blocks move through vLLM's NixlTransport both ways: vLLM fetches the
// producer's 12 blocks, a second node fetches them from vLLM, and its KV
// digest is the producer's; otherwise (data_plane none) the loads fail
// cleanly.
func TestVLLMHarness(t *testing.T) {
	src := os.Getenv("VLLM_SRC")
	if src == "" {
		t.Skip("VLLM_SRC (a vLLM checkout) is not set: make test-vllm VLLM_SRC=… runs this")
	}
	py := "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import zmq, msgpack, cbor2").Run(); err != nil {
		t.Fatal("the harness needs python3-zmq, python3-msgpack and python3-cbor2 (Debian packages)")
	}
	mode, env := "none", os.Environ()
	if slices.Contains(planeArgs, "nixl") {
		mode, env = "nixl", nixlPythonEnv(t)
	}
	prod := start(t, vllmArgs(mode)...)
	cons := prod
	if mode == "nixl" {
		cons = start(t, vllmArgs(mode)...)
	}
	want7, out, code := prod.submit("--tokens-seed", "7", "--tokens", "200")
	if code != 0 {
		t.Fatalf("submit: %d %s", code, out)
	}
	st := prod.status()
	js, _ := json.Marshal([][]uint32{p2pdnode.SeededTokens(7, 200), p2pdnode.SeededTokens(8, 200)})
	h := exec.Command(py, "../vllmharness/harness.py", src, mode, prod.p2p, strconv.Itoa(st.BlockBytes), st.HashSeed, string(js))
	h.Env = env
	stdin, _ := h.StdinPipe()
	stdout, _ := h.StdoutPipe()
	h.Stderr = os.Stderr
	if err := h.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Process.Kill(); h.Wait() })
	lines := bufio.NewScanner(stdout)
	var steps []string
	for lines.Scan() {
		line, ok := strings.CutPrefix(lines.Text(), "step ")
		if !ok {
			continue // UCX logs to stdout
		}
		steps = append(steps, line)
		switch {
		case line == "pinned 4":
			if got := prod.status().CPUTier.Pinned; got != 4 {
				t.Errorf("%d CPU slots pinned after vLLM's lookup of 4 blocks, want 4", got)
			}
		case line == "finished":
			deadline := time.Now().Add(10 * time.Second)
			for prod.status().CPUTier.Pinned != 0 {
				if time.Now().After(deadline) {
					t.Fatal("vLLM's finish_request released no pins")
				}
				time.Sleep(10 * time.Millisecond)
			}
		case strings.HasPrefix(line, "serve "):
			from := strings.TrimPrefix(line, "serve ")
			if mode == "nixl" { // the blocks vLLM fetched, from vLLM
				r, out, code := cons.submit("--tokens-seed", "7", "--tokens", "200", "--remote-kv-source", from, "--kv-request-id", "kv-9")
				if code != 0 || r.Sources.Peer != 12 || r.KVDigest != want7.KVDigest {
					t.Errorf("the second node's request from vLLM: %d %s; want 12 blocks from the peer and digest %s", code, out, want7.KVDigest)
				}
			} else {
				r, out, code := cons.submit("--tokens-seed", "8", "--tokens", "200", "--remote-kv-source", from, "--kv-request-id", "kv-9")
				if code != 0 || r.Sources.Computed != 12 {
					t.Errorf("the node's request from vLLM: %d %s; want 12 blocks recomputed (data_plane none)", code, out)
				}
			}
			continue
		default:
			continue
		}
		stdin.Write([]byte("go on\n"))
	}
	err := h.Wait()
	t.Logf("the harness's steps (%s): %q", mode, steps)
	load, served := "load failed", "served 6 "
	if mode == "nixl" {
		load, served = "load ok 12", "served 12 "
	}
	want := []string{"handshake", "lookup 12", load, "pinned 4", "finished", "serve", served, "ok"}
	if err != nil || len(steps) != len(want) {
		t.Fatalf("the harness: %v; steps %q\nnode log:\n%s", err, steps, prod.logs())
	}
	for i, w := range want {
		if !strings.HasPrefix(steps[i], w) {
			t.Errorf("step %d: %q, want %q", i, steps[i], w)
		}
	}
}

// nixlPythonEnv is the environment in which NIXL's Python bindings of the
// NIXL_PREFIX install load (vLLM's NixlTransport imports them).
func nixlPythonEnv(t *testing.T) []string {
	prefix := os.Getenv("NIXL_PREFIX")
	if prefix == "" {
		t.Fatal("a NIXL build runs the harness over NIXL: set NIXL_PREFIX (make test-vllm VLLM_SRC=… NIXL_PREFIX=…)")
	}
	lib := filepath.Join(prefix, "lib", "x86_64-linux-gnu")
	if _, err := os.Stat(lib); err != nil {
		lib = filepath.Join(prefix, "lib")
	}
	site, _ := filepath.Glob(filepath.Join(prefix, "lib", "python3*", "site-packages"))
	if len(site) == 0 {
		t.Fatalf("no NIXL Python bindings under %s/lib/python3*/site-packages (NIXL builds them with pybind11-dev installed: docs/nixl.md)", prefix)
	}
	env := append(os.Environ(), "PYTHONPATH="+site[0], "LD_LIBRARY_PATH="+lib, "NIXL_PLUGIN_DIR="+filepath.Join(lib, "plugins"))
	cmd := exec.Command("/usr/bin/python3", "-c", "import numpy, nixl_cu12")
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("NIXL's Python bindings do not load (they need Debian's python3-numpy): %v\n%s", err, out)
	}
	return env
}
