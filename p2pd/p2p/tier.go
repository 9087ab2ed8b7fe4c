package p2p

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// Tier is the P2P secondary tier. Its methods run under the manager lock
// (the offload.Tier contract); its socket and data-plane goroutines only
// post typed events (events.go) to a queue and wake the poll goroutine,
// which applies them in Serve.
type Tier struct {
	cfg        Config
	node       offload.Config
	env        offload.TierEnv
	log        *slog.Logger
	net        Network
	dp         DataPlane
	ln         net.Listener
	self       wire.Hello
	hs         *handshaker
	addr       string
	blockBytes int
	vllm       bool // p2p_dialect vllm (vllm.go)
	wg         sync.WaitGroup
	closing    chan struct{}
	// stop is cancelled by Close: dials and handshakes in flight end at
	// once instead of at handshake_timeout (shakeDeadline).
	stop       context.Context
	cancelStop context.CancelFunc

	// Shared with connection goroutines, safe without the manager lock.
	live       liveSet       // processes with a ready session: data connections must come from one
	handshakes atomic.Int64  // accepted connections still in their handshake
	nready     atomic.Int64  // ready sessions, for the cap before a handshake
	perIP      ipCounts      // handshakes in progress by source address
	rejects    rejectCounts  // handshakes refused, by code and side
	accept     acceptHealth  // the accept loop's errors
	logLimit   limiter       // rate limit for warnings a peer can provoke
	capDrops   atomic.Uint64 // connections closed for the handshake cap

	ev struct {
		sync.Mutex
		q []event
	}

	// Everything below is touched only under the manager lock.
	p        offload.Parent // valid during Serve
	sessions map[*session]bool
	byNode   map[string]*session
	byAddr   map[string]*session
	results  []offload.JobResult
	owed     []*offload.Request // outside requests owed OnRequestFinished
	timerAt  time.Time          // the pass last asked of the manager's clock (arm)
	closed   bool
	st       stats
	redial   map[string]*backoff // static peers not connected: when to dial again
	prods    protocol.Producers  // what the sessions' producers share
	conss    protocol.Consumers  // and their consumers
	consOf   map[*protocol.Consumer]*session
	wid      uint64              // the last data-plane write id given a vLLM round (writeID)
	vdials   map[string]*session // vLLM identity → the session whose DEALER dial is in flight; vdialled removes it
}

type stats struct {
	sessionsOpened, peerDeaths, protocolErrors uint64
	duplicates                                 uint64
}

// backoff is a static peer's redial schedule: 1 s doubling to 30 s.
type backoff struct {
	at    time.Time // zero while a dial is in flight
	delay time.Duration
}

const (
	redialMin = time.Second
	redialMax = 30 * time.Second
)

// maxPerIP bounds the handshakes in progress from one source address, so
// one host cannot hold every handshake slot (S8.1).
const maxPerIP = 8

// helloTimeout bounds the wait for an accepted connection's hello (and,
// over TLS, the TLS handshake before it): legitimate peers send it at
// once, so silent connections free their slot fast.
const helloTimeout = 2 * time.Second

// ipCounts counts handshakes in progress per source address; an address
// leaves the map when its count drops to zero.
type ipCounts struct {
	mu sync.Mutex
	m  map[string]int
}

func (c *ipCounts) take(ip string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m[ip] >= maxPerIP {
		return false
	}
	if c.m == nil {
		c.m = map[string]int{}
	}
	c.m[ip]++
	return true
}

func (c *ipCounts) put(ip string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m[ip]--; c.m[ip] <= 0 {
		delete(c.m, ip)
	}
}

// sourceIP is a connection's remote host (the whole address when it has
// no port, as in-memory test networks).
func sourceIP(c net.Conn) string {
	a := c.RemoteAddr().String()
	if h, _, err := net.SplitHostPort(a); err == nil {
		return h
	}
	return a
}

// liveSet holds the processes this node has a ready session with.
type liveSet struct {
	mu sync.Mutex
	m  map[peerID]bool
}

func (l *liveSet) add(p peerID) {
	l.mu.Lock()
	if l.m == nil {
		l.m = map[peerID]bool{}
	}
	l.m[p] = true
	l.mu.Unlock()
}

func (l *liveSet) remove(p peerID) {
	l.mu.Lock()
	delete(l.m, p)
	l.mu.Unlock()
}

func (l *liveSet) has(p peerID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.m[p]
}

