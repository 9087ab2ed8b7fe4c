package p2p

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// Tier is the P2P secondary tier. Its methods run under the manager lock
// (the offload.Tier contract); its socket goroutines only post closures to
// an event queue and wake the poll goroutine, which runs them in Serve.
type Tier struct {
	cfg        Config
	node       offload.Config
	env        offload.TierEnv
	log        *slog.Logger
	net        Network
	dp         DataPlane
	ln         net.Listener
	self       wire.Hello
	addr       string
	blockBytes int
	wg         sync.WaitGroup
	closing    chan struct{}

	ev struct {
		sync.Mutex
		q []func()
	}

	// Everything below is touched only under the manager lock.
	p        offload.Parent // valid during Serve
	sessions map[*session]bool
	byNode   map[string]*session
	byAddr   map[string]*session
	results  []offload.JobResult
	owed     []*offload.Request // outside requests owed OnRequestFinished
	timer    *time.Timer
	timerAt  time.Time
	closed   bool
	st       stats
	// lookupSeq numbers the outside requests of served lookups.
	lookupSeq uint64
}

type stats struct {
	sessionsOpened, peerDeaths, protocolErrors  uint64
	rejects                                     map[string]uint64
	lookupsServed, keysHit, keysMissed, fetches uint64
	roundsOK, roundsFailed                      uint64
	loadTimeouts, abortAcks, quarantines        uint64
	pinExpiries                                 uint64
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
	log := env.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	t := &Tier{cfg: cfg, node: node, env: env, log: log, net: n, blockBytes: env.Arena.SlotBytes(),
		closing: make(chan struct{}), sessions: map[*session]bool{}, byNode: map[string]*session{},
		byAddr: map[string]*session{}, st: stats{rejects: map[string]uint64{}}}
	t.self = wire.Hello{Version: wire.Version, Kind: wire.KindControl, NodeID: cfg.NodeID}
	rand.Read(t.self.Incarnation[:])
	if t.self.NodeID == "" {
		var id [8]byte
		rand.Read(id[:])
		t.self.NodeID = "node-" + hex.EncodeToString(id[:])
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
	switch cfg.DataPlane {
	case "nixl":
		t.dp, err = NewNIXLPlane(env.Arena, t.self, NIXLConfig{UCX: cfg.NIXLParams}, log)
		if err != nil {
			ln.Close()
			return nil, err
		}
	default:
		t.dp = NewTCPPlane(env.Arena, n, cfg.DataConns, t.self, log)
	}
	t.wg.Go(t.acceptLoop)
	for _, a := range cfg.Peers {
		t.dial(a)
	}
	log.Info("p2p tier listening", "addr", t.addr, "node", t.self.NodeID)
	return t, nil
}

// Addr is the address peers reach this node's P2P port at.
func (t *Tier) Addr() string { return t.addr }

// NodeID is this node's id.
func (t *Tier) NodeID() string { return t.self.NodeID }

// post queues fn to run under the manager lock and wakes the poll
// goroutine. Socket goroutines call it; it never blocks for long.
func (t *Tier) post(fn func()) {
	t.ev.Lock()
	t.ev.q = append(t.ev.q, fn)
	t.ev.Unlock()
	t.env.Wake()
}

func (t *Tier) acceptLoop() {
	for {
		c, err := t.ln.Accept()
		if err != nil {
			return
		}
		t.wg.Go(func() {
			c.SetReadDeadline(time.Now().Add(time.Duration(t.cfg.HandshakeTimeout)))
			p, err := wire.ReadFrame(c, nil, wire.MaxFrame)
			var m wire.Msg
			if err == nil {
				m, err = wire.Decode(p)
			}
			h, ok := m.(wire.Hello)
			if err != nil || !ok || h.Version != wire.Version {
				t.log.Warn("p2p: dropping a connection without a valid hello", "remote", c.RemoteAddr(), "err", err)
				c.Close()
				return
			}
			c.SetReadDeadline(time.Time{})
			if h.Kind == wire.KindData {
				t.dp.Accept(c, h)
				return
			}
			t.post(func() { t.attach(t.newSession(false, ""), c) })
		})
	}
}

// dial opens a session to addr (host:port; a DNS name resolves now).
func (t *Tier) dial(addr string) *session {
	s := t.newSession(true, addr)
	t.byAddr[addr] = s
	t.wg.Go(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(t.cfg.HandshakeTimeout))
		defer cancel()
		c, err := t.net.Dial(ctx, addr)
		if err == nil {
			_, err = wire.Write(c, nil, t.self)
			if err != nil {
				c.Close()
			}
		}
		t.post(func() {
			if err != nil {
				t.kill(s, fmt.Sprintf("dialling %s: %v", addr, err))
				return
			}
			t.attach(s, c)
		})
	})
	return s
}

