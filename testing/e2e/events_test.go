package e2e

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/ctl"
	"github.com/kvtier/kvtier/p2pd/api"
	p2pdnode "github.com/kvtier/kvtier/p2pd/node"
	"github.com/kvtier/kvtier/testing/route"
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

// Issue 14: the router (testing/route) follows two real nodes; a prompt
// computed on a is routed to a for a request sent to b, and the fetch
// b makes from it comes from the peer; once a evicted the prefix the
// router stops naming it.
func TestRouterFollowsEviction(t *testing.T) {
	a, b := start(t, "-node-id", "a", "-cpu-slots", "16"), start(t, "-node-id", "b")
	r := route.New("kvtier-v1", 16, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, 2)
	for name, n := range map[string]*node{"a": a, "b": b} {
		go func() { r.Follow(ctx, name, ctl.New(n.admin, ""), 50*time.Millisecond); done <- struct{}{} }()
	}
	defer func() {
		cancel()
		<-done
		<-done
	}()
	prompt := nodeTokens(7, 192) // 12 blocks
	if _, out, code := a.submit("--tokens-seed", "7", "--tokens", "192"); code != 0 {
		t.Fatalf("prefill on a: %s", out)
	}
	choice := waitRoute(t, r, prompt, "b", func(c route.Choice) bool { return c.Node == "a" && c.Blocks == 12 })
	got, out, code := b.submit("--tokens-seed", "7", "--tokens", "192", "--remote-kv-source", choice.P2P, "--kv-request-id", "kv-7")
	if code != 0 || got.Sources.Peer != 12 {
		t.Fatalf("b's request with the router's source %s: %d %s", choice.P2P, code, out)
	}
	// a holds 16 blocks: another 12-block prompt evicts the first's head.
	if _, out, code := a.submit("--tokens-seed", "8", "--tokens", "192"); code != 0 {
		t.Fatalf("second prefill on a: %s", out)
	}
	waitRoute(t, r, prompt, "b", func(c route.Choice) bool { return c.Node != "a" })
	waitRoute(t, r, nodeTokens(8, 192), "b", func(c route.Choice) bool { return c.Node == "a" && c.Blocks == 12 })
	if keys := route.Keys("kvtier-v1", 16, prompt); r.Holds("b", keys) != 12 {
		t.Errorf("the router sees %d of the prompt's blocks on b, which fetched all 12", r.Holds("b", keys))
	}
}

func nodeTokens(seed uint64, n int) []uint32 { return p2pdnode.SeededTokens(seed, n) }

// waitRoute polls the router (its view follows the streams) until ok, for
// at most 10 s.
func waitRoute(t *testing.T, r *route.Router, prompt []uint32, except string, ok func(route.Choice) bool) route.Choice {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c := r.Route(prompt, except)
		if ok(c) {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("the router still answers %+v", c)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