// incOf is the incarnation of node's live process.
func (l *liveSet) incOf(node string) ([16]byte, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for p := range l.m {
		if p.Node == node {
			return p.Inc, true
		}
	}
	return [16]byte{}, false
}

// rejectCounts counts refused handshakes by code: [0] refused by this
// node, [1] by the peer. The keys are a fixed set (S6.1), never peer text.
type rejectCounts [2][wire.NumCodes]atomic.Uint64

func (r *rejectCounts) add(byPeer bool, c wire.Code) {
	side := 0
	if byPeer {
		side = 1
	}
	if c >= wire.NumCodes {
		c = wire.CodeOther
	}
	r[side][c].Add(1)
}

// acceptHealth is what the accept loop saw.
type acceptHealth struct {
	errors  atomic.Uint64
	mu      sync.Mutex
	last    string
	lastAt  time.Time
	stopped bool
}

// limiter allows a burst of logs per window and counts the rest.
type limiter struct {
	mu         sync.Mutex
	start      time.Time
	n          int
	suppressed int
}

// allow says whether to log now; suppressed is how many were not logged
// since the last allowed one.
func (l *limiter) allow(now time.Time) (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.start) >= 10*time.Second {
		l.start, l.n = now, 0
	}
	if l.n >= 5 {
		l.suppressed++
		return false, 0
	}
	l.n++
	suppressed, l.suppressed = l.suppressed, 0
	return true, suppressed
}

// warnLimited logs a warning a peer can provoke (a failed handshake, an
// accept error, a handler error): at most five per 10 s.
func (t *Tier) warnLimited(msg string, args ...any) {
	if ok, n := t.logLimit.allow(time.Now()); ok {
		if n > 0 {
			args = append(args, "suppressed", n)
		}
		t.log.Warn(msg, args...)
	}
}

// Spec returns the TierSpec of a P2P tier: a remote, polled tier named
// "p2p". node is the manager's config (block size, fingerprint, seed);
// net nil means real TCP.
func Spec(cfg Config, node offload.Config, n Network) offload.TierSpec {
	return offload.TierSpec{Name: "p2p", Medium: offload.MediumCPU, Locality: offload.Remote, Polled: true,
		New: func(env offload.TierEnv) (offload.Tier, error) { return New(cfg, node, n, env) }}
}

