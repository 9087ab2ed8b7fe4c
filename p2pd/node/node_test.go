package node

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
)

// syncBuffer is a log sink safe for the node's goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// testConfig is a small node on loopback with host copies and its admin
// socket in dir.
func testConfig(dir string) Config {
	c := DefaultConfig()
	c.Geometry = offload.Geometries["tiny"]
	c.CPUHugePages = false
	c.CPUSlots, c.GPUBlocks = 64, 32
	c.Listen = "127.0.0.1:0"
	c.CopyBackend = "host"
	c.TierPollInterval = offload.Duration(time.Millisecond)
	c.Admin = filepath.Join(dir, "a.sock")
	return c
}

// startNode starts a node and shuts it down at the end of the test; the
// test fails if goroutines are left behind (bounded by a 5 s deadline).
func startNode(t *testing.T, cfg Config) (*Node, *syncBuffer) {
	t.Helper()
	noLeak(t)
	logs := &syncBuffer{}
	n, err := Start(cfg, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { n.Shutdown(canceled()) })
	return n, logs
}

func noLeak(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for runtime.NumGoroutine() > before {
			if time.Now().After(deadline) {
				t.Errorf("%d goroutines left, %d before", runtime.NumGoroutine(), before)
				return
			}
			runtime.Gosched()
		}
	})
}

// status asks the admin socket at path for GET /v0/status.
func status(t *testing.T, path string) (api.Status, error) {
	t.Helper()
	tr := &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", path)
	}}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Get("http://p2pd/v0/status")
	if err != nil {
		return api.Status{}, err
	}
	defer resp.Body.Close()
	var s api.Status
	return s, json.NewDecoder(resp.Body).Decode(&s)
}