// Lookup implements offload.Tier for requests that name a remote KV
// source: Retry until the peer answered, then its answer (S6.3); Miss for
// every other request and for failed ones.
func (t *Tier) Lookup(k offload.Key, req *offload.Request) offload.Result {
	cr := t.creqOf(req)
	if cr == nil || cr.failed || cr.finished {
		return offload.Miss
	}
	switch v, ok := cr.probes[k]; {
	case !ok:
		cr.probes[k] = probePending
		cr.unsent = append(cr.unsent, k)
		return offload.Retry
	case v == probeHit:
		return offload.Hit
	case v == probeMiss:
		return offload.Miss
	}
	return offload.Retry
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
		if len(s.lookups) > 0 {
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
	for {
		t.ev.Lock()
		q := t.ev.q
		t.ev.q = nil
		t.ev.Unlock()
		if len(q) == 0 {
			break
		}
		for _, fn := range q {
			fn()
		}
	}
	now := time.Now()
	next := time.Time{}
	soonest := func(d time.Time) {
		if !d.IsZero() && (next.IsZero() || d.Before(next)) {
			next = d
		}
	}
	for s := range t.sessions {
		t.serveLookups(s, now)
		soonest(t.timeouts(s, now))
	}
	t.arm(next)
	return nil
}

// arm makes the timer wake the poll goroutine at d (zero: disarm).
func (t *Tier) arm(d time.Time) {
	if t.timer == nil {
		t.timer = time.AfterFunc(time.Hour, t.env.Wake)
		t.timer.Stop()
	}
	if d.IsZero() {
		t.timer.Stop()
		t.timerAt = time.Time{}
		return
	}
	if !d.Equal(t.timerAt) {
		t.timerAt = d
		t.timer.Reset(time.Until(d))
	}
}

// OnScheduleEnd implements offload.StepEnder: each consumer request's new
// keys go to its peer in one lookup per step.
func (t *Tier) OnScheduleEnd() {
	for s := range t.sessions {
		for _, cr := range s.creqs {
			if len(cr.unsent) == 0 || cr.failed {
				continue
			}
			if cr.round == 0 {
				cr.round = s.nextRound()
			}
			t.send(s, wire.Lookup{ReqID: cr.kvID, Round: cr.round, Keys: toWire(cr.unsent)})
			cr.unsent = nil
			cr.lookupOpen = true
		}
	}
}

// OnReset implements offload.Resetter (S5.1): pins held for peers that
// have not fetched yet are released, and parked peer lookups answer miss.
func (t *Tier) OnReset() {
	for s := range t.sessions {
		for _, l := range s.lookups {
			t.send(s, wire.LookupResp{ReqID: l.msg.ReqID, Round: l.msg.Round, Keys: l.msg.Keys, Hits: make([]bool, len(l.msg.Keys))})
			t.owed = append(t.owed, l.req)
		}
		s.lookups = nil
		for k, r := range s.rounds {
			if !r.writing {
				t.failRound(s, r)
				delete(s.rounds, k)
			}
		}
	}
}

// Close says goodbye to every peer and stops every goroutine.
func (t *Tier) Close() error {
	if t.closed {
		return nil
	}
	t.closed = true
	close(t.closing)
	t.ln.Close()
	for s := range t.sessions {
		t.send(s, wire.Disconnect{Reason: "shutting down"})
		t.kill(s, "")
	}
	if t.timer != nil {
		t.timer.Stop()
	}
	err := t.dp.Close()
	t.wg.Wait()
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
	var rejects uint64
	for _, n := range t.st.rejects {
		rejects += n
	}
	st := []offload.Stat{
		{Name: "kv_offload_p2p_sessions", Type: "gauge", Help: "Peer sessions that completed the handshake.", Value: float64(ready)},
		{Name: "kv_offload_p2p_sessions_opened_total", Type: "counter", Help: "Peer sessions that completed the handshake since start.", Value: float64(t.st.sessionsOpened)},
		{Name: "kv_offload_p2p_handshake_rejects_total", Type: "counter", Help: "Peers rejected or rejecting in the handshake.", Value: float64(rejects)},
		{Name: "kv_offload_p2p_peer_deaths_total", Type: "counter", Help: "Sessions ended by connection loss, keep-alive timeout, protocol error or a new incarnation.", Value: float64(t.st.peerDeaths)},
		{Name: "kv_offload_p2p_protocol_errors_total", Type: "counter", Help: "Sessions disconnected for a protocol error.", Value: float64(t.st.protocolErrors)},
		{Name: "kv_offload_p2p_lookups_served_total", Type: "counter", Help: "Peer lookups answered.", Value: float64(t.st.lookupsServed)},
		{Name: "kv_offload_p2p_lookup_keys_hit_total", Type: "counter", Help: "Keys peers looked up that this node could serve.", Value: float64(t.st.keysHit)},
		{Name: "kv_offload_p2p_lookup_keys_missed_total", Type: "counter", Help: "Keys peers looked up that this node could not serve.", Value: float64(t.st.keysMissed)},
		{Name: "kv_offload_p2p_fetches_total", Type: "counter", Help: "Fetches received from peers.", Value: float64(t.st.fetches)},
		{Name: "kv_offload_p2p_rounds_ok_total", Type: "counter", Help: "Rounds this node served or loaded successfully.", Value: float64(t.st.roundsOK)},
		{Name: "kv_offload_p2p_rounds_failed_total", Type: "counter", Help: "Rounds that failed on either side.", Value: float64(t.st.roundsFailed)},
		{Name: "kv_offload_p2p_load_timeouts_total", Type: "counter", Help: "Loads aborted after load_timeout.", Value: float64(t.st.loadTimeouts)},
		{Name: "kv_offload_p2p_quarantines_total", Type: "counter", Help: "Loads whose abort was not acknowledged in time; their slots stayed quarantined until the data plane proved the writer stopped.", Value: float64(t.st.quarantines)},
		{Name: "kv_offload_p2p_pin_expiries_total", Type: "counter", Help: "Pins for peers released after pin_hold unclaimed.", Value: float64(t.st.pinExpiries)},
	}
	if dp, ok := t.dp.(interface{ counters() *dataStats }); ok {
		tp := dp.counters()
		st = append(st,
			offload.Stat{Name: "kv_offload_p2p_data_bytes_sent_total", Type: "counter", Help: "Block bytes written to peers.", Value: float64(tp.bytesOut.Load())},
			offload.Stat{Name: "kv_offload_p2p_data_bytes_received_total", Type: "counter", Help: "Block bytes read from peers.", Value: float64(tp.bytesIn.Load())},
			offload.Stat{Name: "kv_offload_p2p_crc_errors_total", Type: "counter", Help: "Blocks whose CRC32C did not match (S7.2).", Value: float64(tp.crcErrors.Load())},
			offload.Stat{Name: "kv_offload_p2p_unexpected_blocks_total", Type: "counter", Help: "Blocks (TCP: data connections dropped for one; NIXL: round notifications) nobody expected.", Value: float64(tp.strays.Load())})
	}
	return st
}

// Peers describes the sessions, for the daemon's status.
func (t *Tier) Peers() []PeerInfo {
	var out []PeerInfo
	for s := range t.sessions {
		out = append(out, PeerInfo{Node: s.peer, Addr: s.peerAddr, Ready: s.ready, Dialed: s.dialed, Requests: len(s.creqs), Rounds: len(s.rounds)})
	}
	return out
}

// PeerInfo is one session.
type PeerInfo struct {
	Node     string `json:"node"`
	Addr     string `json:"addr"`
	Ready    bool   `json:"ready"`
	Dialed   bool   `json:"dialed"`
	Requests int    `json:"requests"`
	Rounds   int    `json:"rounds"`
}

func toWire(ks []offload.Key) []wire.Key {
	out := make([]wire.Key, len(ks))
	for i, k := range ks {
		out[i] = k
	}
	return out
}

// proof answers a nonce under the cluster token.
func (t *Tier) proof(nonce [32]byte, node string) [32]byte {
	var out [32]byte
	if t.cfg.ClusterToken == "" {
		return out
	}
	m := hmac.New(sha256.New, []byte(t.cfg.ClusterToken))
	m.Write([]byte("kvtier-p2p-auth\x00"))
	m.Write(nonce[:])
	m.Write([]byte(node))
	copy(out[:], m.Sum(nil))
	return out
}

// remoteSource parses kv_transfer_params.remote_kv_source.
func remoteSource(params map[string]any) (kvID, addr string, ok bool) {
	src, _ := params["remote_kv_source"].(map[string]any)
	if src == nil {
		return "", "", false
	}
	kvID, _ = src["kv_request_id"].(string)
	host, _ := src["remote_host"].(string)
	var port string
	switch p := src["remote_port"].(type) {
	case float64:
		port = strconv.Itoa(int(p))
	case int:
		port = strconv.Itoa(p)
	case string:
		port = p
	}
	if kvID == "" || host == "" || port == "" || len(kvID) > wire.MaxString {
		return "", "", false
	}
	return kvID, net.JoinHostPort(host, port), true
}

var errDuplicateFetch = errors.New("duplicate fetch for a round")

var _ io.Closer = (*Tier)(nil)
