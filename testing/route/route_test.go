package route

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/ctl"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
)

// The router hashes prompts itself (S1.1); its keys must be the nodes'.
func TestKeysAreTheNodes(t *testing.T) {
	tokens := make([]uint32, 100)
	for i := range tokens {
		tokens[i] = uint32(i * 7919)
	}
	var want []string
	for _, k := range offload.BlockKeys("seed", 16, tokens) {
		want = append(want, hex.EncodeToString(k[:]))
	}
	if got := Keys("seed", 16, tokens); !slices.Equal(got, want) || len(got) != 6 {
		t.Errorf("Keys = %v\nwant  %v", got, want)
	}
	// vLLM's scheme, long blocks (a 2-byte CBOR array head) included.
	for _, bt := range []int{16, 300} {
		long := make([]uint32, 2*bt+1)
		for i := range long {
			long[i] = uint32(i * 104729)
		}
		want = nil
		for _, k := range (offload.KeyScheme{Algo: offload.HashVLLMSHA256CBOR, Seed: "vllm-none-hash"}).Keys(bt, long) {
			want = append(want, hex.EncodeToString(k[:]))
		}
		if got := (Scheme{Algo: "vllm-sha256-cbor", Seed: "vllm-none-hash", BlockTokens: bt}).Keys(long); !slices.Equal(got, want) || len(got) != 2 {
			t.Errorf("vLLM scheme, %d-token blocks: %v\nwant %v", bt, got, want)
		}
	}
}

// The index follows stored, removed and cleared events per tier; a node
// holding a block in two tiers keeps it until both dropped it; routes
// name the longest prefix, skipping the node a request goes to.
func TestIndex(t *testing.T) {
	r := New(Scheme{Seed: "seed", BlockTokens: 2}, nil)
	tokens := []uint32{1, 2, 3, 4, 5, 6}
	k := Keys("seed", 2, tokens)
	r.replace("a", "a:1", nil)
	r.replace("b", "b:1", map[string]map[string]struct{}{"cpu": {k[0]: {}}})
	r.apply("a", api.Event{Kind: "stored", Tier: "cpu", Keys: k})
	r.apply("a", api.Event{Kind: "stored", Tier: "disk", Keys: k[:1]})
	if c := r.Route(tokens, ""); c.Node != "a" || c.Blocks != 3 || c.Of != 3 || c.P2P != "a:1" {
		t.Errorf("route %+v, want a with 3 of 3", c)
	}
	if c := r.Route(tokens, "a"); c.Node != "b" || c.Blocks != 1 {
		t.Errorf("route except a: %+v, want b with 1", c)
	}
	r.apply("a", api.Event{Kind: "cleared", Tier: "cpu"})
	if c := r.Route(tokens, ""); c.Node != "a" || c.Blocks != 1 {
		t.Errorf("after a's CPU reset: %+v, want a with 1 (its disk copy), ties by name", c)
	}
	r.apply("a", api.Event{Kind: "removed", Tier: "disk", Keys: k[:1]})
	if c := r.Route(tokens, ""); c.Node != "b" || c.Blocks != 1 {
		t.Errorf("after a removed its last copy: %+v, want b", c)
	}
	r.forget("b")
	if c := r.Route(tokens, ""); c.Blocks != 0 || c.RemoteSource("x") != nil || len(r.index) != 0 {
		t.Errorf("with nothing held: %+v, index %d keys", c, len(r.index))
	}
}

// Review (issue 14): a node the router can no longer follow is not routed
// to: its view is dropped when its stream ends, until a resync succeeds.
func TestGoneNodeNotRouted(t *testing.T) {
	tokens := []uint32{1, 2, 3, 4}
	keys := Keys("seed", 2, tokens)
	gone := make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v0/status", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"p2p": "127.0.0.1:4100", "hash_algo": "kvtier", "hash_seed": "seed", "block_tokens": 2}`))
	})
	mux.HandleFunc("GET /v0/blocks", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("tier") != "cpu" {
			w.WriteHeader(400)
			w.Write([]byte(`{"error": "no tier"}`))
			return
		}
		json.NewEncoder(w).Encode(map[string]any{"tier": "cpu", "seq": 7, "keys": keys})
	})
	mux.HandleFunc("GET /v0/events", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-ndjson")
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		select {
		case <-gone:
		case <-r.Context().Done():
		}
	})
	srv := httptest.NewServer(mux)
	r := New(Scheme{Seed: "seed", BlockTokens: 2}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Follow(ctx, "a", ctl.New("", strings.TrimPrefix(srv.URL, "http://")), 20*time.Millisecond)
	}()
	defer func() { cancel(); <-done }()
	waitFor := func(what string, ok func(Choice) bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for c := r.Route(tokens, ""); !ok(c); c = r.Route(tokens, "") {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the router answers %+v", what, c)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitFor("following", func(c Choice) bool { return c.Node == "a" && c.Blocks == 2 })
	close(gone)
	srv.CloseClientConnections()
	srv.Close()
	waitFor("the node gone", func(c Choice) bool { return c.Node == "" })
}

// A node whose status names another key scheme is not followed: its keys
// could never match the router's (a silent 0 % hit rate otherwise).
func TestOtherSchemeNotFollowed(t *testing.T) {
	tokens := []uint32{1, 2}
	keys := Keys("seed", 2, tokens)
	asked := make(chan string, 16)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v0/status", func(w http.ResponseWriter, r *http.Request) {
		asked <- "status"
		w.Write([]byte(`{"p2p": "127.0.0.1:4100", "hash_algo": "kvtier", "hash_seed": "other", "block_tokens": 2}`))
	})
	mux.HandleFunc("GET /v0/blocks", func(w http.ResponseWriter, r *http.Request) {
		asked <- "blocks"
		json.NewEncoder(w).Encode(map[string]any{"tier": "cpu", "seq": 1, "keys": keys})
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	r := New(Scheme{Seed: "seed", BlockTokens: 2}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Follow(ctx, "a", ctl.New("", strings.TrimPrefix(srv.URL, "http://")), time.Millisecond)
	}()
	for range 3 { // three attempts, each stopping at the status
		if got := <-asked; got != "status" {
			t.Fatalf("the router asked for %s of a node with another seed", got)
		}
	}
	cancel()
	<-done
	if c := r.Route(tokens, ""); c.Blocks != 0 {
		t.Errorf("routed to a node with another seed: %+v", c)
	}
}
