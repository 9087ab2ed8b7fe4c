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

func seqs(ev []api.Event) string {
	var b []string
	for _, e := range ev {
		b = append(b, fmt.Sprintf("%d:%s", e.Seq, e.Kind))
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
	waitEvents(t, n, 6)
	_, body := get(n, "/v0/events?since=3&follow=false")
	if got := seqs(eventLines(t, body)); got != "4:stored 5:removed 6:stored" {
		t.Errorf("since 3: %s", got)
	}
	_, body = get(n, "/v0/events?since=0&follow=false")
	ev := eventLines(t, body)
	if got := seqs(ev); got != "1:lost 2:stored 3:removed 4:stored 5:removed 6:stored" || ev[0].Lost != 1 {
		t.Errorf("since 0 with events 2-6 held: %s (lost %d), want a lost line for event 1 first", got, ev[0].Lost)
	}
	if k := ev[1].Keys; len(k) != 2 || len(k[0]) != 64 || strings.ToLower(k[0]) != k[0] || len(ev[1].TokenIDs) != 32 || len(ev[1].Parent) != 64 {
		t.Errorf("a store line %+v: want 2 hex keys, their parent and 32 token ids", ev[1])
	}
	if code, body := get(n, "/v0/events?follow=false"); code != 200 || body != "" {
		t.Errorf("no since: %d %q, want nothing (only what comes next)", code, body)
	}
	for _, bad := range []string{"since=-1", "since=x", "follow=maybe", "nope=1"} {
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
		if !strings.Contains(l, `"seq":1,"kind":"stored","tier":"cpu"`) {
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
	l := newEventLog(m, 16)
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
	waitEvents(t, n, 2)
	code, body := get(n, "/v0/blocks?limit=3")
	var page api.Blocks
	if err := json.Unmarshal([]byte(body), &page); code != 200 || err != nil || len(page.Keys) != 3 || page.Next != page.Keys[2] || page.Seq != 2 {
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
