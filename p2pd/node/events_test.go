package node

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
)

// get runs a GET against the node's API in process.
func get(n *Node, path string) (int, string) {
	w := httptest.NewRecorder()
	n.mux().ServeHTTP(w, httptest.NewRequest("GET", path, nil))
	return w.Code, w.Body.String()
}

// eventLines decodes an NDJSON body.
func eventLines(t *testing.T, body string) []api.Event {
	t.Helper()
	var out []api.Event
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var e api.Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		out = append(out, e)
	}
	return out
}

// seqs prints events' numbers relative to base (the node's run) and
// kinds.
func seqs(ev []api.Event, base uint64) string {
	var b []string
	for _, e := range ev {
		b = append(b, fmt.Sprintf("%d:%s", e.Seq-base, e.Kind))
	}
	return strings.Join(b, " ")
}

// storeSeeded runs one request of 2 blocks (tiny: 16 tokens a block).
func storeSeeded(t *testing.T, n *Node, seed int) {
	t.Helper()
	if code, body := post(n, fmt.Appendf(nil, `{"seed": %d, "tokens": 32}`, seed)); code != 200 {
		t.Fatalf("request: %d %s", code, body)
	}
}

// waitEvents polls until the node's log holds event seq (its drain runs
// on its own goroutine), for at most 5 s.
func waitEvents(t *testing.T, n *Node, seq uint64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for n.evlog.Last() < seq {
		if time.Now().After(deadline) {
			t.Fatalf("the event log reached %d, want %d", n.evlog.Last(), seq)
		}
		time.Sleep(time.Millisecond)
	}
}

// Issue 14: /v0/events resumes after since while the log still holds it;
// older, it starts with one lost line counting what is gone; without
// since it starts at the newest (only what comes next); follow=false
// returns what is held. Keys are 64 hex digits; stores carry token ids.
func TestEventsResume(t *testing.T) {
	cfg := testConfig(t.TempDir())
	cfg.CPUSlots, cfg.EventHistory = 4, 5
	n, _ := startNode(t, cfg)
	for i := range 4 { // 4 stores of 2 blocks into 4 slots: 4 stored, 2 removed events
		storeSeeded(t, n, i)
	}
	base := n.evlog.base
	waitEvents(t, n, base+6)
	_, body := get(n, fmt.Sprintf("/v0/events?since=%d&follow=false", base+3))
	if got := seqs(eventLines(t, body), base); got != "4:stored 5:removed 6:stored" {
		t.Errorf("since 3: %s", got)
	}
	_, body = get(n, "/v0/events?since=0&follow=false")
	ev := eventLines(t, body)
	if got := seqs(ev, base); got != "1:lost 2:stored 3:removed 4:stored 5:removed 6:stored" || ev[0].Lost != 1 {
		t.Errorf("since 0 with events 2-6 held: %s (lost %d), want a lost line for event 1 first", got, ev[0].Lost)
	}
	if k := ev[1].Keys; len(k) != 2 || len(k[0]) != 64 || strings.ToLower(k[0]) != k[0] || len(ev[1].TokenIDs) != 32 || len(ev[1].Parent) != 64 {
		t.Errorf("a store line %+v: want 2 hex keys, their parent and 32 token ids", ev[1])
	}
	if code, body := get(n, "/v0/events?follow=false"); code != 200 || body != "" {
		t.Errorf("no since: %d %q, want nothing (only what comes next)", code, body)
	}
	for _, bad := range []string{"since=-1", "since=x", "follow=maybe", "nope=1", fmt.Sprintf("since=%d", base+7)} {
		if code, _ := get(n, "/v0/events?"+bad); code != 400 {
			t.Errorf("%s: %d, want 400", bad, code)
		}
	}
}

