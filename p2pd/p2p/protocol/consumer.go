package protocol

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// ConsumerConfig bounds the consumer's waits (S6.6, S6.10).
type ConsumerConfig struct {
	LookupTimeout   time.Duration // an unanswered lookup's keys miss after it
	LoadTimeout     time.Duration // a fetch without transfer_done is aborted after it
	AbortAckTimeout time.Duration // an abort without abort_ack is quarantined after it
	BlockBytes      int
	// DoneCompletes makes the producer's transfer_done the whole of a
	// round's end (vLLM's dialect, whose NIXL writes carry no notification
	// and no checksum): the data plane's expectation of the round only
	// keeps it progressing (a one-sided write over UCX's TCP transport
	// needs the target to) and reports only a failure; a round that ended
	// well releases it with Unexpect.
	DoneCompletes bool
}

// ConsumerStats counts what every consumer of a node did.
type ConsumerStats struct {
	RoundsOK, RoundsFailed                    uint64
	LookupTimeouts, LoadTimeouts, Quarantines uint64
}

// Consumers is what a node's consumers share: config, counters, and the
// round numbers (one counter for the node, so rounds stay unique when
// duplicate sessions merge, S6.2).
type Consumers struct {
	Config ConsumerConfig
	Stats  ConsumerStats
	Log    *slog.Logger // nil: discarded
	round  uint64
}

// New returns the consumer of one session.
func (cs *Consumers) New() *Consumer {
	return &Consumer{cs: cs, reqs: map[string]*Req{}, loads: map[uint64]*load{}, stopping: map[uint64]*load{},
		Stats: PeerStats{Rounds: offload.NewHistogram(offload.LatencyBounds...)}}
}

// probe is a key's state in a request's lookups, and for a key asked and
// not answered yet, the lookup it was asked in.
type probe struct {
	state  probeState
	lookup uint32 // while pending: the request's lookup that asked it (sentLookup.n)
}

type probeState int8

const (
	probeUnsent  probeState = iota // looked up, not asked yet (in Req.unsent)
	probePending                   // asked, not answered yet
	probeHit
	probeMiss
)

// sentLookup is one lookup frame of a request with keys still unanswered:
// each has its own lookup_timeout from when it was sent (S6.10).
type sentLookup struct {
	n    uint32    // the request's count of lookups sent, this one included
	at   time.Time // sent
	left int       // its keys not answered yet
	due  bool      // timed out (Timeouts)
}

// Req is a local request that fetches from the session's peer (S6.2).
type Req struct {
	Req        *offload.Request
	c          *Consumer
	kvID       string
	probes     map[offload.Key]probe
	unsent     []offload.Key
	asked      int    // probes sent to the peer and not answered
	peak       int    // the most probes it held (bounds what is recycled)
	round      uint64 // the round its lookups go in; 0: none open
	lookupOpen bool   // a lookup was sent and no fetch closed it (S6.7)
	// lookups are the lookups sent in this round, from the oldest with a
	// key unanswered on: numbered lookups[0].n, lookups[0].n+1, … (each
	// holds a distinct key, so there are never more than probes).
	lookups  []sentLookup
	sent     uint32 // lookups sent so far (numbers them)
	failed   bool   // answers Miss for the rest of its life (S6.6)
	finished bool
}

// load is a promotion in flight from the peer: it succeeds when the
// peer's transfer_done arrived and every block arrived and verified,
// whichever comes last (S7.1).
type load struct {
	r         *Req
	job       *offload.Job
	round     uint64
	sent      time.Time
	abortedAt time.Time
	done      int8 // transfer_done: 0 not yet, 1 ok, -1 failed
	data      int8 // the data plane: 0 pending, 1 all verified, -1 failed
	reported  bool
}

