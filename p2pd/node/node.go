package node

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"expvar"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
	"github.com/kvtier/kvtier/p2pd/engine"
	"github.com/kvtier/kvtier/p2pd/p2p"
)

// Node is a running p2pd.
type Node struct {
	cfg Config
	log *slog.Logger
	M   *offload.Manager
	P2P *p2p.Tier
	Eng *engine.Engine
	lns []net.Listener
	adm *adminSocket
	lim limits // of POST /v0/requests; zero means defaultLimits
	srv *http.Server
	// evlog keeps the newest events for GET /v0/events; quit is closed
	// when the admin server starts shutting down, which ends its streams.
	evlog   *eventLog
	vllm    *vllmEvents // vLLM-format KV events; nil unless kv_events_endpoint
	quit    chan struct{}
	stop    chan time.Duration // shutdown requested through the API, with its grace
	sources sourceStats
	ids     requestIDs
	once    sync.Once
}

// Start builds and starts a node: manager, tiers (disk first when
// configured, then P2P), engine and admin API.
func Start(cfg Config, log *slog.Logger) (*Node, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.ClusterTokenFile != "" {
		tok, err := readToken(cfg.ClusterTokenFile)
		if err != nil {
			return nil, err
		}
		cfg.ClusterToken = tok
	}
	n := &Node{cfg: cfg, log: log, stop: make(chan time.Duration, 1), quit: make(chan struct{})}
	oc := cfg.OffloadConfig()
	oc.Logger = log
	oc.EventSeqBase = uint64(time.Now().UnixMicro()) // a restart numbers above its last run (docs/operations.md, Events)
	var specs []offload.TierSpec
	if oc.DiskDir != "" {
		specs = append(specs, offload.DiskTier(oc.DiskConfig))
	}
	ps := p2p.Spec(cfg.P2P, oc, nil)
	specs = append(specs, ps)
	m, err := offload.New(oc, specs...)
	if err != nil {
		return nil, err
	}
	n.M, n.P2P = m, m.Tier(ps.Name).(*p2p.Tier)
	n.evlog = newEventLog(m, oc.EventSeqBase, cfg.EventHistory)
	if cfg.KVEventsEndpoint != "" {
		if n.vllm, err = startVLLMEvents(n); err != nil {
			m.Close()
			n.evlog.close()
			return nil, fmt.Errorf("kv_events_endpoint: %w", err)
		}
		log.Info("publishing KV events in vLLM's format", "endpoint", n.vllm.pub.Addr().String(), "topic", cfg.KVEventsTopic)
	}
	n.Eng, err = engine.New(m, engine.Config{GPUBlocks: cfg.GPUBlocks, LoadWindow: cfg.LoadWindow, Backend: cfg.CopyBackend, Logger: log})
	if err != nil {
		m.Close()
		n.closeEvents()
		return nil, err
	}
	go n.Eng.Run(context.Background()) // stopped by Shutdown
	if err := n.listen(); err != nil {
		n.Eng.Shutdown(canceled())
		n.Eng.Close()
		m.Close()
		n.closeEvents()
		return nil, err
	}
	if cfg.Dialect == p2p.DialectVLLM {
		log.Warn("p2p_dialect vllm: vLLM's P2P wire authenticates nobody and checksums nothing; anyone who can reach the P2P port can fetch KV blocks and, with NIXL, write into fetches — keep it on a trusted network",
			"p2p", n.P2P.Addr(), "data_plane", n.P2P.DataPlane())
	} else if cfg.ClusterToken == "" && cfg.TLSCert == "" {
		log.Warn("no cluster token: the P2P port is unauthenticated; anyone who can reach it can fetch KV blocks and inject data into fetches (set cluster_token_file)",
			"p2p", n.P2P.Addr())
	}
	return n, nil
}

// closeEvents stops the vLLM-format publisher and the event log.
func (n *Node) closeEvents() {
	if n.vllm != nil {
		n.vllm.close()
	}
	n.evlog.close()
}

// readToken reads cluster_token_file; an unreadable or empty (white
// space only) file is an error, never a node without a token.
func readToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("%w: cluster_token_file: %w", offload.ErrConfig, err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("%w: cluster_token_file: %s is empty", offload.ErrConfig, path)
	}
	return tok, nil
}