// Issue 14: a follower gets events as they happen, over the admin socket,
// and its stream ends cleanly when the node shuts down (Shutdown does not
// wait for it).
func TestEventsFollowEndsOnShutdown(t *testing.T) {
	n, _ := startNode(t, testConfig(t.TempDir()))
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", n.cfg.Admin)
	}}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Get("http://p2pd/v0/events?since=0")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "application/x-ndjson" {
		t.Errorf("Content-Type %q", ct)
	}
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	storeSeeded(t, n, 1)
	select {
	case l := <-lines:
		if !strings.Contains(l, fmt.Sprintf(`"seq":%d,"kind":"stored","tier":"cpu"`, n.evlog.base+1)) {
			t.Errorf("first line %s", l)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no event reached the follower")
	}
	shut := make(chan error, 1)
	go func() { shut <- n.Shutdown(context.Background()) }()
	select {
	case _, open := <-lines:
		if open {
			t.Error("more lines after shutdown began")
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the stream did not end on shutdown")
	}
	select {
	case err := <-shut:
		if err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	case <-time.After(3 * time.Second): // the admin server waits 5 s for a stream it cannot end
		t.Fatal("Shutdown waited on the event stream")
	}
}

// Issue 14: the event log is bounded by event_history whatever readers
// do: 2,000 events through a log of 16 keep 16; a reader that far behind
// gets a lost line, then the newest events.
func TestEventLogBounded(t *testing.T) {
	cfg := testConfig(t.TempDir())
	oc := cfg.OffloadConfig()
	oc.CPUBytes = int64(2 * offload.SlotStride(oc.Geometry.BlockBytes()))
	m, err := offload.New(oc)
	if err != nil {
		t.Fatal(err)
	}
	l := newEventLog(m, 0, 16)
	for i := range 1000 {
		k := offload.NextKey(offload.RootKey("x"), []uint32{uint32(i)})
		req := &offload.Request{ID: fmt.Sprint(i)}
		m.Do(func(s *offload.Step) {
			s.OnNewRequest(req)
			p, _ := s.PrepareStore([]offload.Key{k}, req)
			s.CompleteStore(p.Keys, req, true)
			s.OnRequestFinished(req)
		})
	}
	deadline := time.Now().Add(5 * time.Second)
	for l.Last() < 1998 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	l.mu.Lock()
	held := l.n
	l.mu.Unlock()
	ev, _, _ := l.read(0, 100)
	if held != 16 || len(ev) != 17 || ev[0].Kind != offload.EventLost || ev[0].Lost != 1998-16 || ev[1].Seq != 1998-15 {
		t.Errorf("held %d; read from 0: %d events, first %+v; want 16 held, a lost line for %d, then %d…", held, len(ev), ev[0], 1998-16, 1998-15)
	}
	m.Close()
	l.close()
	if _, _, ended := l.read(l.Last(), 1); !ended {
		t.Error("the log did not end with the manager")
	}
}

// Issue 14: /v0/blocks pages a tier with its event number; /v0/pins lists
// pins older than older_than; both refuse bad parameters.
func TestBlocksAndPins(t *testing.T) {
	n, _ := startNode(t, testConfig(t.TempDir()))
	storeSeeded(t, n, 1)
	storeSeeded(t, n, 2)
	waitEvents(t, n, n.evlog.base+2)
	code, body := get(n, "/v0/blocks?limit=3")
	var page api.Blocks
	if err := json.Unmarshal([]byte(body), &page); code != 200 || err != nil || len(page.Keys) != 3 || page.Next != page.Keys[2] || page.Seq != n.evlog.base+2 {
		t.Fatalf("first page: %d %s", code, body)
	}
	_, body = get(n, "/v0/blocks?limit=3&cursor="+page.Next)
	var rest api.Blocks
	if json.Unmarshal([]byte(body), &rest); len(rest.Keys) != 1 || rest.Next != "" || rest.Keys[0] <= page.Keys[2] {
		t.Errorf("second page: %s", body)
	}
	for _, bad := range []string{"limit=0", "limit=10001", "cursor=abc", "tier=gpu", "tier=p2p", "x=1"} {
		if code, _ := get(n, "/v0/blocks?"+bad); code != 400 {
			t.Errorf("blocks %s: %d, want 400", bad, code)
		}
	}
	var k offload.Key
	json.Unmarshal([]byte(`"`+page.Keys[0]+`"`), &k)
	holder := &offload.Request{ID: "holder"}
	n.M.Do(func(s *offload.Step) {
		req := holder
		s.OnNewRequest(req)
		if _, err := s.PrepareLoad([]offload.Key{k}, req); err != nil {
			t.Fatal(err)
		}
	})
	code, body = get(n, "/v0/pins?older_than=0s")
	var pins api.Pins
	if json.Unmarshal([]byte(body), &pins); code != 200 || len(pins.Pins) != 1 || pins.Pins[0].Owner != "request holder" || pins.Pins[0].Key != page.Keys[0] {
		t.Errorf("pins: %d %s", code, body)
	}
	if _, body := get(n, "/v0/pins?older_than=1h"); !strings.Contains(body, `"pins":[]`) {
		t.Errorf("pins older than 1h: %s", body)
	}
	if code, _ := get(n, "/v0/pins?older_than=soon"); code != 400 {
		t.Errorf("a bad duration: %d", code)
	}
	n.M.Do(func(s *offload.Step) { s.Abort(holder); s.OnRequestFinished(holder) })
}

// Issue 14: the daemon's /metrics — the manager's families and its own
// request-source histogram — passes promtool, and the histogram counts
// the request by its source.
func TestMetricsLintNode(t *testing.T) {
	n, _ := startNode(t, testConfig(t.TempDir()))
	storeSeeded(t, n, 1)
	_, body := get(n, "/metrics")
	for _, want := range []string{`kv_offload_request_source_fraction_bucket{source="computed",le="0.9"} 0`,
		`kv_offload_request_source_fraction_count{source="computed"} 1`, `kv_offload_request_source_fraction_bucket{source="cpu",le="0"} 1`,
		`kv_offload_tiering_lookup_tokens_total{tier="cpu",result="miss"} 16`, "kv_offload_cpu_oldest_pin_age_seconds 0"} {
		if !strings.Contains(body, want) {
			t.Errorf("no %s in /metrics", want)
		}
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(body)
	if out, err := cmd.CombinedOutput(); err != nil || len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("promtool: %v\n%s", err, out)
	}
}

// Review (issue 14): a follower that stops reading holds neither the
// node's shutdown nor its own handler goroutine: writes are bounded, and
// shutting down bounds a blocked one.
func TestStalledFollowerDoesNotHoldShutdown(t *testing.T) {
	n, _ := startNode(t, testConfig(t.TempDir()))
	c, err := net.Dial("unix", n.cfg.Admin)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /v0/events?since=0 HTTP/1.1\r\nHost: p2pd\r\n\r\n")
	br := bufio.NewReaderSize(c, 64)
	if l, err := br.ReadString('\n'); err != nil || !strings.Contains(l, "200") {
		t.Fatalf("status line %q: %v", l, err)
	}
	for i := range 300 { // each request stores 32 blocks and evicts 32: two lines of ~4 KB the follower never reads
		if code, body := post(n, fmt.Appendf(nil, `{"seed": %d, "tokens": 512}`, 1000+i)); code != 200 {
			t.Fatalf("request: %d %s", code, body)
		}
	}
	waitEvents(t, n, n.M.EventSeq()) // the handler has them all to write
	start := time.Now()
	if err := n.Shutdown(context.Background()); err != nil || time.Since(start) > 3*time.Second {
		t.Errorf("Shutdown took %v: %v", time.Since(start).Round(time.Millisecond), err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		buf := make([]byte, 1<<20)
		if !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "(*Node).events") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("after Shutdown the events handler is still blocked")
		}
		runtime.Gosched()
	}
}