// Consumer is the fetching side of one P2P session (S6.2, S6.6, S6.7,
// S6.10): its requests' lookups and the rounds they load. Its methods are
// the events; Take returns the actions they emitted. Everything runs under
// the manager lock.
type Consumer struct {
	outbox
	Peer     string // for logs; set once the handshake named the peer
	cs       *Consumers
	dead     bool
	reqs     map[string]*Req  // by kv_request_id
	loads    map[uint64]*load // by round
	stopping map[uint64]*load // failed, waiting for the data plane to stop reading (Unexpected)
	quar     []*load          // waiting for the peer's removal from the data plane (PeerRemoved)
	removing bool             // a RemovePeer is outstanding: one at a time (a second would end at once)
	// Stats are this session's own (issue 14: per-peer metrics; they end
	// with the session).
	Stats PeerStats
}

// PeerStats is what one consumer did with its peer.
type PeerStats struct {
	LookupsSent, LookupsAnswered uint64
	BytesIn                      uint64             // block bytes of rounds loaded
	Rounds                       *offload.Histogram // seconds from fetch to the round's end, ok or not
}

// The consumer's further actions.
type (
	// ExpectBlocks registers a round's destination slots with the data
	// plane; it reports with Consumer.BlocksArrived.
	ExpectBlocks struct {
		Round uint64
		Slots []uint32
	}
	// Unexpect stops the data plane reading a round; it reports with
	// Consumer.Unexpected once no block of it reaches a slot.
	Unexpect struct{ Round uint64 }
	// RemovePeer drops the peer from the data plane, so that it can no
	// longer write into any slot; it reports with Consumer.PeerRemoved.
	RemovePeer struct{}
	// Progress tells the engine that lookup answers changed (S2.10).
	Progress struct{}
	// WakeAt asks for a pass by At (the consumer's next deadline).
	WakeAt struct{ At time.Time }
)

func (ExpectBlocks) isAction() {}
func (Unexpect) isAction()     {}
func (RemovePeer) isAction()   {}
func (Progress) isAction()     {}
func (WakeAt) isAction()       {}

// spare holds the emptied probe maps and unsent lists of finished
// requests, so a new request's lookups reuse them instead of growing
// their own (issue 12: lookups allocate nothing per key). The garbage
// collector empties it; maps of more than maxSpareProbes keys are dropped.
var spares sync.Pool

type spare struct {
	probes  map[offload.Key]probe
	unsent  []offload.Key
	lookups []sentLookup
}

const maxSpareProbes = 4096

// Add registers a local request fetching kv_request_id kvID from the
// peer; nil when another request already uses kvID (it will not fetch).
func (c *Consumer) Add(req *offload.Request, kvID string) *Req {
	if c.reqs[kvID] != nil {
		return nil
	}
	sp, _ := spares.Get().(*spare)
	if sp == nil {
		sp = &spare{probes: map[offload.Key]probe{}}
	}
	r := &Req{Req: req, c: c, kvID: kvID, probes: sp.probes, unsent: sp.unsent, lookups: sp.lookups}
	c.reqs[kvID] = r
	return r
}

// Consumer is the session side the request belongs to now (it moves when
// duplicate sessions merge).
func (r *Req) Consumer() *Consumer { return r.c }

// Probes reports how many of the request's keys were asked and are not
// answered, and how many it tracks (diagnostics and tests).
func (r *Req) Probes() (asked, tracked int) { return r.asked, len(r.probes) }

// Lookup answers from what the peer said, and changes nothing: Hit, Miss,
// or Retry while the key is not answered (or not asked: Probe).
func (r *Req) Lookup(k offload.Key) offload.Result {
	if r.failed || r.finished || r.c.dead {
		return offload.Miss
	}
	switch r.probes[k].state {
	case probeHit:
		return offload.Hit
	case probeMiss:
		return offload.Miss
	}
	return offload.Retry
}

// Probe records the keys to ask the peer about at the step's end (Ask):
// those the request has not asked yet (offload.Prober).
func (r *Req) Probe(keys []offload.Key) {
	if r.failed || r.finished || r.c.dead {
		return
	}
	for _, k := range keys {
		if _, ok := r.probes[k]; !ok {
			r.probes[k] = probe{state: probeUnsent}
			r.unsent = append(r.unsent, k)
		}
	}
	r.peak = max(r.peak, len(r.probes))
}

func (r *Req) waiting() bool { return r.asked > 0 }