// S8.3: a second daemon given a live daemon's admin path refuses to
// start and leaves the socket alone; a daemon never removes a regular
// file at its admin path; each removes only its own socket on exit.
func TestAdminSocketNotTakenOver(t *testing.T) {
	cfg := testConfig(t.TempDir())
	first, _ := startNode(t, cfg)
	if _, err := Start(cfg, slog.New(slog.DiscardHandler)); !errors.Is(err, ErrAdminInUse) || !strings.Contains(err.Error(), "admin") {
		t.Errorf("second Start on a live admin socket: %v, want ErrAdminInUse", err)
	}
	if s, err := status(t, cfg.Admin); err != nil || s.Node != first.P2P.NodeID() {
		t.Errorf("the first daemon no longer answers on its socket: %+v, %v", s, err)
	}
	first.Shutdown(canceled())
	if _, err := os.Lstat(cfg.Admin); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the socket survived its daemon's exit: %v", err)
	}

	file := testConfig(t.TempDir())
	if err := os.WriteFile(file.Admin, []byte("precious"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Start(file, slog.New(slog.DiscardHandler)); !errors.Is(err, offload.ErrConfig) || !strings.Contains(err.Error(), "admin") {
		t.Errorf("Start over a regular file: %v, want ErrConfig naming admin", err)
	}
	if b, err := os.ReadFile(file.Admin); err != nil || string(b) != "precious" {
		t.Errorf("the file at the admin path is now %q, %v", b, err)
	}
}

// S6.1: without a token the node warns that its P2P port is
// unauthenticated and status says p2p_auth "none"; with a token file it
// does not and says "token"; an empty or unreadable token file is a
// start-up error naming cluster_token_file.
func TestClusterTokenFile(t *testing.T) {
	const warning = "the P2P port is unauthenticated"
	dir := t.TempDir()
	for _, tc := range []struct {
		name, content string // content "" with a file name: the file is empty
		file          bool
		auth          string
	}{
		{"no token", "", false, "none"},
		{"token", "  s3cret\n", true, "token"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t.TempDir())
			if tc.file {
				cfg.ClusterTokenFile = filepath.Join(dir, "token")
				if err := os.WriteFile(cfg.ClusterTokenFile, []byte(tc.content), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			n, logs := startNode(t, cfg)
			if got := strings.Contains(logs.String(), warning); got != (tc.auth == "none") {
				t.Errorf("warning logged: %v, want %v; logs:\n%s", got, tc.auth == "none", logs)
			}
			if s, err := status(t, cfg.Admin); err != nil || s.P2PAuth != tc.auth {
				t.Errorf("status p2p_auth %q (%v), want %q", s.P2PAuth, err, tc.auth)
			}
			if tc.file && n.cfg.ClusterToken != "s3cret" {
				t.Errorf("token %q, want it trimmed", n.cfg.ClusterToken)
			}
		})
	}
	for name, path := range map[string]string{
		"empty":       filepath.Join(dir, "empty"),
		"white space": filepath.Join(dir, "blank"),
		"missing":     filepath.Join(dir, "missing"),
		"directory":   dir,
	} {
		t.Run(name, func(t *testing.T) {
			os.WriteFile(filepath.Join(dir, "empty"), nil, 0o600)
			os.WriteFile(filepath.Join(dir, "blank"), []byte(" \n\t\n"), 0o600)
			cfg := testConfig(t.TempDir())
			cfg.ClusterTokenFile = path
			n, err := Start(cfg, slog.New(slog.DiscardHandler))
			if err == nil {
				n.Shutdown(canceled())
			}
			if !errors.Is(err, offload.ErrConfig) || !strings.Contains(err.Error(), "cluster_token_file") {
				t.Errorf("Start: %v, want ErrConfig naming cluster_token_file", err)
			}
		})
	}
}

// S9: errors in the config file name their key, durations of the P2P
// tier and of the manager included; anything after the object is
// rejected.
func TestLoadConfigErrors(t *testing.T) {
	for in, want := range map[string]string{
		`{"hit_pending_timeout": "5x"}`:           `offload: bad config: hit_pending_timeout: "5x" is not a duration`,
		`{"pin_hold": 30}`:                        `pin_hold: 30 is not a duration`,
		`{"shutdown_grace": "later"}`:             `shutdown_grace: "later" is not a duration`,
		`{"gpu_blocks": "many"}`:                  `gpu_blocks: want int, have a JSON string`,
		`{"gpu_blocks": 8} {"gpu_blocks": 9}`:     `trailing data`,
		`{"gpu_blocks": 8} x`:                     `trailing data`,
		`{"gpu_blocks": 8}}`:                      `trailing data`,
		"{\"gpu_blocks\": 8}\n\n{\"admin\": 1}\n": `trailing data`,
	} {
		_, err := LoadConfig(strings.NewReader(in))
		if !errors.Is(err, offload.ErrConfig) || !strings.Contains(err.Error(), want) {
			t.Errorf("LoadConfig(%s) = %v, want ErrConfig with %q", in, err, want)
		}
	}
	if c, err := LoadConfig(strings.NewReader("{\"gpu_blocks\": 8, \"lookup_hold\": \"2s\"}\n \t\n")); err != nil || c.GPUBlocks != 8 || c.LookupHold != offload.Duration(2*time.Second) {
		t.Errorf("white space after the object: %+v, %v", c, err)
	}
}

// post runs POST /v0/requests on n's handler with body.
func post(n *Node, body []byte) (int, string) {
	w := httptest.NewRecorder()
	n.mux().ServeHTTP(w, httptest.NewRequest("POST", "/v0/requests", bytes.NewReader(body)))
	return w.Code, w.Body.String()
}

// S8.3: request bodies are rejected with trailing data; a bad
// remote_kv_source is a 400 naming the field (the API used to accept a
// port the tier then ignored); prompt_token_ids holds integers only.
func TestRequestBodyRejected(t *testing.T) {
	cfg := testConfig(t.TempDir())
	n, _ := startNode(t, cfg)
	src := func(port string) string {
		return `{"seed": 1, "tokens": 32, "kv_transfer_params": {"remote_kv_source": {"kv_request_id": "k", "remote_host": "127.0.0.1", "remote_port": ` + port + `}}}`
	}
	for _, tc := range []struct {
		body string
		code int
		want string // in the error
	}{
		{``, 400, "body: empty"},
		{`{"seed": 1, "tok`, 400, "ends early"},
		{`{"seed": 1, "tokens": 32} {"seed": 2}`, 400, "trailing data"},
		{`{"seed": 1, "tokens": 32} x`, 400, "trailing data"},
		{src(`"99999"`), 400, "remote_port"},
		{src(`99999`), 400, "remote_port"},
		{src(`{"n": 1}`), 400, "remote_port"},
		{src(`80.5`), 400, "remote_port"},
		{src(`1e3`), 400, "remote_port"},
		{`{"seed": 1, "tokens": 32, "kv_transfer_params": {"remote_kv_source": {"kv_request_id": "k", "remote_port": 1}}}`, 400, "remote_host"},
		{`{"seed": 1, "tokens": 32, "kv_transfer_params": {"remote_kv_source": {"remote_host": "h", "remote_port": 1}}}`, 400, "kv_request_id"},
		{`{"seed": 1, "tokens": 32, "kv_transfer_params": {"remote_kv_source": 5}}`, 400, "remote_kv_source"},
		{`{"seed": 1, "tokens": 32, "kv_transfer_params": 5}`, 400, "kv_transfer_params"},
		{`{"prompt_token_ids": [1, -2]}`, 400, "prompt_token_ids"},
		{`{"prompt_token_ids": [1, 2.5]}`, 400, "prompt_token_ids"},
		{`{"prompt_token_ids": [1, 4294967296]}`, 400, "prompt_token_ids"},
		{`{"prompt_token_ids": [1, "2"]}`, 400, "prompt_token_ids"},
		{`{"prompt_token_ids": 7}`, 400, "prompt_token_ids"},
		{`{"prompt_token_ids": []}`, 400, "give prompt_token_ids"},
		{"{\"prompt_token_ids\": [ 4294967295 ,0,\n1 ]}  \n", 200, ""},
		{`{"seed": 1, "tokens": 48, "kv_transfer_params": {"other": [1, 2]}}` + "\n", 200, ""},
	} {
		code, body := post(n, []byte(tc.body))
		if code != tc.code || !strings.Contains(body, tc.want) {
			t.Errorf("%s: %d %s, want %d with %q", tc.body, code, body, tc.code, tc.want)
		}
	}
}

// S8.3: a request body costs no more memory than a valid maximal one:
// it is read through a bounded reader, the prompt never grows past
// MaxTokens and kv_transfer_params past MaxTransferParamsBytes. Each
// hostile body below used to be decoded in full first (four 60 MB bodies
// peaked at 1.46 GB RSS). The limits are scaled down 64 times, with the
// same proportions, so that the race detector's run stays short.
func TestRequestBodyBounded(t *testing.T) {
	lim := limits{tokens: MaxTokens / 64, params: MaxTransferParamsBytes / 64}
	lim.body = int64(lim.tokens*len("4294967295,") + 16<<10)
	n := &Node{lim: lim} // every body here is rejected before the engine
	tokens := func(count int, id string) []byte {
		b := bytes.NewBufferString(`{"prompt_token_ids": [`)
		b.Grow(count * (len(id) + 1))
		for i := range count {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(id)
		}
		b.WriteString(`], "request_id": "` + strings.Repeat("r", 257) + `"}`)
		return b.Bytes()
	}
	cost := func(body []byte) (code int, alloc uint64) {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		defer func() {
			if recover() != nil {
				code = 0 // accepted: it reached the engine this test has not
			}
			runtime.ReadMemStats(&after)
			alloc = after.TotalAlloc - before.TotalAlloc
		}()
		code, _ = post(n, body)
		return code, 0
	}
	// The reference: the most ten-digit ids allowed, decoded in full and
	// rejected only afterwards (for its request_id).
	code, valid := cost(tokens(lim.tokens, "4294967295"))
	if code != 400 {
		t.Fatalf("reference body: %d", code)
	}
	params := bytes.NewBufferString(`{"seed": 1, "tokens": 32, "kv_transfer_params": {`)
	for i := 0; params.Len() < int(lim.body)-64; i++ {
		fmt.Fprintf(params, `"k%d": [0], `, i)
	}
	params.WriteString(`"end": 0}}`)
	for name, body := range map[string][]byte{
		"one token too many":             tokens(lim.tokens+1, "0"),
		"short ids up to the body limit": tokens(int(lim.body)/2-1000, "0"),
		"past the body limit":            tokens(int(lim.body)/2+1000, "0"),
		"kv_transfer_params":             params.Bytes(),
	} {
		code, got := cost(body)
		t.Logf("%s: %d bytes, %d, allocated %d KiB (valid maximal %d KiB)", name, len(body), code, got>>10, valid>>10)
		if code != 400 && code != 413 {
			t.Errorf("%s: %d, want it rejected", name, code)
		}
		if got > valid+64<<10 {
			t.Errorf("%s (%d bytes) allocated %d KiB, a valid maximal body %d KiB", name, len(body), got>>10, valid>>10)
		}
	}
}

// S8.1, S8.3: prompt_token_ids decodes exactly as encoding/json would
// decode a []uint32 (except that a null element is refused), and never
// more than its limit.
func FuzzTokenIDs(f *testing.F) {
	for _, s := range []string{`[1, 2, 3]`, `[]`, `null`, ` [ 0 ,4294967295 ] `, `[4294967296]`, `[-1]`, `[1.5]`, `[1e3]`,
		`["1"]`, `[null]`, `[[1]]`, `{}`, `7`, `[01]`, `[1,2,3,4,5,6,7,8,9]`, `[12345678901]`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		var std struct{ P []uint32 }
		stdErr := json.Unmarshal([]byte(`{"P":`+in+`}`), &std)
		got := struct{ P tokenIDs }{P: tokenIDs{max: 8}}
		err := json.Unmarshal([]byte(`{"P":`+in+`}`), &got)
		switch {
		case err == nil && stdErr != nil:
			t.Fatalf("%q accepted as %v; encoding/json: %v", in, got.P.ids, stdErr)
		case err == nil && len(got.P.ids) > 8:
			t.Fatalf("%q: %d ids past the limit of 8", in, len(got.P.ids))
		case err == nil && fmt.Sprint(got.P.ids) != fmt.Sprint(std.P):
			t.Fatalf("%q decoded as %v, encoding/json %v", in, got.P.ids, std.P)
		case err != nil && stdErr == nil && len(std.P) <= 8 && !strings.Contains(in, "null"):
			t.Fatalf("%q refused (%v); encoding/json: %v", in, err, std.P)
		}
	})
}