// Review (issue 14): a restarted node numbers its events above its last
// run's, so a reader resuming with a number from before the restart gets
// a lost line (and resynchronises) instead of silently missing events.
func TestEventsAfterRestart(t *testing.T) {
	dir := t.TempDir()
	old, _ := startNode(t, testConfig(dir))
	for i := range 5 {
		storeSeeded(t, old, i)
	}
	waitEvents(t, old, old.evlog.base+5)
	since := old.evlog.Last()
	old.Shutdown(context.Background())
	n, _ := startNode(t, testConfig(dir))
	storeSeeded(t, n, 100)
	waitEvents(t, n, n.evlog.base+1)
	if n.evlog.base <= since {
		t.Fatalf("the restarted node's numbers start at %d, the last run's ended at %d", n.evlog.base, since)
	}
	code, body := get(n, fmt.Sprintf("/v0/events?since=%d&follow=false", since))
	if ev := eventLines(t, body); code != 200 || len(ev) != 2 || ev[0].Kind != "lost" || ev[1].Seq != n.evlog.base+1 {
		t.Errorf("resuming at the last run's %d: %d %s; want a lost line, then this run's first event", since, code, body)
	}
}

// Review (issue 14): the event log keeps an event's own token ids, not
// the request's whole prompt they are a slice of: 32 one-block events of
// 1 MiB prompts leave the heap near where it was (measured).
func TestEventLogCopiesTokens(t *testing.T) {
	cfg := testConfig(t.TempDir())
	oc := cfg.OffloadConfig()
	m, err := offload.New(oc)
	if err != nil {
		t.Fatal(err)
	}
	l := newEventLog(m, 0, 64)
	defer func() { m.Close(); l.close() }()
	bt := oc.Geometry.BlockTokens
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	for i := range 32 {
		tokens := make([]uint32, 1<<18) // a 1 MiB prompt whose prefix is cached already
		for j := range tokens {
			tokens[j] = uint32(i*7 + j)
		}
		chain := offload.NewChain(oc.KeyScheme(), bt, tokens)
		req := &offload.Request{ID: fmt.Sprint("r", i), Chain: chain}
		m.Do(func(s *offload.Step) {
			s.OnNewRequest(req)
			p, _ := s.PrepareStore(chain.Keys[len(chain.Keys)-1:], req)
			s.CompleteStore(p.Keys, req, true)
			s.OnRequestFinished(req)
		})
	}
	deadline := time.Now().Add(5 * time.Second)
	for l.Last() < 32 && time.Now().Before(deadline) {
		runtime.Gosched()
	}
	ev, _, _ := l.read(0, 64)
	if len(ev) != 32 || len(ev[0].Tokens) != bt {
		t.Fatalf("%d events held, want 32 of %d token ids", len(ev), bt)
	}
	if grew := int64(heap()) - int64(before); grew > 8<<20 {
		t.Errorf("32 one-block events hold %d MiB: each keeps its request's whole prompt", grew>>20)
	}
	runtime.KeepAlive(l)
}