// New starts a P2P tier: it listens on cfg.Listen and dials cfg.Peers.
func New(cfg Config, node offload.Config, n Network, env offload.TierEnv) (*Tier, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if n == nil {
		n = TCP{}
	}
	if cfg.TLSCert != "" {
		var err error
		n, err = TLSNetwork(n, TLSConfig{CertFile: cfg.TLSCert, KeyFile: cfg.TLSKey, CAFile: cfg.TLSCA,
			HandshakeTimeout: time.Duration(cfg.HandshakeTimeout), Logger: env.Logger})
		if err != nil {
			return nil, err
		}
	}
	if env.Now == nil {
		env.Now = time.Now
	}
	log := env.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	t := &Tier{cfg: cfg, node: node, env: env, log: log, net: n, blockBytes: env.Arena.SlotBytes(), vllm: cfg.Dialect == DialectVLLM,
		closing: make(chan struct{}), sessions: map[*session]bool{}, byNode: map[string]*session{},
		byAddr: map[string]*session{}, redial: map[string]*backoff{}, vdials: map[string]*session{}}
	t.stop, t.cancelStop = context.WithCancel(context.Background())
	t.prods = protocol.Producers{Log: log, Config: protocol.ProducerConfig{LookupHold: time.Duration(cfg.LookupHold),
		PinHold: time.Duration(cfg.PinHold), BlockBytes: t.blockBytes}}
	t.conss = protocol.Consumers{Log: log, Config: protocol.ConsumerConfig{LookupTimeout: cfg.lookupTimeout(),
		LoadTimeout: time.Duration(cfg.LoadTimeout), AbortAckTimeout: time.Duration(cfg.AbortAckTimeout), BlockBytes: t.blockBytes,
		DoneCompletes: t.vllm}}
	t.consOf = map[*protocol.Consumer]*session{}
	t.self = wire.Hello{Version: wire.Version, Kind: wire.KindControl, NodeID: cfg.NodeID}
	rand.Read(t.self.Incarnation[:])
	if t.self.NodeID == "" {
		var id [8]byte
		rand.Read(id[:])
		t.self.NodeID = "node-" + hex.EncodeToString(id[:])
	}
	if t.vllm && node.HashAlgo != offload.HashVLLMSHA256CBOR {
		return nil, fmt.Errorf("%w: p2p_dialect vllm: hash_algo is %q; vLLM's peers find nothing unless it is %s (vLLM's sha256_cbor)", ErrConfig, node.HashAlgo, offload.HashVLLMSHA256CBOR)
	}
	if t.vllm && cfg.DataPlane == "nixl" && env.Arena.Stride() != env.Arena.SlotBytes() {
		return nil, fmt.Errorf("%w: p2p_dialect vllm: vLLM writes slot i at base + i × block_len, and this node's %d-byte slots are %d bytes apart; use a geometry whose block is a multiple of %d bytes",
			ErrConfig, env.Arena.SlotBytes(), env.Arena.Stride(), os.Getpagesize())
	}
	if t.vllm || cfg.DataPlane == "nixl" { // peers refuse more of a peer, whatever this node's data plane
		if err := nixlSlots(env.Arena.Slots()); err != nil {
			return nil, err
		}
	}
	ln, err := n.Listen(cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("p2p: listening on %s: %w", cfg.Listen, err)
	}
	t.ln = ln
	t.addr = cfg.Advertise
	if t.addr == "" {
		t.addr = ln.Addr().String()
	}
	if t.vllm {
		if err := vllmLocalID("p2p_listen", t.addr); err != nil { // Validate checked the host; a port 0 is the listener's
			ln.Close()
			return nil, err
		}
	}
	switch cfg.DataPlane {
	case "nixl":
		t.dp, err = NewNIXLPlane(env.Arena, t.self, NIXLConfig{UCX: cfg.NIXLParams, VLLM: t.vllm}, log)
		if err != nil {
			ln.Close()
			return nil, err
		}
	case "none":
		t.dp = NonePlane{}
		log.Warn("p2p: data_plane none: no blocks move; peers' fetches fail, and this node's loads from peers fail unsent")
	default:
		if f := testPlanes[cfg.DataPlane]; f != nil {
			t.dp = f(env.Arena)
			break
		}
		t.dp = NewTCPPlane(env.Arena, n, TCPPlaneConfig{Conns: cfg.DataConns, MaxIn: cfg.MaxDataConns,
			IdleTimeout: time.Duration(cfg.DataIdleTimeout), Auth: t.authData, HandshakeTimeout: time.Duration(cfg.HandshakeTimeout), Nice: cfg.DataNice, Bulk: cfg.BulkConcurrency, EngineBusy: env.EngineBusy}, log)
	}
	t.hs = &handshaker{Shaker: protocol.Shaker{Self: peerID{Node: t.self.NodeID, Inc: t.self.Incarnation}, Token: []byte(cfg.ClusterToken),
		Connect: wire.Connect{NodeID: t.self.NodeID, Incarnation: t.self.Incarnation, Version: wire.Version,
			BlockBytes: uint64(t.blockBytes), Fingerprint: node.Fingerprint(), HashSeed: node.HashSeed,
			Addr: t.addr, DataPlane: t.dp.Name(), DataInfo: t.dp.LocalInfo()}}}
	t.wg.Go(t.acceptLoop)
	for _, a := range cfg.Peers {
		t.redial[a] = &backoff{delay: redialMin}
		t.dial(a)
	}
	log.Info("p2p tier listening", "addr", t.addr, "node", t.self.NodeID, "dialect", cfg.Dialect, "data_plane", t.dp.Name())
	return t, nil
}

// Health reports the P2P port's state; it needs no lock.
func (t *Tier) Health() api.Health {
	a := &t.accept
	a.mu.Lock()
	defer a.mu.Unlock()
	h := api.Health{Accepting: !a.stopped, AcceptErrors: a.errors.Load(), LastAcceptError: a.last, LastErrorAt: a.lastAt}
	h.OK = h.Accepting && (a.lastAt.IsZero() || time.Since(a.lastAt) > 10*time.Second)
	return h
}

// testPlanes are data planes a test adds by name (an in-memory one).
var testPlanes = map[string]func(*offload.Arena) DataPlane{}

// vllmPingTTL is the time-to-live a keep-alive PING on vLLM's wire asks
// of the peer: keepalive_timeout's default (vLLM's HEARTBEAT_TTL).
const vllmPingTTL = 10 * time.Second

