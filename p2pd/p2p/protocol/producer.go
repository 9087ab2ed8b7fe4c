package protocol

import (
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// Protocol errors: the peer broke the protocol (S8.1), and the session
// ends.
var (
	ErrDuplicateFetch = errors.New("duplicate fetch for a round")
	ErrMalformed      = errors.New("malformed frame")
)

// ProducerConfig bounds the producer's waits (S6.3, S6.5).
type ProducerConfig struct {
	LookupHold time.Duration // how long a lookup waits on keys still being written
	PinHold    time.Duration // how long pins wait for the peer's fetch
	BlockBytes int           // a block's size, for the leases' byte counts
}

// ProducerStats counts what every producer of a node did.
type ProducerStats struct {
	LookupsServed, KeysHit, KeysMissed, Fetches uint64
	RoundsOK, RoundsFailed, PinExpiries         uint64
}

// Producers is what a node's producers share: config, counters, and the
// sequence that names their lookups' outside requests.
type Producers struct {
	Config ProducerConfig
	Stats  ProducerStats
	Log    *slog.Logger // for the manager's refusals; nil: discarded
	seq    uint64
	first  map[offload.Key]int // scratch of Serve (issue 12: nothing per key)
	hitIdx []int
}

// maxScratchKeys is the largest lookup whose scratch Serve keeps for the
// next: clear costs what a map grew to, so one 65,536-key lookup would
// slow every lookup served after it.
const maxScratchKeys = 4096

// New returns the producer of one session.
func (ps *Producers) New() *Producer {
	return &Producer{ps: ps, rounds: map[RoundID]*round{}, pins: map[uint64]*round{}}
}

// keyState is a key's state in a lookup being served.
type keyState int8

const (
	keyPending keyState = iota // being written here: ask again
	keyHit                     // pinned for the peer
	keyMiss
)

// lookup is a peer's lookup being served; it stays parked while some keys
// are still being written here (HitPending or Retry), at most lookup_hold
// (S6.3).
type lookup struct {
	msg     wire.Lookup
	arrived time.Time
	req     *offload.Request
	state   []keyState // per key of msg
}

// round is one round served to the peer: the pinned supply of its
// lookups, matched against the peer's fetch (S6.4).
type round struct {
	id          RoundID
	supply      map[offload.Key]supply
	jobs        map[uint64]*offload.Job
	pinDeadline map[uint64]time.Time
	demanded    bool
	writing     bool
	aborting    bool
	blocks      int // blocks being written
}

type supply struct {
	slot int32
	job  uint64
}

// Producer is the serving side of one P2P session (S6.3–S6.5, S6.7, S6.8):
// the peer's lookups, the leases that back their hits, the rounds the
// peer fetches and their writes. Its methods are the events; Take returns
// the actions they emitted. Everything runs under the manager lock.
type Producer struct {
	outbox
	// Peer names the peer in the requests made for its lookups and in
	// logs; set once the handshake named it.
	Peer    string
	ps      *Producers
	dead    bool
	rounds  map[RoundID]*round
	lookups []*lookup         // parked on keys still being written
	pins    map[uint64]*round // lease job → its round
	// BytesOut counts the block bytes of rounds written to this peer
	// (issue 14: per-peer metrics; they end with the session).
	BytesOut uint64
}

// Lookup is a lookup frame from the peer: it is served at the next Serve.
func (p *Producer) Lookup(m wire.Lookup, now time.Time) {
	p.lookups = append(p.lookups, &lookup{msg: m, arrived: now, state: make([]keyState, len(m.Keys))})
}

// Serve answers the parked lookups: every key is looked up in this node's
// manager through parent (never recursing into P2P), every hit is pinned
// at once, and exactly one lookup_resp goes back per lookup (S6.3).
func (p *Producer) Serve(parent offload.Parent, now time.Time) {
	if p.dead {
		return
	}
	kept := p.lookups[:0]
	for _, l := range p.lookups {
		if !p.serve(parent, l, now) {
			kept = append(kept, l)
		}
	}
	clear(p.lookups[len(kept):])
	p.lookups = kept
}

// serve advances one lookup and reports whether it was answered.
func (p *Producer) serve(parent offload.Parent, l *lookup, now time.Time) bool {
	ps, m := p.ps, l.msg
	if l.req == nil {
		ps.seq++
		l.req = &offload.Request{ID: "p2p:" + p.Peer + ":" + m.ReqID + ":" + strconv.FormatUint(m.Round, 10) + ":lu" + strconv.FormatUint(ps.seq, 10)}
		if err := parent.OnNewRequest(l.req); err != nil {
			p.log("p2p: serving a lookup", err)
			l.req = nil
			for i := range l.state {
				l.state[i] = keyMiss
			}
		}
	}
	rid := RoundID{m.ReqID, m.Round}
	r := p.rounds[rid]
	var hits []offload.Key // kept by the lease's job
	if ps.first == nil {
		ps.first = map[offload.Key]int{}
	}
	first, hitIdx := ps.first, ps.hitIdx[:0] // a key sent twice gets the answer of its first occurrence
	defer func() {
		if len(first) > maxScratchKeys { // clear costs what the map grew to, for every lookup after
			ps.first, ps.hitIdx = nil, nil
			return
		}
		clear(first)
		ps.hitIdx = hitIdx[:0]
	}()
	for i, wk := range m.Keys {
		k := offload.Key(wk)
		if _, dup := first[k]; dup {
			continue
		}
		first[k] = i
		if l.state[i] != keyPending {
			continue
		}
		if r != nil {
			if _, ok := r.supply[k]; ok {
				l.state[i] = keyHit // pinned by an earlier lookup of the round
				continue
			}
		}
		switch parent.Lookup(k, l.req) {
		case offload.Hit:
			if hits == nil {
				hits = make([]offload.Key, 0, len(m.Keys)-i)
			}
			hits = append(hits, k)
			hitIdx = append(hitIdx, i)
		case offload.Miss:
			l.state[i] = keyMiss
		}
	}
	if len(hits) > 0 {
		if job, err := parent.Lease(hits, l.req); job == nil {
			if err != nil {
				p.log("p2p: pinning hits for a peer", err)
			}
			for _, i := range hitIdx {
				l.state[i] = keyMiss
			}
		} else {
			if r == nil {
				// Sized for the first lease: a round's supply grows once, not as
				// its keys arrive (issue 12).
				r = &round{id: rid, supply: make(map[offload.Key]supply, len(job.Keys)), jobs: map[uint64]*offload.Job{}, pinDeadline: map[uint64]time.Time{}}
				p.rounds[rid] = r
			}
			r.jobs[job.ID] = job
			r.pinDeadline[job.ID] = now.Add(ps.Config.PinHold)
			p.pins[job.ID] = r
			for n, k := range job.Keys {
				r.supply[k] = supply{slot: job.Slots[n], job: job.ID}
			}
			for _, i := range hitIdx {
				l.state[i] = keyHit
			}
		}
	}
	for i, wk := range m.Keys {
		if j := first[offload.Key(wk)]; j != i {
			l.state[i] = l.state[j]
		}
	}
	expired := !now.Before(l.arrived.Add(ps.Config.LookupHold))
	hitsOut := make([]bool, len(m.Keys))
	for i, st := range l.state {
		switch {
		case st == keyHit:
			hitsOut[i] = true
		case st == keyPending && !expired:
			return false
		}
	}
	for _, h := range hitsOut {
		if h {
			ps.Stats.KeysHit++
		} else {
			ps.Stats.KeysMissed++
		}
	}
	ps.Stats.LookupsServed++
	p.emit(SendFrame{wire.LookupResp{ReqID: m.ReqID, Round: m.Round, Keys: m.Keys, Hits: hitsOut}})
	if l.req != nil {
		parent.OnRequestFinished(l.req)
	}
	return true
}

// Fetch is a fetch frame: it is matched against its round's pinned supply
// (S6.4) and the write starts. An empty fetch is terminal: it releases the
// request's pins and parked lookups (S6.7). A second fetch for a round is
// a protocol error (S6.8).
func (p *Producer) Fetch(m wire.Fetch) error {
	p.ps.Stats.Fetches++
	if len(m.Slots) != len(m.Keys) {
		return fmt.Errorf("%w: a fetch of %d keys into %d slots", ErrMalformed, len(m.Keys), len(m.Slots))
	}
	if len(m.Keys) == 0 {
		for id, r := range p.rounds {
			if id.KVID == m.ReqID && !r.writing {
				p.failRound(r)
				delete(p.rounds, id)
			}
		}
		kept := p.lookups[:0]
		for _, l := range p.lookups {
			if l.msg.ReqID == m.ReqID {
				p.finish(l.req)
				continue
			}
			kept = append(kept, l)
		}
		clear(p.lookups[len(kept):])
		p.lookups = kept
		return nil
	}
	rid := RoundID{m.ReqID, m.Round}
	r := p.rounds[rid]
	if r == nil {
		p.ps.Stats.RoundsFailed++
		p.emit(SendFrame{wire.TransferDone{ReqID: m.ReqID, Round: m.Round}})
		return nil
	}
	if r.demanded {
		return fmt.Errorf("%w: request %s round %d", ErrDuplicateFetch, m.ReqID, m.Round)
	}
	r.demanded = true
	pairs := make([]SlotPair, len(m.Keys))
	for i, wk := range m.Keys {
		sup, ok := r.supply[offload.Key(wk)]
		if !ok || m.Slots[i] > 1<<31-1 {
			p.ps.Stats.RoundsFailed++
			p.emit(SendFrame{wire.TransferDone{ReqID: m.ReqID, Round: m.Round}})
			p.failRound(r)
			delete(p.rounds, rid)
			return nil
		}
		pairs[i] = SlotPair{Local: uint32(sup.slot), Remote: m.Slots[i]}
	}
	r.writing, r.blocks = true, len(pairs)
	p.emit(StartWrite{Round: rid, Pairs: pairs})
	return nil
}

// WriteDone is the end of a round's write: transfer_done (or abort_ack),
// then the pins go.
func (p *Producer) WriteDone(id RoundID, err error) {
	r := p.rounds[id]
	if r == nil || !r.writing {
		return
	}
	r.writing = false
	delete(p.rounds, id)
	ok := err == nil && !r.aborting
	switch {
	case p.dead:
	case r.aborting:
		p.emit(SendFrame{wire.AbortAck{ReqID: id.KVID, Round: id.Round}})
	default:
		p.emit(SendFrame{wire.TransferDone{ReqID: id.KVID, Round: id.Round, OK: ok}})
	}
	if ok {
		p.ps.Stats.RoundsOK++
		p.BytesOut += uint64(r.blocks * p.ps.Config.BlockBytes)
	} else {
		p.ps.Stats.RoundsFailed++
	}
	for job := range r.jobs {
		p.leaseDone(r, job, ok)
	}
}

// AbortFetch is an abort_fetch frame: a round being written is cancelled
// (abort_ack once the writer stopped), any other released at once.
func (p *Producer) AbortFetch(m wire.AbortFetch) {
	rid := RoundID{m.ReqID, m.Round}
	r := p.rounds[rid]
	if r != nil && r.writing {
		r.aborting = true
		p.emit(CancelWrite{Round: rid})
		return
	}
	if r != nil {
		p.failRound(r)
		delete(p.rounds, rid)
	}
	p.emit(SendFrame{wire.AbortAck{ReqID: m.ReqID, Round: m.Round}})
}

// Timeouts releases pins unclaimed after pin_hold (S6.5) and returns the
// next pin deadline (zero: none).
func (p *Producer) Timeouts(now time.Time) time.Time {
	var next time.Time
	for job, r := range p.pins {
		if r.writing {
			continue
		}
		d := r.pinDeadline[job]
		if !now.Before(d) {
			p.ps.Stats.PinExpiries++
			p.leaseDone(r, job, false)
			continue
		}
		if next.IsZero() || d.Before(next) {
			next = d
		}
	}
	return next
}

// Reset is a cache reset (S5.1): parked lookups answer miss at once and
// pins not being written are released.
func (p *Producer) Reset() {
	for _, l := range p.lookups {
		p.emit(SendFrame{wire.LookupResp{ReqID: l.msg.ReqID, Round: l.msg.Round, Keys: l.msg.Keys, Hits: make([]bool, len(l.msg.Keys))}})
		p.finish(l.req)
	}
	p.lookups = nil
	p.dropIdle()
}

// Kill is the session's death: every pin not being written fails and the
// parked lookups end; writes in flight only report when they end.
func (p *Producer) Kill() {
	p.dead = true
	for _, l := range p.lookups {
		p.finish(l.req)
	}
	p.lookups = nil
	p.dropIdle()
}

func (p *Producer) dropIdle() {
	for id, r := range p.rounds {
		if !r.writing {
			p.failRound(r)
			delete(p.rounds, id)
		}
	}
}

// Busy says whether work with the peer is outstanding (rounds or parked
// lookups); Parked whether lookups wait on keys being written; Rounds how
// many rounds are open.
func (p *Producer) Busy() bool   { return len(p.rounds) > 0 || len(p.lookups) > 0 }
func (p *Producer) Parked() bool { return len(p.lookups) > 0 }
func (p *Producer) Rounds() int  { return len(p.rounds) }

func (p *Producer) log(msg string, err error) {
	if p.ps.Log != nil {
		p.ps.Log.Warn(msg, "peer", p.Peer, "err", err)
	}
}

func (p *Producer) finish(req *offload.Request) {
	if req != nil {
		p.emit(FinishRequest{req})
	}
}

// failRound releases every pin of a round that is not being written.
func (p *Producer) failRound(r *round) {
	for job := range r.jobs {
		p.leaseDone(r, job, false)
	}
}

// leaseDone reports a lease once; a late completion emits nothing.
func (p *Producer) leaseDone(r *round, id uint64, ok bool) {
	job := r.jobs[id]
	if job == nil {
		return
	}
	delete(r.jobs, id)
	delete(r.pinDeadline, id)
	delete(p.pins, id)
	for k, sup := range r.supply {
		if sup.job == id {
			delete(r.supply, k)
		}
	}
	res := offload.JobResult{ID: id, OK: ok}
	if ok {
		res.Bytes = int64(len(job.Keys) * p.ps.Config.BlockBytes)
	}
	p.emit(JobDone{res})
	if len(r.jobs) == 0 && !r.writing && p.rounds[r.id] == r {
		delete(p.rounds, r.id)
	}
}
