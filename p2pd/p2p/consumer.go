package p2p

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// A key's state in a consumer request's probes.
const (
	probePending int8 = iota // asked, not answered yet
	probeHit
	probeMiss
	probeUnsent // a consumer's: looked up, not asked yet (in creq.unsent)
)

// creq is a local request that fetches from a peer (a consumer).
type creq struct {
	req        *offload.Request
	s          *session
	kvID       string
	probes     map[offload.Key]int8
	unsent     []offload.Key
	asked      int       // probes sent to the peer and not answered
	peak       int       // the most probes it held (bounds what is recycled)
	round      uint64    // the round its lookups go in; 0: none open
	lookupOpen bool      // a lookup was sent and no fetch closed it (S6.7)
	askedAt    time.Time // the oldest lookup still unanswered was sent (S6.10)
	failed     bool      // answers Miss for the rest of its life (S6.6)
	finished   bool
}

// waiting says whether a lookup sent to the peer has keys not answered.
func (cr *creq) waiting() bool { return cr.asked > 0 }

// answer records the peer's answer for an asked key; an answer for a key
// never asked (a confused or hostile peer) changes nothing.
func (cr *creq) answer(k offload.Key, r int8) {
	if v, ok := cr.probes[k]; ok && v == probePending {
		cr.probes[k] = r
		cr.asked--
	}
}

// load is a promotion in flight from a peer: it succeeds when the peer's
// transfer_done arrived and every block arrived and verified, whichever
// comes last (S7.1).
type load struct {
	cr        *creq
	job       *offload.Job
	round     uint64
	sent      time.Time
	abortedAt time.Time
	done      int8 // transfer_done: 0 not yet, 1 ok, -1 failed
	data      int8 // the data plane: 0 pending, 1 all verified, -1 failed
	reported  bool
}

func (t *Tier) creqOf(req *offload.Request) *creq {
	if req == nil {
		return nil
	}
	cr, _ := req.TierState(t.env.Index).(*creq)
	return cr
}

// OnNewRequest implements offload.RequestHooks: a request whose
// kv_transfer_params name a remote_kv_source becomes a consumer of that
// peer, dialling it if needed. Every request is chunk-level.
func (t *Tier) OnNewRequest(req *offload.Request) offload.Level {
	src, ok, err := ParseRemoteSource(req.TransferParams)
	if err != nil {
		t.log.Warn("p2p: not fetching for a request with a bad remote_kv_source", "request", req.ID, "err", err)
	}
	if !ok || t.closed {
		return offload.ChunkLevel
	}
	kvID, addr := src.KVRequestID, src.Addr
	s := t.byAddr[addr]
	if s == nil || s.dead {
		s = t.dial(addr)
	}
	if s.creqs[kvID] != nil {
		t.log.Warn("p2p: two local requests share a kv_request_id; the second will not fetch", "kv_request_id", kvID)
		return offload.ChunkLevel
	}
	sp, _ := spareProbes.Get().(*spare)
	if sp == nil {
		sp = &spare{probes: map[offload.Key]int8{}}
	}
	cr := &creq{req: req, s: s, kvID: kvID, probes: sp.probes, unsent: sp.unsent}
	s.creqs[kvID] = cr
	req.SetTierState(t.env.Index, cr)
	return offload.ChunkLevel
}

// OnRequestFinished implements offload.RequestHooks (S6.7): the request's
// rounds in flight are aborted, and if a lookup is open one empty
// terminal fetch releases the producer's pins.
func (t *Tier) OnRequestFinished(req *offload.Request) {
	cr := t.creqOf(req)
	if cr == nil {
		return
	}
	req.SetTierState(t.env.Index, nil)
	cr.finished = true
	s := cr.s
	now := time.Now()
	for round, l := range s.loads {
		if l.cr == cr && l.abortedAt.IsZero() {
			l.abortedAt = now
			t.send(s, wire.AbortFetch{ReqID: cr.kvID, Round: round})
		}
	}
	if cr.lookupOpen {
		t.send(s, wire.Fetch{ReqID: cr.kvID, Round: cr.round})
		cr.lookupOpen = false
	}
	if s.creqs[cr.kvID] == cr {
		delete(s.creqs, cr.kvID)
		if cr.peak <= maxSpareProbes {
			clear(cr.probes)
			spareProbes.Put(&spare{cr.probes, cr.unsent[:0]})
		}
		cr.probes, cr.unsent = nil, nil // nothing reads a finished request's probes
	}
}

// spareProbes holds the emptied probe maps and unsent lists of finished
// requests, so a new request's lookups reuse them instead of growing their
// own (issue 12: lookups allocate nothing per key). The garbage collector
// empties it; maps of more than maxSpareProbes keys are dropped.
var spareProbes sync.Pool

type spare struct {
	probes map[offload.Key]int8
	unsent []offload.Key
}

const maxSpareProbes = 4096