// Checksums says whether blocks are checked with CRC32C (S7.2): not on
// vLLM's wire, whose writes carry none.
func (t *Tier) Checksums() bool { return !t.vllm }

// Dialect is the P2P wire spoken, and DataPlane what moves blocks.
func (t *Tier) Dialect() string {
	if t.vllm {
		return DialectVLLM
	}
	return DialectKvtier
}

// DataPlane is the data plane's name.
func (t *Tier) DataPlane() string { return t.dp.Name() }

// Authenticated says whether peers must hold the cluster token.
func (t *Tier) Authenticated() bool { return t.cfg.ClusterToken != "" }

// authData authenticates a data connection this node dialled to node.
func (t *Tier) authData(c net.Conn, node string) error {
	inc, ok := t.live.incOf(node)
	if !ok {
		return ErrNoPeer
	}
	return t.hs.dialData(c, peerID{Node: node, Inc: inc})
}

// Addr is the address peers reach this node's P2P port at.
func (t *Tier) Addr() string { return t.addr }

// NodeID is this node's id.
func (t *Tier) NodeID() string { return t.self.NodeID }

// untilClose makes c's I/O fail at once when the tier closes, while a
// dial or handshake goroutine uses it (the returned func ends that), so
// Close does not wait out handshake_timeout.
func (t *Tier) untilClose(c net.Conn) func() bool {
	return context.AfterFunc(t.stop, func() { c.SetDeadline(time.Now()) })
}

// shakeDeadline sets a handshake's deadline on c — now, when the tier is
// closing (a deadline set after untilClose fired must not outlast it).
func (t *Tier) shakeDeadline(c net.Conn, d time.Time) {
	c.SetDeadline(d)
	if t.stop.Err() != nil {
		c.SetDeadline(time.Now())
	}
}

// takeEvents returns what the connection goroutines posted, oldest first.
func (t *Tier) takeEvents() []event {
	t.ev.Lock()
	defer t.ev.Unlock()
	q := t.ev.q
	t.ev.q = nil
	return q
}

// post queues e to be applied under the manager lock and wakes the poll
// goroutine. Socket goroutines call it; it never blocks for long.
func (t *Tier) post(e event) {
	t.ev.Lock()
	t.ev.q = append(t.ev.q, e)
	t.ev.Unlock()
	t.env.Wake()
}

// acceptLoop accepts connections until the listener closes. Errors do
// not stop it (S8.1): it retries with a backoff from 5 ms doubling to 1 s
// (as net/http.Server does), counts them and logs them rate-limited.
// Beyond max_handshakes connections still in their handshake, new ones
// are closed at once, so goroutines and fds spent on strangers are bounded.
func (t *Tier) acceptLoop() {
	var delay time.Duration
	for {
		c, err := t.ln.Accept()
		if err != nil {
			select {
			case <-t.closing:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				t.accept.mu.Lock()
				t.accept.stopped = true
				t.accept.mu.Unlock()
				t.log.Error("p2p: the listener closed; no new peers are accepted", "err", err)
				return
			}
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			t.acceptFailed(err, delay)
			select {
			case <-t.closing:
				return
			case <-time.After(delay):
			}
			continue
		}
		delay = 0
		ip := sourceIP(c)
		if t.handshakes.Add(1) > int64(t.cfg.MaxHandshakes) || !t.perIP.take(ip) {
			t.handshakes.Add(-1)
			t.capDrops.Add(1)
			c.Close()
			continue
		}
		t.wg.Go(func() {
			defer t.handshakes.Add(-1)
			defer t.perIP.put(ip)
			t.serveConn(c)
		})
	}
}

func (t *Tier) acceptFailed(err error, delay time.Duration) {
	n := t.accept.errors.Add(1)
	t.accept.mu.Lock()
	t.accept.last, t.accept.lastAt = err.Error(), time.Now()
	t.accept.mu.Unlock()
	if ok, sup := t.logLimit.allow(time.Now()); ok {
		t.log.Warn("p2p: accept failed; retrying", "err", err, "retry_in", delay, "errors_total", n, "suppressed", sup)
	}
}