// lookupOf is the lookup that asked the pending key v (the zero one if
// none is tracked: it cannot happen, lookups hold every pending key's).
func (r *Req) lookupOf(v probe) sentLookup {
	if len(r.lookups) > 0 {
		if i := int(v.lookup) - int(r.lookups[0].n); i >= 0 && i < len(r.lookups) {
			return r.lookups[i]
		}
	}
	return sentLookup{}
}

// answer records the peer's answer for an asked key; an answer for a key
// never asked (a confused or hostile peer) changes nothing. A lookup
// whose keys are all answered stops being bounded (S6.10).
func (r *Req) answer(k offload.Key, p probeState) {
	v, ok := r.probes[k]
	if !ok || v.state != probePending {
		return
	}
	r.probes[k] = probe{state: p}
	r.asked--
	if len(r.lookups) == 0 {
		return
	}
	if i := int(v.lookup) - int(r.lookups[0].n); i >= 0 && i < len(r.lookups) {
		r.lookups[i].left--
	}
	done := 0
	for done < len(r.lookups) && r.lookups[done].left == 0 {
		done++
	}
	if done > 0 {
		r.lookups = append(r.lookups[:0], r.lookups[done:]...) // keeps the array for the next lookups
	}
}

// Ask sends each request's new keys in one lookup (the step's end) and
// reports whether it sent any.
func (c *Consumer) Ask(now time.Time) bool {
	sent := false
	for _, r := range c.reqs {
		if len(r.unsent) == 0 || r.failed {
			continue
		}
		if r.round == 0 {
			c.cs.round++
			r.round = c.cs.round
		}
		if len(r.lookups) == 0 { // the request's oldest bound starts (S6.10)
			c.emit(WakeAt{now.Add(c.cs.Config.LookupTimeout)})
		}
		r.sent++
		r.lookups = append(r.lookups, sentLookup{n: r.sent, at: now, left: len(r.unsent)})
		keys := make([]wire.Key, len(r.unsent))
		for i, k := range r.unsent {
			keys[i] = k
			r.probes[k] = probe{state: probePending, lookup: r.sent}
		}
		c.emit(SendFrame{wire.Lookup{ReqID: r.kvID, Round: r.round, Keys: keys}})
		c.Stats.LookupsSent++
		r.asked += len(r.unsent)
		r.unsent = r.unsent[:0]
		r.lookupOpen = true
		sent = true
	}
	return sent
}

// Left says that the lookups asked before the session was ready (held
// until its handshake ended) leave now: each one's lookup_timeout runs
// from now (S6.10), not from when the engine asked.
func (c *Consumer) Left(now time.Time) {
	for _, r := range c.reqs {
		for i := range r.lookups {
			r.lookups[i].at = now
		}
	}
}

// Sent says that lookup m, asked earlier and held back by the dialect
// (vLLM's wire cannot have two lookups of one request and keys out at
// once), leaves now: its lookup_timeout runs from now (S6.10).
func (c *Consumer) Sent(m wire.Lookup, now time.Time) {
	r := c.reqs[m.ReqID]
	if r == nil || r.round != m.Round || len(m.Keys) == 0 || len(r.lookups) == 0 {
		return
	}
	v := r.probes[offload.Key(m.Keys[0])]
	if v.state != probePending {
		return
	}
	if i := int(v.lookup) - int(r.lookups[0].n); i >= 0 && i < len(r.lookups) {
		r.lookups[i].at = now
	}
}

// ErrUnknownRound is an answer for a round this node never started: a
// confused or hostile peer. It is a handler error, not at once a protocol
// error (S8.2).
var ErrUnknownRound = errors.New("p2p: answer for a round this node never started")

func (c *Consumer) checkRound(round uint64) error {
	if round == 0 || round > c.cs.round {
		return fmt.Errorf("%w: round %d (last %d)", ErrUnknownRound, round, c.cs.round)
	}
	return nil
}