// SubmitLoad implements offload.Tier: the keys (all answered Hit by the
// peer) are fetched into the job's slots in the lookups' round.
func (t *Tier) SubmitLoad(job *offload.Job) {
	cr := t.creqOf(job.Req)
	fail := func() {
		if cr != nil {
			cr.failed = true
		}
		t.results = append(t.results, offload.JobResult{ID: job.ID})
	}
	if cr == nil || cr.failed || cr.s.dead || !cr.s.ready || cr.round == 0 {
		fail()
		return
	}
	for _, k := range job.Keys {
		if cr.probes[k] != probeHit {
			fail()
			return
		}
	}
	s := cr.s
	l := &load{cr: cr, job: job, round: cr.round, sent: time.Now()}
	s.loads[l.round] = l
	slots := make([]uint32, len(job.Slots))
	for i, sl := range job.Slots {
		slots[i] = uint32(sl)
	}
	t.dp.Expect(s.peer, l.round, slots, func(err error) { t.post(func() { t.expectDone(s, l, err) }) })
	t.send(s, wire.Fetch{ReqID: cr.kvID, Round: l.round, Keys: toWire(job.Keys), Slots: slots})
	cr.lookupOpen = false
	clear(cr.probes) // a new round asks again
	cr.asked = 0
	cr.unsent = cr.unsent[:0]
	cr.round = 0
	cr.askedAt = time.Time{}
	t.armBy(l.sent.Add(time.Duration(t.cfg.LoadTimeout))) // the load's timeout
	t.armBy(s.lastRecv.Add(time.Duration(t.cfg.KeepaliveInterval)))
}

// errUnknownRound is an answer for a round this node never started: a
// confused or hostile peer. It is a handler error, not at once a
// protocol error (S8.2).
var errUnknownRound = errors.New("p2p: answer for a round this node never started")

// checkRound rejects answers for rounds beyond any this node numbered.
func (t *Tier) checkRound(round uint64) error {
	if round == 0 || round > t.round {
		return fmt.Errorf("%w: round %d (last %d)", errUnknownRound, round, t.round)
	}
	return nil
}

func (t *Tier) onLookupResp(s *session, m wire.LookupResp) error {
	if err := t.checkRound(m.Round); err != nil {
		return err
	}
	cr := s.creqs[m.ReqID]
	if cr == nil || cr.round != m.Round {
		return nil // late: the request finished or fetched already
	}
	for i, k := range m.Keys {
		if m.Hits[i] {
			cr.answer(k, probeHit)
		} else {
			cr.answer(k, probeMiss)
		}
	}
	if !cr.waiting() {
		cr.askedAt = time.Time{}
	}
	t.env.Progress() // lookup answers changed (S2.10)
	return nil
}

func (t *Tier) onTransferDone(s *session, m wire.TransferDone) error {
	if err := t.checkRound(m.Round); err != nil {
		return err
	}
	l := s.loads[m.Round]
	if l == nil || l.cr.kvID != m.ReqID {
		return nil // late or raced with a local timeout
	}
	l.done = -1
	if m.OK {
		l.done = 1
	}
	t.settle(s, l)
	return nil
}

func (t *Tier) expectDone(s *session, l *load, err error) {
	if l.reported || s.loads[l.round] != l {
		return
	}
	l.data = 1
	if err != nil {
		l.data = -1
		t.log.Warn("p2p: fetch failed in the data plane", "peer", s.peer, "round", l.round, "err", err)
	}
	t.settle(s, l)
}

// settle reports a load once both halves are known, or as soon as one
// failed (after making sure no more bytes of it reach a slot).
func (t *Tier) settle(s *session, l *load) {
	switch {
	case l.done == 1 && l.data == 1:
		delete(s.loads, l.round)
		t.loadResult(l, true)
	case l.done == -1 || l.data == -1:
		delete(s.loads, l.round)
		l.cr.failed = true
		t.dp.Unexpect(s.peer, l.round, func() { t.post(func() { t.loadResult(l, false) }) })
	}
}

func (t *Tier) onAbortAck(s *session, m wire.AbortAck) error {
	if err := t.checkRound(m.Round); err != nil {
		return err
	}
	l := s.loads[m.Round]
	if l == nil || l.cr.kvID != m.ReqID {
		return nil
	}
	delete(s.loads, m.Round)
	l.cr.failed = true
	// The producer stopped writing before it acknowledged: once no block
	// of the round is being read, the slots are safe to free.
	t.dp.Unexpect(s.peer, m.Round, func() { t.post(func() { t.loadResult(l, false) }) })
	return nil
}

// quarantine handles an abort that was not acknowledged in time (S6.6):
// the load fails for the request now, but its slots are reported free only
// once the data plane proved the peer's writer stopped (TCP: its data
// connections are closed).
func (t *Tier) quarantine(s *session, round uint64, l *load) {
	t.st.quarantines++
	delete(s.loads, round)
	l.cr.failed = true
	t.env.Progress()
	s.quar = append(s.quar, l)
	t.log.Warn("p2p: abort not acknowledged; quarantining the load's slots", "peer", s.peer, "round", round)
	peer, addr, info := s.peer, s.peerAddr, s.peerInfo
	t.dp.RemovePeer(peer, func() {
		t.post(func() {
			for _, q := range s.quar {
				t.loadResult(q, false)
			}
			s.quar = nil
			if !s.dead {
				t.dp.AddPeer(peer, addr, info)
			}
		})
	})
}

func (t *Tier) loadResult(l *load, ok bool) {
	if l.reported {
		return
	}
	l.reported = true
	r := offload.JobResult{ID: l.job.ID, OK: ok, Duration: time.Since(l.sent)}
	if ok {
		r.Bytes = int64(len(l.job.Keys) * t.blockBytes)
		t.st.roundsOK++
	} else {
		t.st.roundsFailed++
	}
	t.results = append(t.results, r)
}
