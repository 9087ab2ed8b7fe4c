package p2p

import (
	"fmt"
	"strconv"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// plookup is a peer's lookup being served; it stays parked while some
// keys are still being written here (HitPending or Retry), at most
// lookup_hold (S6.3).
type plookup struct {
	msg     wire.Lookup
	arrived time.Time
	req     *offload.Request
	state   []int8 // per key of msg: probePending, probeHit, probeMiss
}

// pround is one round this node serves a peer: the pinned supply of its
// lookups, matched against the peer's fetch (S6.4).
type pround struct {
	id          roundID
	supply      map[offload.Key]supply
	jobs        map[uint64]*offload.Job
	pinDeadline map[uint64]time.Time
	demanded    bool
	writing     bool
	aborting    bool
}

type supply struct {
	slot int32
	job  uint64
}

func (t *Tier) onLookup(s *session, m wire.Lookup) error {
	s.lookups = append(s.lookups, &plookup{msg: m, arrived: time.Now(), state: make([]int8, len(m.Keys))})
	return nil
}

// serveLookups answers the session's parked lookups: every key is looked
// up in this node's manager (never recursing into P2P), every hit is
// pinned at once, and exactly one lookup_resp goes back per lookup (S6.3).
func (t *Tier) serveLookups(s *session, now time.Time) {
	if s.dead || t.p == nil {
		return
	}
	kept := s.lookups[:0]
	for _, l := range s.lookups {
		if !t.serveLookup(s, l, now) {
			kept = append(kept, l)
		}
	}
	clear(s.lookups[len(kept):])
	s.lookups = kept
}

// serveLookup advances one lookup and reports whether it was answered.
func (t *Tier) serveLookup(s *session, l *plookup, now time.Time) bool {
	p := t.p
	m := l.msg
	if l.req == nil {
		t.lookupSeq++
		l.req = &offload.Request{ID: "p2p:" + s.peer + ":" + m.ReqID + ":" + strconv.FormatUint(m.Round, 10) + ":lu" + strconv.FormatUint(t.lookupSeq, 10)}
		if err := p.OnNewRequest(l.req); err != nil {
			t.log.Warn("p2p: serving a lookup", "err", err)
			l.req = nil
			for i := range l.state {
				l.state[i] = probeMiss
			}
		}
	}
	rid := roundID{m.ReqID, m.Round}
	r := s.rounds[rid]
	var hits []offload.Key // kept by the lease's job
	if t.first == nil {
		t.first = map[offload.Key]int{}
	}
	first, hitIdx := t.first, t.hitIdx[:0] // a key sent twice gets the answer of its first occurrence
	defer func() { clear(first); t.hitIdx = hitIdx[:0] }()
	for i, wk := range m.Keys {
		k := offload.Key(wk)
		if _, dup := first[k]; dup {
			continue
		}
		first[k] = i
		if l.state[i] != probePending {
			continue
		}
		if r != nil {
			if _, ok := r.supply[k]; ok {
				l.state[i] = probeHit // pinned by an earlier lookup of the round
				continue
			}
		}
		switch p.Lookup(k, l.req) {
		case offload.Hit:
			if hits == nil {
				hits = make([]offload.Key, 0, len(m.Keys)-i)
			}
			hits = append(hits, k)
			hitIdx = append(hitIdx, i)
		case offload.Miss:
			l.state[i] = probeMiss
		}
	}
	if len(hits) > 0 {
		job, err := p.Lease(hits, l.req)
		if job == nil {
			if err != nil {
				t.log.Warn("p2p: pinning hits for a peer", "err", err)
			}
			for _, i := range hitIdx {
				l.state[i] = probeMiss
			}
		} else {
			if r == nil {
				r = &pround{id: rid, supply: map[offload.Key]supply{}, jobs: map[uint64]*offload.Job{}, pinDeadline: map[uint64]time.Time{}}
				s.rounds[rid] = r
			}
			r.jobs[job.ID] = job
			r.pinDeadline[job.ID] = now.Add(time.Duration(t.cfg.PinHold))
			s.pins[job.ID] = r
			for n, k := range job.Keys {
				r.supply[k] = supply{slot: job.Slots[n], job: job.ID}
			}
			for _, i := range hitIdx {
				l.state[i] = probeHit
			}
		}
	}
	for i, wk := range m.Keys {
		if j := first[offload.Key(wk)]; j != i {
			l.state[i] = l.state[j]
		}
	}
	expired := !now.Before(l.arrived.Add(time.Duration(t.cfg.LookupHold)))
	hitsOut := make([]bool, len(m.Keys))
	for i, st := range l.state {
		switch {
		case st == probeHit:
			hitsOut[i] = true
		case st == probePending && !expired:
			return false
		}
	}
	for _, h := range hitsOut {
		if h {
			t.st.keysHit++
		} else {
			t.st.keysMissed++
		}
	}
	t.st.lookupsServed++
	t.send(s, wire.LookupResp{ReqID: m.ReqID, Round: m.Round, Keys: m.Keys, Hits: hitsOut})
	if l.req != nil {
		p.OnRequestFinished(l.req)
	}
	return true
}

// onFetch matches a fetch against its round's pinned supply (S6.4). An
// empty fetch is terminal: it releases the request's pins and parked
// lookups (S6.7).
func (t *Tier) onFetch(s *session, m wire.Fetch) error {
	t.st.fetches++
	if len(m.Keys) == 0 {
		for id, r := range s.rounds {
			if id.kvID == m.ReqID && !r.writing {
				t.failRound(s, r)
				delete(s.rounds, id)
			}
		}
		kept := s.lookups[:0]
		for _, l := range s.lookups {
			if l.msg.ReqID == m.ReqID {
				t.finishOutside(l.req)
				continue
			}
			kept = append(kept, l)
		}
		s.lookups = kept
		return nil
	}
	rid := roundID{m.ReqID, m.Round}
	r := s.rounds[rid]
	if r == nil {
		t.st.roundsFailed++
		t.send(s, wire.TransferDone{ReqID: m.ReqID, Round: m.Round})
		return nil
	}
	if r.demanded {
		return fmt.Errorf("%w: request %s round %d", errDuplicateFetch, m.ReqID, m.Round)
	}
	r.demanded = true
	pairs := make([]SlotPair, len(m.Keys))
	for i, wk := range m.Keys {
		sup, ok := r.supply[offload.Key(wk)]
		if !ok || m.Slots[i] > 1<<31-1 {
			t.st.roundsFailed++
			t.send(s, wire.TransferDone{ReqID: m.ReqID, Round: m.Round})
			t.failRound(s, r)
			delete(s.rounds, rid)
			return nil
		}
		pairs[i] = SlotPair{Local: uint32(sup.slot), Remote: m.Slots[i]}
	}
	r.writing = true
	t.dp.Write(s.peer, m.Round, pairs, func(err error) { t.post(func() { t.writeDone(s, r, err) }) })
	return nil
}

// writeDone ends a round this node served: transfer_done (or abort_ack),
// then the pins go.
func (t *Tier) writeDone(s *session, r *pround, err error) {
	r.writing = false
	delete(s.rounds, r.id)
	ok := err == nil && !r.aborting
	switch {
	case s.dead:
	case r.aborting:
		t.send(s, wire.AbortAck{ReqID: r.id.kvID, Round: r.id.round})
	default:
		t.send(s, wire.TransferDone{ReqID: r.id.kvID, Round: r.id.round, OK: ok})
	}
	if ok {
		t.st.roundsOK++
	} else {
		t.st.roundsFailed++
	}
	for id := range r.jobs {
		t.pinResult(s, r, id, ok)
	}
}

func (t *Tier) onAbortFetch(s *session, m wire.AbortFetch) error {
	rid := roundID{m.ReqID, m.Round}
	r := s.rounds[rid]
	if r != nil && r.writing {
		r.aborting = true
		t.dp.Cancel(s.peer, m.Round) // abort_ack once the writer stopped
		return nil
	}
	if r != nil {
		t.failRound(s, r)
		delete(s.rounds, rid)
	}
	t.send(s, wire.AbortAck{ReqID: m.ReqID, Round: m.Round})
	return nil
}

// failRound releases every pin of a round that is not being written.
func (t *Tier) failRound(s *session, r *pround) {
	for id := range r.jobs {
		t.pinResult(s, r, id, false)
	}
}

// pinResult reports a pin job once; a late completion emits nothing.
func (t *Tier) pinResult(s *session, r *pround, id uint64, ok bool) {
	job := r.jobs[id]
	if job == nil {
		return
	}
	delete(r.jobs, id)
	delete(r.pinDeadline, id)
	delete(s.pins, id)
	for k, sup := range r.supply {
		if sup.job == id {
			delete(r.supply, k)
		}
	}
	res := offload.JobResult{ID: id, OK: ok}
	if ok {
		res.Bytes = int64(len(job.Keys) * t.blockBytes)
	}
	t.results = append(t.results, res)
	if len(r.jobs) == 0 && !r.writing && s.rounds[r.id] == r {
		delete(s.rounds, r.id)
	}
}

var (
	_ offload.Tier          = (*Tier)(nil)
	_ offload.RequestHooks  = (*Tier)(nil)
	_ offload.Server        = (*Tier)(nil)
	_ offload.StepEnder     = (*Tier)(nil)
	_ offload.Pender        = (*Tier)(nil)
	_ offload.Resetter      = (*Tier)(nil)
	_ offload.StatsReporter = (*Tier)(nil)
)