// serveConn runs the acceptor's handshake of one connection under
// handshake_timeout, then hands it to the session layer or the data plane.
func (t *Tier) serveConn(c net.Conn) {
	if t.vllm {
		t.serveZMTP(c)
		return
	}
	defer t.untilClose(c)()
	start := time.Now()
	t.shakeDeadline(c, start.Add(min(helloTimeout, time.Duration(t.cfg.HandshakeTimeout))))
	p, err := wire.ReadFrame(c, nil, wire.MaxPreAuthFrame)
	t.shakeDeadline(c, start.Add(time.Duration(t.cfg.HandshakeTimeout)))
	var m wire.Msg
	if err == nil {
		m, err = wire.Decode(p)
	}
	h, ok := m.(wire.Hello)
	switch {
	case err == nil && !ok:
		err = fmt.Errorf("%w: %v before a hello", wire.ErrMalformed, m.Type())
	case err == nil && h.Version != wire.Version:
		wire.Write(c, nil, wire.Disconnect{Code: wire.CodeVersion, Reason: fmt.Sprintf("protocol version %d, want %d", h.Version, wire.Version)})
		err = &rejectError{Code: wire.CodeVersion, Text: fmt.Sprintf("version %d", h.Version)}
	}
	if err != nil {
		t.handshakeFailed(c, err)
		c.Close()
		return
	}
	if h.Kind == wire.KindData {
		var accept func(net.Conn)
		admit := func() (ok bool) {
			accept, ok = t.dp.Admit(h.NodeID)
			return ok
		}
		if err := t.hs.acceptData(c, h, t.live.has, admit); err != nil {
			if accept != nil {
				accept(nil)
			}
			t.handshakeFailed(c, err)
			c.Close()
			return
		}
		c.SetDeadline(time.Time{})
		accept(c)
		return
	}
	if t.nready.Load() >= int64(t.cfg.MaxSessions) {
		// Refused before any proof: a full node costs a dialler no
		// handshake (the cap is checked again when the session is made).
		wire.Write(c, nil, wire.Disconnect{Code: wire.CodeCapacity, Reason: "too many sessions"})
		t.handshakeFailed(c, &rejectError{Code: wire.CodeCapacity, Text: "max_sessions reached"})
		c.Close()
		return
	}
	sh, err := t.hs.acceptControl(c, h)
	if err != nil {
		t.handshakeFailed(c, err)
		c.Close()
		return
	}
	c.SetDeadline(time.Time{})
	t.post(accepted{c, sh})
}

// handshakeFailed counts and logs (rate-limited) a handshake that failed.
func (t *Tier) handshakeFailed(c net.Conn, err error) {
	var re *rejectError
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.rejects.add(false, wire.CodeTimeout)
	} else if errors.As(err, &re) {
		t.rejects.add(re.ByPeer, re.Code)
	} else {
		t.rejects.add(false, wire.CodeOther)
	}
	t.warnLimited("p2p: handshake failed", "remote", c.RemoteAddr(), "err", err)
}

// dial opens a session to addr (host:port; a DNS name resolves now). The
// dial and the handshake together are bounded by handshake_timeout.
func (t *Tier) dial(addr string) *session {
	if t.vllm {
		return t.vdial(addr)
	}
	s := t.newSession(true, addr)
	t.byAddr[addr] = s
	if r := t.redial[addr]; r != nil {
		r.at = time.Time{}
	}
	t.wg.Go(func() {
		deadline := time.Now().Add(time.Duration(t.cfg.HandshakeTimeout))
		ctx, cancel := context.WithDeadline(t.stop, deadline)
		defer cancel()
		c, err := t.net.Dial(ctx, addr)
		var sh shaken
		if err == nil {
			defer t.untilClose(c)()
			t.shakeDeadline(c, deadline)
			if sh, err = t.hs.dialControl(c); err != nil {
				t.handshakeFailed(c, err)
				c.Close()
				if errors.Is(err, os.ErrDeadlineExceeded) {
					err = fmt.Errorf("handshake timed out: %w", err)
				}
			} else {
				c.SetDeadline(time.Time{})
			}
		}
		t.post(dialled{s, addr, c, sh, err})
	})
	return s
}

// scheduleRedial plans the next dial of a static peer that is not
// connected, with capped exponential backoff (S6.1).
func (t *Tier) scheduleRedial(addr string) {
	r := t.redial[addr]
	if r == nil || t.closed {
		return
	}
	r.at = t.env.Now().Add(r.delay)
	r.delay = min(2*r.delay, redialMax)
	t.env.Wake()
}

// redialed resets the backoff of a static peer whose dial connected.
func (t *Tier) redialed(s *session) {
	if s == nil || !s.dialed {
		return
	}
	if r := t.redial[s.addr]; r != nil {
		r.delay = redialMin
	}
}