// The body clients send (api.Request) and the one the daemon decodes with
// its bounds (requestBody) name the same fields: a field renamed on one
// side only would be refused as unknown, or silently dropped.
func TestRequestBodyAgrees(t *testing.T) {
	names := func(v any) []string {
		var out []string
		rt := reflect.TypeOf(v)
		for i := range rt.NumField() {
			name, _, _ := strings.Cut(rt.Field(i).Tag.Get("json"), ",")
			out = append(out, name)
		}
		slices.Sort(out)
		return out
	}
	if got, want := names(requestBody{}), names(api.Request{}); !slices.Equal(got, want) {
		t.Errorf("the daemon decodes %v, clients send %v", got, want)
	}
	// And a body a client builds decodes.
	seed := uint64(7)
	b, err := json.Marshal(api.Request{RequestID: "r", Seed: &seed, Tokens: 32, Digest: "crc32c",
		TransferParams: map[string]any{"remote_kv_source": map[string]any{"kv_request_id": "x", "remote_host": "127.0.0.1", "remote_port": "1"}}})
	if err != nil {
		t.Fatal(err)
	}
	var rb requestBody
	rb.PromptTokenIDs.max, rb.TransferParams.max = 16, 1<<10
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rb); err != nil || rb.RequestID != "r" || *rb.Seed != 7 || rb.Tokens != 32 || rb.Digest != "crc32c" || rb.TransferParams.m == nil {
		t.Errorf("decoding %s: %+v, %v", b, rb, err)
	}
}