// p2pAuth is status's p2p_auth: how peers are authenticated — "token"
// (cluster token), "tls" (certificates of the cluster CA), "token+tls",
// or "none".
func (n *Node) p2pAuth() string {
	switch tok, tls := n.cfg.ClusterToken != "", n.cfg.TLSCert != ""; {
	case tok && tls:
		return "token+tls"
	case tls:
		return "tls"
	case tok:
		return "token"
	}
	return "none"
}

// listen opens the admin socket (0600; see listenAdmin) and, if
// configured, loopback TCP.
func (n *Node) listen() error {
	adm, err := listenAdmin(n.cfg.Admin)
	if err != nil {
		return err
	}
	n.adm = adm
	n.lns = append(n.lns, adm.ln)
	if n.cfg.AdminTCP != "" {
		tl, err := net.Listen("tcp", n.cfg.AdminTCP)
		if err != nil {
			adm.close()
			return fmt.Errorf("admin_tcp %s: %w", n.cfg.AdminTCP, err)
		}
		n.lns = append(n.lns, tl)
	}
	n.srv = &http.Server{Handler: n.mux(), ReadHeaderTimeout: 10 * time.Second}
	n.srv.RegisterOnShutdown(func() { close(n.quit) }) // ends the event streams, which Shutdown waits for
	for _, l := range n.lns {
		go n.srv.Serve(l)
	}
	return nil
}

// AdminAddrs are the admin API's addresses.
func (n *Node) AdminAddrs() []string {
	var out []string
	for _, l := range n.lns {
		out = append(out, l.Addr().String())
	}
	return out
}

// canceled is a context that has ended: a shutdown with no grace.
func canceled() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

// ShutdownRequested receives the grace of a shutdown asked for through
// the API.
func (n *Node) ShutdownRequested() <-chan time.Duration { return n.stop }

// Shutdown stops the node (S5.5): no new requests (503), running ones
// finish until ctx ends (then are aborted), the poll goroutine stops,
// tiers drain and peers get a goodbye. The admin API answers status until
// the end. It is idempotent.
func (n *Node) Shutdown(ctx context.Context) error {
	var err error
	n.once.Do(func() {
		switch d, ok := ctx.Deadline(); {
		case ctx.Err() != nil:
			n.log.Info("shutting down", "grace", "none")
		case ok:
			n.log.Info("shutting down", "grace", time.Until(d).Round(time.Millisecond))
		default:
			n.log.Info("shutting down", "grace", "until running requests finish")
		}
		errs := []error{n.Eng.Shutdown(ctx), n.Eng.Close()}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		errs = append(errs, n.srv.Shutdown(ctx))
		cancel()
		errs = append(errs, n.M.Close())
		n.closeEvents()
		n.adm.close()
		err = errors.Join(errs...)
	})
	return err
}

func (n *Node) mux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v0/pause", n.pause)
	mux.HandleFunc("POST /v0/resume", n.resume)
	mux.HandleFunc("GET /v0/status", n.status)
	mux.HandleFunc("GET /v0/peers", n.peers)
	mux.HandleFunc("POST /v0/reset-cache", n.resetCache)
	mux.HandleFunc("POST /v0/scrub", n.scrub)
	mux.HandleFunc("POST /v0/shutdown", n.shutdown)
	mux.HandleFunc("GET /v0/health", n.health)
	mux.HandleFunc("POST /v0/requests", n.request)
	mux.HandleFunc("POST /v0/keys", n.keys)
	mux.HandleFunc("GET /metrics", n.metrics)
	mux.HandleFunc("GET /v0/events", n.events)
	mux.HandleFunc("GET /v0/blocks", n.blocks)
	mux.HandleFunc("GET /v0/pins", n.pins)
	mux.Handle("GET /debug/vars", expvar.Handler())
	return mux
}