// redials dials the static peers that are due and returns the next due time.
func (t *Tier) redials(now time.Time) time.Time {
	var next time.Time
	for addr, r := range t.redial {
		if r.at.IsZero() {
			continue
		}
		if o := t.byAddr[addr]; o != nil && !o.dead {
			r.at = time.Time{} // connected the other way, or dialling already
			continue
		}
		if !now.Before(r.at) {
			t.dial(addr)
			continue
		}
		if next.IsZero() || r.at.Before(next) {
			next = r.at
		}
	}
	return next
}

// Lookup implements offload.Tier for requests that name a remote KV
// source: Retry until the peer answered, then its answer (S6.3); Miss for
// every other request and for failed ones.
func (t *Tier) Lookup(k offload.Key, req *offload.Request) offload.Result {
	cr := t.creqOf(req)
	if cr == nil {
		return offload.Miss
	}
	return cr.Lookup(k)
}

// Probe implements offload.Prober: the keys the request's lookups answered
// Retry for are asked at the step's end.
func (t *Tier) Probe(req *offload.Request, keys []offload.Key) {
	if cr := t.creqOf(req); cr != nil {
		cr.Probe(keys)
	}
}

// SubmitStore implements offload.Tier: the P2P tier keeps nothing of its
// own (peers fetch from the CPU tier), so a cascade succeeds at once.
func (t *Tier) SubmitStore(job *offload.Job) {
	t.results = append(t.results, offload.JobResult{ID: job.ID, OK: true})
}

// Finished implements offload.Tier.
func (t *Tier) Finished() []offload.JobResult {
	r := t.results
	t.results = nil
	return r
}

// Pending implements offload.Pender: events not yet applied, results not
// collected, or peer lookups parked on blocks still being written.
func (t *Tier) Pending() bool {
	t.ev.Lock()
	n := len(t.ev.q)
	t.ev.Unlock()
	if n > 0 || len(t.results) > 0 {
		return true
	}
	for s := range t.sessions {
		if s.prod.Parked() {
			return true
		}
	}
	return false
}

// Serve implements offload.Server: it applies what the sockets queued,
// serves parked peer lookups, enforces every timeout and arms the timer
// for the next one.
func (t *Tier) Serve(p offload.Parent) error {
	if t.closed {
		return nil
	}
	t.p = p
	defer func() { t.p = nil }()
	for _, r := range t.owed {
		p.OnRequestFinished(r)
	}
	t.owed = nil
	for q := t.takeEvents(); len(q) > 0; q = t.takeEvents() {
		for _, e := range q {
			e.apply(t)
		}
	}
	now := t.env.Now()
	next := time.Time{}
	soonest := func(d time.Time) {
		if !d.IsZero() && (next.IsZero() || d.Before(next)) {
			next = d
		}
	}
	for s := range t.sessions {
		if !s.dead {
			s.prod.Serve(t.p, now)
			t.applyProd(s)
		}
		soonest(t.timeouts(s, now))
	}
	soonest(t.redials(now))
	t.arm(next)
	return nil
}

// armBy makes sure the manager's clock brings a pass by d, without a
// pass now (a wake per lookup was a wasted hop on the round trip).
func (t *Tier) armBy(d time.Time) {
	if t.timerAt.IsZero() || d.Before(t.timerAt) {
		t.arm(d)
	}
}

// arm asks the manager's clock (the poll goroutine's timer, the only one:
// issue 13) for a pass at d; zero asks nothing. Serve asks again for its
// next deadline every pass.
func (t *Tier) arm(d time.Time) {
	t.timerAt = d
	if !d.IsZero() {
		t.env.WakeAt(d)
	}
}

// OnScheduleEnd implements offload.StepEnder: each consumer request's new
// keys go to its peer in one lookup per step.
func (t *Tier) OnScheduleEnd() {
	now := t.env.Now()
	for s := range t.sessions {
		if s.cons.Ask(now) {
			t.armBy(s.live.LastReceived().Add(time.Duration(t.cfg.KeepaliveInterval))) // pings while it is outstanding (S6.9)
		}
		t.applyCons(s)
	}
}

// OnReset implements offload.Resetter (S5.1): pins held for peers that
// have not fetched yet are released, and parked peer lookups answer miss.
func (t *Tier) OnReset() {
	for s := range t.sessions {
		s.prod.Reset()
		t.applyProd(s)
	}
}