// LookupResp is a lookup_resp frame: the peer's answers.
func (c *Consumer) LookupResp(m wire.LookupResp) error {
	if err := c.checkRound(m.Round); err != nil {
		return err
	}
	if len(m.Hits) != len(m.Keys) {
		return fmt.Errorf("%w: an answer of %d hits for %d keys", ErrMalformed, len(m.Hits), len(m.Keys))
	}
	c.Stats.LookupsAnswered++
	r := c.reqs[m.ReqID]
	if r == nil || r.round != m.Round {
		return nil // late: the request finished or fetched already
	}
	for i, k := range m.Keys {
		if m.Hits[i] {
			r.answer(k, probeHit)
		} else {
			r.answer(k, probeMiss)
		}
	}
	c.emit(Progress{}) // lookup answers changed (S2.10)
	return nil
}

// Load is the manager's promotion of keys the peer answered Hit: they are
// fetched into the job's slots in the lookups' round. usable says whether
// the session can carry it (ready, alive); a load that cannot start fails
// at once.
func (c *Consumer) Load(r *Req, job *offload.Job, usable bool, now time.Time) {
	fail := func() {
		if r != nil {
			r.failed = true
		}
		c.emit(JobDone{offload.JobResult{ID: job.ID}})
	}
	if r == nil || r.failed || c.dead || !usable || r.round == 0 {
		fail()
		return
	}
	for _, k := range job.Keys {
		if r.probes[k].state != probeHit {
			fail()
			return
		}
	}
	l := &load{r: r, job: job, round: r.round, sent: now}
	c.loads[l.round] = l
	slots := make([]uint32, len(job.Slots))
	for i, sl := range job.Slots {
		slots[i] = uint32(sl)
	}
	keys := make([]wire.Key, len(job.Keys))
	for i, k := range job.Keys {
		keys[i] = k
	}
	if c.cs.Config.DoneCompletes {
		l.data = 1 // the data plane reports only a failure
	}
	c.emit(ExpectBlocks{Round: l.round, Slots: slots})
	c.emit(SendFrame{wire.Fetch{ReqID: r.kvID, Round: l.round, Keys: keys, Slots: slots}})
	r.lookupOpen = false
	// The round ends: a new one asks again. Keys probed and not yet asked
	// stay (an engine looking a window further in the step that promoted
	// these): the next round asks them at once.
	for k, p := range r.probes {
		if p.state != probeUnsent {
			delete(r.probes, k)
		}
	}
	r.asked = 0
	r.round = 0
	r.lookups = r.lookups[:0]
	c.emit(WakeAt{l.sent.Add(c.cs.Config.LoadTimeout)}) // the load's timeout
}

// TransferDone is a transfer_done frame: the producer's half of a round.
func (c *Consumer) TransferDone(m wire.TransferDone, now time.Time) error {
	if err := c.checkRound(m.Round); err != nil {
		return err
	}
	l := c.loads[m.Round]
	if l == nil || l.r.kvID != m.ReqID {
		return nil // late or raced with a local timeout
	}
	l.done = -1
	if m.OK {
		l.done = 1
	}
	c.settle(l, now)
	return nil
}

// BlocksArrived is the data plane's half of a round: every block arrived
// and verified (err nil), or the round failed there.
func (c *Consumer) BlocksArrived(round uint64, err error, now time.Time) {
	l := c.loads[round]
	if l == nil || l.reported {
		return
	}
	l.data = 1
	if err != nil {
		l.data = -1
		if c.cs.Log != nil {
			c.cs.Log.Warn("p2p: fetch failed in the data plane", "peer", c.Peer, "round", round, "err", err)
		}
	}
	c.settle(l, now)
}

// settle reports a load once both halves are known, or as soon as one
// failed (after making sure no more bytes of it reach a slot).
func (c *Consumer) settle(l *load, now time.Time) {
	switch {
	case l.done == 1 && l.data == 1:
		delete(c.loads, l.round)
		if c.cs.Config.DoneCompletes {
			c.emit(Unexpect{l.round}) // the data plane's expectation ends with the round
		}
		c.result(l, true, now)
	case l.done == -1 || l.data == -1:
		c.stop(l)
	}
}