func reply(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

func fail(w http.ResponseWriter, code int, format string, args ...any) {
	reply(w, code, api.Error{Error: fmt.Sprintf(format, args...)})
}

// params parses the query, rejecting unknown names.
func params(w http.ResponseWriter, r *http.Request, known ...string) (map[string]string, bool) {
	out := map[string]string{}
	for k, v := range r.URL.Query() {
		if !contains(known, k) {
			if len(known) == 0 {
				fail(w, 400, "unknown parameter %q (%s takes none)", k, r.URL.Path)
			} else {
				fail(w, 400, "unknown parameter %q (known: %s)", k, strings.Join(known, ", "))
			}
			return nil, false
		}
		out[k] = v[len(v)-1]
	}
	return out, true
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func (n *Node) pause(w http.ResponseWriter, r *http.Request) {
	p, ok := params(w, r, "mode", "clear_cache", "timeout")
	if !ok {
		return
	}
	mode := engine.PauseMode(orDefault(p["mode"], "wait"))
	if mode != engine.PauseWait && mode != engine.PauseAbort && mode != engine.PauseKeep {
		fail(w, 400, "mode %q: want wait, abort or keep", mode)
		return
	}
	clearCache, err := strconv.ParseBool(orDefault(p["clear_cache"], "false"))
	if err != nil {
		fail(w, 400, "clear_cache %q: want true or false", p["clear_cache"])
		return
	}
	timeout, err := time.ParseDuration(orDefault(p["timeout"], "60s"))
	if err != nil || timeout <= 0 {
		fail(w, 400, "timeout %q: want a positive duration such as 10s", p["timeout"])
		return
	}
	start := time.Now()
	switch err := n.Eng.Pause(mode, clearCache, timeout); {
	case err == nil:
		reply(w, 200, api.Paused{State: n.Eng.State().String(), ElapsedMS: ms(time.Since(start))})
	case errors.Is(err, engine.ErrPauseTimeout):
		fail(w, 504, "%v", err)
	case errors.Is(err, engine.ErrBadState), errors.Is(err, engine.ErrShuttingDown):
		fail(w, 409, "%v", err)
	default:
		fail(w, 500, "%v", err)
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func orDefault(v, d string) string {
	if v == "" {
		return d
	}
	return v
}

func (n *Node) resume(w http.ResponseWriter, r *http.Request) {
	if _, ok := params(w, r); !ok {
		return
	}
	if err := n.Eng.Resume(); err != nil {
		fail(w, 409, "%v", err)
		return
	}
	reply(w, 200, api.State{State: n.Eng.State().String()})
}

// health is GET /v0/health: 200 while the node serves, 503 when its P2P
// port does not accept (the accept loop stopped, or failed in the last
// 10 s, as under fd exhaustion).
func (n *Node) health(w http.ResponseWriter, r *http.Request) {
	h := n.P2P.Health()
	code := 200
	if !h.OK {
		code = 503
	}
	reply(w, code, api.HealthAnswer{OK: h.OK, P2P: h})
}

func (n *Node) status(w http.ResponseWriter, r *http.Request) {
	var s api.Status
	s.Node, s.State, s.P2P, s.Copies = n.P2P.NodeID(), n.Eng.State().String(), n.P2P.Addr(), n.Eng.Backend()
	s.Requests.Running, s.Requests.Waiting = n.Eng.Counts()
	m := n.M.Metrics()
	s.CPUTier.Slots, s.CPUTier.Used, s.CPUTier.Pinned = m.CPU.Slots, m.CPU.Used, m.CPU.Pinned
	for _, t := range m.Tiers {
		for _, st := range t.Stats {
			if st.Name == "kv_offload_p2p_sessions" {
				s.Peers = int(st.Value)
			}
		}
	}
	s.HasPendingWork, s.Poll, s.P2PAuth, s.P2PHealth = n.M.HasPendingWork(), m.Poll, n.p2pAuth(), n.P2P.Health()
	s.P2PDialect, s.P2PDataPlane, s.P2PChecksums = n.P2P.Dialect(), n.P2P.DataPlane(), n.P2P.Checksums()
	cfg := n.M.Config()
	s.BlockBytes, s.BlockTokens, s.HashAlgo, s.HashSeed = n.M.BlockBytes(), cfg.Geometry.BlockTokens, cfg.HashAlgo, cfg.HashSeed
	if n.vllm != nil {
		s.KVEvents, s.KVEventsSubscribers = n.vllm.pub.Addr().String(), n.vllm.subscribers()
		s.KVEventsAcceptErrors = n.vllm.pub.AcceptErrors()
	}
	reply(w, 200, s)
}

func (n *Node) peers(w http.ResponseWriter, r *http.Request) {
	ps := api.Peers{Node: n.P2P.NodeID(), P2P: n.P2P.Addr()}
	n.M.Do(func(*offload.Step) { ps.Peers = n.P2P.Peers() })
	if ps.Peers == nil {
		ps.Peers = []api.PeerInfo{}
	}
	reply(w, 200, ps)
}

// scrub is POST /v0/scrub: verify every ready CPU block against its
// checksum, removing those that disagree (S7.2).
func (n *Node) scrub(w http.ResponseWriter, r *http.Request) {
	if _, ok := params(w, r); !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	res, err := n.M.Scrub(ctx)
	if err != nil {
		fail(w, 503, "scrub stopped after %d blocks (%d removed): %v", res.Checked, res.Mismatched, err)
		return
	}
	reply(w, 200, api.Scrub{Checked: res.Checked, Mismatched: res.Mismatched, Unrecorded: res.Unrecorded, ElapsedMS: ms(time.Since(start))})
}

func (n *Node) resetCache(w http.ResponseWriter, r *http.Request) {
	if _, ok := params(w, r); !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
	defer cancel()
	start := time.Now()
	if err := n.M.ResetCache(ctx); err != nil {
		fail(w, 409, "%v", err)
		return
	}
	reply(w, 200, api.Reset{Reset: true, ElapsedMS: ms(time.Since(start))})
}

func (n *Node) shutdown(w http.ResponseWriter, r *http.Request) {
	p, ok := params(w, r, "grace")
	if !ok {
		return
	}
	grace := time.Duration(n.cfg.ShutdownGrace)
	if g := p["grace"]; g != "" {
		d, err := time.ParseDuration(g)
		if err != nil || d < 0 {
			fail(w, 400, "grace %q: want a duration such as 10s", g)
			return
		}
		grace = d
	}
	select {
	case n.stop <- grace:
	default:
	}
	reply(w, 200, api.State{State: "shutting_down"})
}

func (n *Node) metrics(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	n.M.Metrics().WritePrometheus(w)
	offload.WriteStats(w, n.sources.stats())
}

// sourceStats is where requests' blocks came from (issue 14): per source,
// a histogram of the fraction of each request's blocks it gave.
type sourceStats struct {
	mu    sync.Mutex
	hists [5]*offload.Histogram // cpu, disk, peer, computed, missed
}

var sourceNames = [5]string{"cpu", "disk", "peer", "computed", "missed"}

func (s *sourceStats) observe(src api.Sources, blocks int) {
	if blocks <= 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, c := range [5]int{src.CPU, src.Disk, src.Peer, src.Computed, src.Missed} {
		if s.hists[i] == nil {
			s.hists[i] = offload.NewHistogram(offload.FractionBounds...)
		}
		s.hists[i].Observe(float64(c) / float64(blocks))
	}
}

func (s *sourceStats) stats() []offload.Stat {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []offload.Stat
	for i, h := range s.hists {
		if h == nil {
			h = offload.NewHistogram(offload.FractionBounds...)
		}
		out = append(out, offload.Stat{Name: "kv_offload_request_source_fraction", Type: "histogram",
			Help: "Per finished request, the fraction of its blocks each source gave (cpu, disk, peer, computed; missed: a fetch_only request's blocks found nowhere).",
			Hist: h.Clone(), Labels: []string{"source", sourceNames[i]}})
	}
	return out
}

// requestBody is POST /v0/requests.
type requestBody struct {
	RequestID      string         `json:"request_id"`
	PromptTokenIDs tokenIDs       `json:"prompt_token_ids"`
	Seed           *uint64        `json:"seed"`
	Tokens         int            `json:"tokens"`
	TransferParams transferParams `json:"kv_transfer_params"`
	// Digest is how kv_digest is computed: crc32c (default), sha256, none.
	Digest string `json:"kv_digest"`
	// FetchOnly computes nothing: api.Request.FetchOnly.
	FetchOnly bool `json:"fetch_only"`
}

// Limits of POST /v0/requests (S8.3). A body costs at most what a valid
// maximal one does: MaxBodyBytes of buffer, MaxTokens token ids and
// MaxTransferParamsBytes of kv_transfer_params.
const (
	// MaxTokens bounds a request's prompt.
	MaxTokens = 1 << 22
	// MaxTransferParamsBytes bounds kv_transfer_params, as JSON.
	MaxTransferParamsBytes = 64 << 10
	// MaxBodyBytes holds MaxTokens ten-digit token ids with their commas,
	// and 1 MiB for the rest.
	MaxBodyBytes int64 = MaxTokens*int64(len("4294967295,")) + 1<<20
)

// limits are a node's request limits: the constants above (tests shrink
// them).
type limits struct {
	tokens, params int
	body           int64
}

var defaultLimits = limits{tokens: MaxTokens, params: MaxTransferParamsBytes, body: MaxBodyBytes}

// tokenIDs is prompt_token_ids. It decodes straight from the JSON text
// and refuses more than max ids before allocating for them.
type tokenIDs struct {
	max int
	ids []uint32
}

// UnmarshalJSON reads an array of integers 0 to 4294967295. b is valid
// JSON: the decoder has checked it.
func (p *tokenIDs) UnmarshalJSON(b []byte) error {
	p.ids = nil
	if string(b) == "null" {
		return nil
	}
	if b[0] != '[' {
		return errors.New("prompt_token_ids: want an array of token ids")
	}
	// Every element but the first follows a comma: an upper bound.
	n := bytes.Count(b, []byte{','}) + 1
	if n > p.max {
		return fmt.Errorf("prompt_token_ids: more than %d tokens", p.max)
	}
	ids := make([]uint32, 0, n)
	i := 1
	skip := func() {
		for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
			i++
		}
	}
	if skip(); b[i] == ']' {
		return nil
	}
	for {
		start, v := i, uint64(0)
		for i < len(b) && b[i] >= '0' && b[i] <= '9' && i-start < 11 {
			v = v*10 + uint64(b[i]-'0')
			i++
		}
		if i == start || v > 1<<32-1 || (b[i] != ',' && b[i] != ']' && b[i] != ' ' && b[i] != '\t' && b[i] != '\n' && b[i] != '\r') {
			return fmt.Errorf("prompt_token_ids: element %d is not a token id (an integer 0 to 4294967295)", len(ids))
		}
		ids = append(ids, uint32(v))
		if skip(); b[i] == ']' {
			p.ids = ids
			return nil
		}
		i++ // the comma
		skip()
	}
}

// transferParams is kv_transfer_params: at most max bytes of JSON,
// numbers kept as json.Number (remote_port is read exactly).
type transferParams struct {
	max int
	m   map[string]any
}

// UnmarshalJSON reads an object of at most max bytes.
func (p *transferParams) UnmarshalJSON(b []byte) error {
	if len(b) > p.max {
		return fmt.Errorf("kv_transfer_params: %d bytes of JSON (at most %d)", len(b), p.max)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&p.m); err != nil {
		return fmt.Errorf("kv_transfer_params: want an object: %w", err)
	}
	return nil
}

// ErrTrailingData is a JSON body or config file with more after its value.
var ErrTrailingData = errors.New("node: trailing data after the JSON value")

// decodeOne decodes one JSON value and rejects anything after it but
// white space.
func decodeOne(dec *json.Decoder, v any) error {
	if err := dec.Decode(v); err != nil {
		return err
	}
	switch _, err := dec.Token(); {
	case err == io.EOF:
		return nil
	case err != nil && !isSyntaxError(err):
		return err // a read error, or the body limit
	}
	return ErrTrailingData
}

func isSyntaxError(err error) bool {
	var se *json.SyntaxError
	return errors.As(err, &se)
}

// requestIDs are the ids of the requests the admin API serves, and the
// count behind the ids it gives requests that name none.
type requestIDs struct {
	mu    sync.Mutex
	n     uint64
	inUse map[string]int // by id, how many requests hold it; shrinks as they end
}

// hold marks id in use until release; for "" it is the next req-N that no
// request the API serves holds (a client may name its own req-N).
func (r *requestIDs) hold(id string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.inUse == nil {
		r.inUse = map[string]int{}
	}
	for id == "" {
		r.n++
		if c := fmt.Sprintf("req-%d", r.n); r.inUse[c] == 0 {
			id = c
		}
	}
	r.inUse[id]++
	return id
}

func (r *requestIDs) release(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.inUse[id]--; r.inUse[id] <= 0 {
		delete(r.inUse, id)
	}
}

// readPrompt reads a request body (S8.3's bounds) and its prompt: the
// token ids, or a seed's; false when it answered an error.
func (n *Node) readPrompt(w http.ResponseWriter, r *http.Request) (requestBody, []uint32, bool) {
	lim := n.lim
	if lim == (limits{}) {
		lim = defaultLimits
	}
	b := requestBody{PromptTokenIDs: tokenIDs{max: lim.tokens}, TransferParams: transferParams{max: lim.params}}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, lim.body))
	dec.DisallowUnknownFields()
	if err := decodeOne(dec, &b); err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			fail(w, 413, "body: larger than %d bytes", lim.body)
			return b, nil, false
		}
		switch {
		case err == io.EOF:
			fail(w, 400, "body: empty (want a JSON object)")
		case errors.Is(err, io.ErrUnexpectedEOF):
			fail(w, 400, "body: the JSON ends early (truncated?)")
		default:
			fail(w, 400, "body: %v", err)
		}
		return b, nil, false
	}
	tokens := b.PromptTokenIDs.ids
	switch {
	case len(tokens) > 0 && b.Seed != nil:
		fail(w, 400, "give prompt_token_ids or seed and tokens, not both")
		return b, nil, false
	case b.Seed != nil:
		if b.Tokens <= 0 || b.Tokens > lim.tokens {
			fail(w, 400, "tokens %d: want 1 to %d", b.Tokens, lim.tokens)
			return b, nil, false
		}
		tokens = SeededTokens(*b.Seed, b.Tokens)
	case len(tokens) == 0:
		fail(w, 400, "give prompt_token_ids, or seed and tokens")
		return b, nil, false
	}
	return b, tokens, true
}