// Close says goodbye to every peer and stops every goroutine.
func (t *Tier) Close() error {
	if t.closed {
		return nil
	}
	t.closed = true
	close(t.closing)
	t.cancelStop()
	t.ln.Close()
	for s := range t.sessions {
		t.send(s, wire.Disconnect{Code: wire.CodeShutdown, Reason: "shutting down"})
		t.kill(s, "")
	}
	err := t.dp.Close()
	t.wg.Wait()
	// Connection goroutines may have posted events after the last pass:
	// run them, so a connection that finished its handshake meanwhile is
	// closed (established sees t.closed) and nothing stays open.
	for _, e := range t.takeEvents() {
		e.apply(t)
	}
	return err
}

// Stats implements offload.StatsReporter.
func (t *Tier) Stats() []offload.Stat {
	ready := 0
	for s := range t.sessions {
		if s.ready {
			ready++
		}
	}
	st := []offload.Stat{
		{Name: "kv_offload_p2p_sessions", Type: "gauge", Help: "Peer sessions that completed the handshake.", Value: float64(ready)},
		{Name: "kv_offload_p2p_sessions_opened_total", Type: "counter", Help: "Peer sessions that completed the handshake since start.", Value: float64(t.st.sessionsOpened)},
		{Name: "kv_offload_p2p_handshakes_in_progress", Type: "gauge", Help: "Accepted connections still in their handshake (capped by max_handshakes).", Value: float64(t.handshakes.Load())},
		{Name: "kv_offload_p2p_handshake_cap_drops_total", Type: "counter", Help: "Connections closed unread because max_handshakes were in progress.", Value: float64(t.capDrops.Load())},
		{Name: "kv_offload_p2p_accept_errors_total", Type: "counter", Help: "Errors of the P2P accept loop (it retries with backoff).", Value: float64(t.accept.errors.Load())},
		{Name: "kv_offload_p2p_duplicate_connections_total", Type: "counter", Help: "Control connections to an already connected peer process; the loser of each pair retired.", Value: float64(t.st.duplicates)},
		{Name: "kv_offload_p2p_lookup_timeouts_total", Type: "counter", Help: "Consumer lookups not answered within lookup_timeout; their keys answered Miss.", Value: float64(t.conss.Stats.LookupTimeouts)},
		{Name: "kv_offload_p2p_peer_deaths_total", Type: "counter", Help: "Sessions ended by connection loss, keep-alive timeout, protocol error or a new incarnation.", Value: float64(t.st.peerDeaths)},
		{Name: "kv_offload_p2p_protocol_errors_total", Type: "counter", Help: "Sessions disconnected for a protocol error.", Value: float64(t.st.protocolErrors)},
		{Name: "kv_offload_p2p_lookups_served_total", Type: "counter", Help: "Peer lookups answered.", Value: float64(t.prods.Stats.LookupsServed)},
		{Name: "kv_offload_p2p_lookup_keys_hit_total", Type: "counter", Help: "Keys peers looked up that this node could serve.", Value: float64(t.prods.Stats.KeysHit)},
		{Name: "kv_offload_p2p_lookup_keys_missed_total", Type: "counter", Help: "Keys peers looked up that this node could not serve.", Value: float64(t.prods.Stats.KeysMissed)},
		{Name: "kv_offload_p2p_fetches_total", Type: "counter", Help: "Fetches received from peers.", Value: float64(t.prods.Stats.Fetches)},
		{Name: "kv_offload_p2p_rounds_ok_total", Type: "counter", Help: "Rounds this node served or loaded successfully.", Value: float64(t.conss.Stats.RoundsOK + t.prods.Stats.RoundsOK)},
		{Name: "kv_offload_p2p_rounds_failed_total", Type: "counter", Help: "Rounds that failed on either side.", Value: float64(t.conss.Stats.RoundsFailed + t.prods.Stats.RoundsFailed)},
		{Name: "kv_offload_p2p_load_timeouts_total", Type: "counter", Help: "Loads aborted after load_timeout.", Value: float64(t.conss.Stats.LoadTimeouts)},
		{Name: "kv_offload_p2p_quarantines_total", Type: "counter", Help: "Loads whose abort was not acknowledged in time; their slots stayed quarantined until the data plane proved the writer stopped.", Value: float64(t.conss.Stats.Quarantines)},
		{Name: "kv_offload_p2p_pin_expiries_total", Type: "counter", Help: "Pins for peers released after pin_hold unclaimed.", Value: float64(t.prods.Stats.PinExpiries)},
	}
	for side, by := range [2]string{"local", "peer"} {
		for c := range wire.NumCodes {
			if n := t.rejects[side][c].Load(); n > 0 {
				st = append(st, offload.Stat{Name: "kv_offload_p2p_handshake_rejects_total", Type: "counter",
					Help: "Handshakes that failed, by code and by which side refused.", Value: float64(n),
					Labels: []string{"code", c.String(), "by", by}})
			}
		}
	}
	for s := range t.sessions {
		if !s.ready || s.dead {
			continue
		}
		ps, peer := &s.cons.Stats, []string{"peer", s.peer}
		st = append(st,
			offload.Stat{Name: "kv_offload_p2p_peer_lookups_sent_total", Type: "counter", Help: "Lookups sent to the peer (this session).", Value: float64(ps.LookupsSent), Labels: peer},
			offload.Stat{Name: "kv_offload_p2p_peer_lookups_answered_total", Type: "counter", Help: "Lookups the peer answered (this session).", Value: float64(ps.LookupsAnswered), Labels: peer},
			offload.Stat{Name: "kv_offload_p2p_peer_bytes_total", Type: "counter", Help: "Block bytes of rounds loaded from (in) and written to (out) the peer (this session).", Value: float64(ps.BytesIn), Labels: []string{"peer", s.peer, "direction", "in"}},
			offload.Stat{Name: "kv_offload_p2p_peer_bytes_total", Type: "counter", Help: "Block bytes of rounds loaded from (in) and written to (out) the peer (this session).", Value: float64(s.prod.BytesOut), Labels: []string{"peer", s.peer, "direction", "out"}},
			offload.Stat{Name: "kv_offload_p2p_peer_round_seconds", Type: "histogram", Help: "Rounds loaded from the peer, from the fetch to their end (this session).", Hist: ps.Rounds.Clone(), Labels: peer})
	}
	if dp, ok := t.dp.(interface{ counters() *dataStats }); ok {
		tp := dp.counters()
		st = append(st,
			offload.Stat{Name: "kv_offload_p2p_data_bytes_sent_total", Type: "counter", Help: "Block bytes written to peers.", Value: float64(tp.bytesOut.Load())},
			offload.Stat{Name: "kv_offload_p2p_data_bytes_received_total", Type: "counter", Help: "Block bytes read from peers.", Value: float64(tp.bytesIn.Load())},
			offload.Stat{Name: "kv_offload_p2p_crc_errors_total", Type: "counter", Help: "Blocks whose CRC32C did not match (S7.2).", Value: float64(tp.crcErrors.Load())},
			offload.Stat{Name: "kv_offload_p2p_unexpected_blocks_total", Type: "counter", Help: "Blocks (TCP: data connections dropped for one; NIXL: round notifications) nobody expected.", Value: float64(tp.strays.Load())},
			offload.Stat{Name: "kv_offload_p2p_data_cap_drops_total", Type: "counter", Help: "Inbound data connections refused in their handshake because the peer had max_data_conns.", Value: float64(tp.capDrops.Load())})
	}
	if tp, ok := t.dp.(*TCPPlane); ok {
		st = append(st,
			offload.Stat{Name: "kv_offload_p2p_bulk_waits_total", Type: "counter", Help: "Times a block write waited for one of the bulk_concurrency tokens.", Value: float64(tp.bulk.waits.Load())},
			offload.Stat{Name: "kv_offload_p2p_bulk_yields_total", Type: "counter", Help: "Block writes that gave their bulk token back before they ended, to wait for the peer to read: its socket was full.", Value: float64(tp.bulkYields.Load())})
	}
	return st
}

// Peers describes the sessions, for the daemon's status.
func (t *Tier) Peers() []api.PeerInfo {
	var out []api.PeerInfo
	for s := range t.sessions {
		out = append(out, api.PeerInfo{Node: s.peer, Addr: s.peerAddr, Ready: s.ready, Dialed: s.dialed, Requests: s.cons.Requests(), Rounds: s.prod.Rounds()})
	}
	return out
}

func toWire(ks []offload.Key) []wire.Key {
	out := make([]wire.Key, len(ks))
	for i, k := range ks {
		out[i] = k
	}
	return out
}

var _ io.Closer = (*Tier)(nil)