// stop fails a load whose blocks may still arrive: the slots are free only
// once the data plane stopped reading the round (Unexpected).
func (c *Consumer) stop(l *load) {
	delete(c.loads, l.round)
	l.r.failed = true
	c.stopping[l.round] = l
	c.emit(Unexpect{l.round})
}

// Unexpected is the data plane's word that no block of round reaches a
// slot any more: its failed load reports.
func (c *Consumer) Unexpected(round uint64, now time.Time) {
	if l := c.stopping[round]; l != nil {
		delete(c.stopping, round)
		c.result(l, false, now)
	}
}

// AbortAck is an abort_ack frame: the producer stopped writing the round
// before it acknowledged.
func (c *Consumer) AbortAck(m wire.AbortAck) error {
	if err := c.checkRound(m.Round); err != nil {
		return err
	}
	l := c.loads[m.Round]
	if l == nil || l.r.kvID != m.ReqID {
		return nil
	}
	c.stop(l)
	return nil
}

// Timeouts enforces the lookup bound (S6.10), the load timeout (abort)
// and the abort-ack timeout (quarantine, S6.6), and returns the next
// deadline (zero: none).
func (c *Consumer) Timeouts(now time.Time) time.Time {
	var next time.Time
	soonest := func(d time.Time) {
		if next.IsZero() || d.Before(next) {
			next = d
		}
	}
	cfg := c.cs.Config
	for _, r := range c.reqs {
		// Each unanswered lookup sent by now-LookupTimeout times out (one
		// held back by the dialect and sent later has a later at).
		due := 0
		for i := range r.lookups {
			if l := &r.lookups[i]; l.left > 0 && !now.Before(l.at.Add(cfg.LookupTimeout)) {
				l.due = true
				due++
			}
		}
		if due > 0 {
			c.cs.Stats.LookupTimeouts += uint64(due)
			if c.cs.Log != nil {
				c.cs.Log.Warn("p2p: lookup not answered in time; its keys miss", "peer", c.Peer, "kv_request_id", r.kvID, "lookups", due)
			}
			for k, v := range r.probes {
				if v.state == probePending && r.lookupOf(v).due {
					r.answer(k, probeMiss)
				}
			}
			c.emit(Progress{})
		}
		for _, l := range r.lookups {
			if l.left > 0 {
				soonest(l.at.Add(cfg.LookupTimeout))
			}
		}
	}
	for round, l := range c.loads {
		switch {
		case l.abortedAt.IsZero():
			d := l.sent.Add(cfg.LoadTimeout)
			if !now.Before(d) {
				c.cs.Stats.LoadTimeouts++
				l.abortedAt = now
				l.r.failed = true
				c.emit(Progress{})
				c.emit(SendFrame{wire.AbortFetch{ReqID: l.r.kvID, Round: round}})
				d = now.Add(cfg.AbortAckTimeout)
			}
			soonest(d)
		default:
			d := l.abortedAt.Add(cfg.AbortAckTimeout)
			if !now.Before(d) {
				c.quarantine(l)
				continue
			}
			soonest(d)
		}
	}
	return next
}

// quarantine handles an abort not acknowledged in time (S6.6): the load
// fails for the request now, but its slots are reported free only once
// the data plane dropped the peer (PeerRemoved), so its writer is stopped.
func (c *Consumer) quarantine(l *load) {
	c.cs.Stats.Quarantines++
	delete(c.loads, l.round)
	l.r.failed = true
	c.emit(Progress{})
	c.quar = append(c.quar, l)
	if c.cs.Log != nil {
		c.cs.Log.Warn("p2p: abort not acknowledged; quarantining the load's slots", "peer", c.Peer, "round", l.round)
	}
	c.removePeer()
}

// removePeer asks the data plane to drop the peer, unless a removal is
// already under way: its end covers every load quarantined meanwhile
// (it closed the peer's connections when it began), while a second
// removal of a removed peer would report at once, before the first one's
// readers left the slots.
func (c *Consumer) removePeer() {
	if !c.removing {
		c.removing = true
		c.emit(RemovePeer{})
	}
}