// keys serves POST /v0/keys: the node's block keys for a prompt (issue
// 15: a wrong seed or scheme gives 0 % hits silently; this shows it).
func (n *Node) keys(w http.ResponseWriter, r *http.Request) {
	_, tokens, ok := n.readPrompt(w, r)
	if !ok {
		return
	}
	cfg := n.M.Config()
	out := api.Keys{HashAlgo: cfg.HashAlgo, Keys: []string{}}
	for _, k := range cfg.KeyScheme().Keys(cfg.Geometry.BlockTokens, tokens) {
		t, _ := k.MarshalText()
		out.Keys = append(out.Keys, string(t))
	}
	reply(w, 200, out)
}

func (n *Node) request(w http.ResponseWriter, r *http.Request) {
	b, tokens, ok := n.readPrompt(w, r)
	if !ok {
		return
	}
	if len(b.RequestID) > 256 {
		fail(w, 400, "request_id longer than 256 bytes")
		return
	}
	if _, _, err := p2p.ParseRemoteSource(b.TransferParams.m); err != nil {
		fail(w, 400, "%v", err)
		return
	}
	b.RequestID = n.ids.hold(b.RequestID)
	defer n.ids.release(b.RequestID)
	res, err := n.Eng.Submit(r.Context(), engine.Request{ID: b.RequestID, Tokens: tokens, TransferParams: b.TransferParams.m, Digest: b.Digest, FetchOnly: b.FetchOnly})
	switch {
	case err == nil:
		n.sources.observe(res.Sources, res.Blocks)
		reply(w, 200, res)
	case errors.Is(err, engine.ErrShuttingDown):
		fail(w, 503, "%v", err)
	case errors.Is(err, engine.ErrTooLarge), errors.Is(err, offload.ErrRequestExists), errors.Is(err, engine.ErrBadDigest):
		fail(w, 400, "%v", err)
	case errors.Is(err, engine.ErrAborted):
		fail(w, 409, "%v", err)
	default:
		fail(w, 500, "%v", err)
	}
}

// SeededTokens is the prompt of {"seed": S, "tokens": N}: the same on
// every node.
func SeededTokens(seed uint64, n int) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 0x6b76746965720000))
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(rng.IntN(151936))
	}
	return out
}