// S8.3: scrub and reset-cache take no parameters: an unknown one is a 400
// naming it, as on the other endpoints (they were ignored: a typo such as
// ?timeout=1s ran a full scrub as if it bounded it).
func TestScrubAndResetRejectParameters(t *testing.T) {
	n, _ := startNode(t, testConfig(t.TempDir()))
	for _, tc := range []struct {
		path string
		code int
	}{
		{"/v0/scrub?timeout=1s", 400},
		{"/v0/reset-cache?tier=cpu", 400},
		{"/v0/scrub", 200},
		{"/v0/reset-cache", 200},
	} {
		w := httptest.NewRecorder()
		n.mux().ServeHTTP(w, httptest.NewRequest("POST", tc.path, nil))
		if w.Code != tc.code || (tc.code == 400 && !strings.Contains(w.Body.String(), "takes none")) {
			t.Errorf("POST %s: %d %s, want %d", tc.path, w.Code, w.Body.String(), tc.code)
		}
	}
}

// S8.5: a client that disconnects while its request waits (the node is
// paused) withdraws it: the queue does not keep it for no one.
func TestDisconnectedClientWithdrawsRequest(t *testing.T) {
	cfg := testConfig(t.TempDir())
	n, _ := startNode(t, cfg)
	if err := n.Eng.Pause("wait", false, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", cfg.Admin)
	}}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://p2pd/v0/requests", strings.NewReader(`{"seed": 1, "tokens": 64}`))
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	waiting := func() int { _, w := n.Eng.Counts(); return w }
	deadline := time.Now().Add(5 * time.Second)
	for waiting() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the request was not queued")
		}
		runtime.Gosched()
	}
	cancel() // closes the connection
	if err := <-done; err == nil {
		t.Fatal("the cancelled request was answered")
	}
	for deadline = time.Now().Add(5 * time.Second); waiting() != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests still queued after their client left", waiting())
		}
		runtime.Gosched()
	}
	if err := n.Eng.Resume(); err != nil {
		t.Fatal(err)
	}
}