// PeerRemoved is the data plane's word that the peer can no longer write:
// the quarantined loads report.
func (c *Consumer) PeerRemoved(now time.Time) {
	c.removing = false
	for _, l := range c.quar {
		c.result(l, false, now)
	}
	c.quar = nil
}

// Finish is the request's end (S6.7): its rounds in flight are aborted,
// and if a lookup is open one empty terminal fetch releases the
// producer's pins.
func (c *Consumer) Finish(r *Req, now time.Time) {
	r.finished = true
	for round, l := range c.loads {
		if l.r == r && l.abortedAt.IsZero() {
			l.abortedAt = now
			c.emit(SendFrame{wire.AbortFetch{ReqID: r.kvID, Round: round}})
		}
	}
	if r.lookupOpen {
		c.emit(SendFrame{wire.Fetch{ReqID: r.kvID, Round: r.round}})
		r.lookupOpen = false
	}
	if c.reqs[r.kvID] == r {
		delete(c.reqs, r.kvID)
		if r.peak <= maxSpareProbes {
			clear(r.probes)
			spares.Put(&spare{r.probes, r.unsent[:0], r.lookups[:0]})
		}
		r.probes, r.unsent, r.lookups = nil, nil, nil // nothing reads a finished request's probes
	}
}

// Merge moves the requests of a dialling session (nothing sent on their
// behalf yet) into this one; a request whose kv_request_id this one
// already has fails. It returns the kv_request_ids that collided.
func (c *Consumer) Merge(from *Consumer) map[string]bool {
	collided := map[string]bool{}
	for id, r := range from.reqs {
		if c.reqs[id] != nil {
			r.failed = true // two local requests share a kv_request_id
			collided[id] = true
			continue
		}
		r.c = c
		c.reqs[id] = r
	}
	from.reqs = map[string]*Req{}
	return collided
}

// Kill is the session's death: the requests fail (they recompute) and
// every load fails — at once if the peer never joined the data plane
// (ready false), else once it was removed from it (RemovePeer, then
// PeerRemoved).
func (c *Consumer) Kill(ready bool, now time.Time) {
	c.dead = true
	for _, r := range c.reqs {
		r.failed = true
	}
	if len(c.reqs) > 0 {
		c.emit(Progress{}) // their lookups now answer Miss (S2.10)
	}
	for _, l := range c.loads {
		c.quar = append(c.quar, l)
	}
	for _, l := range c.stopping {
		c.quar = append(c.quar, l)
	}
	c.loads, c.stopping = map[uint64]*load{}, map[uint64]*load{}
	if !ready {
		c.PeerRemoved(now)
		return
	}
	c.removePeer()
}

// Busy says whether work with the peer is outstanding: loads, quarantined
// loads, or a lookup waiting for its answer.
func (c *Consumer) Busy() bool {
	if len(c.loads) > 0 || len(c.quar) > 0 {
		return true
	}
	for _, r := range c.reqs {
		if r.lookupOpen && r.waiting() {
			return true
		}
	}
	return false
}

// OpenRound is the round of kvID's open lookup (0: none), for a wire
// whose lookup answers carry no round (vLLM's G2).
func (c *Consumer) OpenRound(kvID string) uint64 {
	if r := c.reqs[kvID]; r != nil {
		return r.round
	}
	return 0
}

// Requests is how many requests fetch from the peer.
func (c *Consumer) Requests() int { return len(c.reqs) }

// LastRound is the last round number the node gave out.
func (cs *Consumers) LastRound() uint64 { return cs.round }

func (c *Consumer) result(l *load, ok bool, now time.Time) {
	if l.reported {
		return
	}
	l.reported = true
	r := offload.JobResult{ID: l.job.ID, OK: ok, Duration: now.Sub(l.sent)}
	c.Stats.Rounds.Observe(r.Duration.Seconds())
	if ok {
		r.Bytes = int64(len(l.job.Keys) * c.cs.Config.BlockBytes)
		c.Stats.BytesIn += uint64(r.Bytes)
		c.cs.Stats.RoundsOK++
	} else {
		c.cs.Stats.RoundsFailed++
	}
	c.emit(JobDone{r})
}