// A request that names no id gets the next free one: a client's own
// request holding the id the node would give (req-N) does not make it
// fail (found in review: it answered 400, "request exists").
func TestAutoIDSkipsTakenIDs(t *testing.T) {
	cfg := testConfig(t.TempDir())
	n, _ := startNode(t, cfg)
	if err := n.Eng.Pause("wait", false, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	n.ids.mu.Lock()
	taken := fmt.Sprintf("req-%d", n.ids.n+1) // the id the node gives next
	n.ids.mu.Unlock()
	post := func(body string) <-chan *httptest.ResponseRecorder {
		c := make(chan *httptest.ResponseRecorder, 1)
		go func() {
			w := httptest.NewRecorder()
			n.mux().ServeHTTP(w, httptest.NewRequest("POST", "/v0/requests", strings.NewReader(body)))
			c <- w
		}()
		return c
	}
	waitQueued := func(want int) {
		for deadline := time.Now().Add(5 * time.Second); ; runtime.Gosched() {
			if _, w := n.Eng.Counts(); w == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d requests not queued", want)
			}
		}
	}
	own := post(`{"seed": 1, "tokens": 64, "request_id": "` + taken + `"}`)
	waitQueued(1)
	auto := post(`{"seed": 2, "tokens": 64}`)
	waitQueued(2)
	if err := n.Eng.Resume(); err != nil { // both start in one loop turn: the client's first
		t.Fatal(err)
	}
	for name, c := range map[string]<-chan *httptest.ResponseRecorder{"the client's": own, "the unnamed": auto} {
		if w := <-c; w.Code != 200 {
			t.Errorf("%s request: %d %s, want 200", name, w.Code, w.Body.String())
		}
	}
	if m := n.M.Metrics(); m.Errors["request_exists"] != 0 {
		t.Errorf("%d requests refused as existing, want none (nobody misused the API)", m.Errors["request_exists"])
	}
	n.ids.mu.Lock()
	defer n.ids.mu.Unlock()
	if len(n.ids.inUse) != 0 {
		t.Errorf("ids still held after both requests ended: %v", n.ids.inUse)
	}
}
