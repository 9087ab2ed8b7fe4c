package p2p

import (
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
)

// The consumer side: a local request whose kv_transfer_params name a peer
// fetches from it through the session's protocol.Consumer; the tier picks
// or dials the session and carries out the consumer's actions.

func (t *Tier) creqOf(req *offload.Request) *protocol.Req {
	if req == nil {
		return nil
	}
	cr, _ := req.TierState(t.env.Index).(*protocol.Req)
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
	cr := s.cons.Add(req, kvID)
	if cr == nil {
		t.log.Warn("p2p: two local requests share a kv_request_id; the second will not fetch", "kv_request_id", kvID)
		return offload.ChunkLevel
	}
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
	c := cr.Consumer()
	c.Finish(cr, t.env.Now())
	if s := t.consOf[c]; s != nil {
		t.applyCons(s)
	} else {
		c.Take() // its session ended: nothing to send
	}
}

// SubmitLoad implements offload.Tier: the keys (all answered Hit by the
// peer) are fetched into the job's slots in the lookups' round.
func (t *Tier) SubmitLoad(job *offload.Job) {
	cr := t.creqOf(job.Req)
	if cr == nil {
		t.results = append(t.results, offload.JobResult{ID: job.ID})
		return
	}
	c := cr.Consumer()
	s := t.consOf[c]
	_, none := t.dp.(NonePlane) // data_plane none: nothing can arrive
	c.Load(cr, job, s != nil && !s.dead && s.ready && !none, t.env.Now())
	if s == nil {
		for _, a := range c.Take() {
			if d, ok := a.(protocol.JobDone); ok {
				t.results = append(t.results, d.Result)
			}
		}
		return
	}
	t.applyCons(s)
	t.armBy(s.live.LastReceived().Add(time.Duration(t.cfg.KeepaliveInterval)))
}

// applyCons carries out what a session's consumer asked for.
func (t *Tier) applyCons(s *session) {
	for _, a := range s.cons.Take() {
		switch a := a.(type) {
		case protocol.SendFrame:
			t.send(s, a.Msg)
		case protocol.ExpectBlocks:
			round := a.Round
			t.dp.Expect(s.peer, round, a.Slots, func(err error) { t.post(blocksArrived{s, round, err}) })
		case protocol.Unexpect:
			round := a.Round
			t.dp.Unexpect(s.peer, round, func() { t.post(unexpected{s, round}) })
		case protocol.RemovePeer:
			e := peerRemoved{s, s.peer, s.peerAddr, s.peerInfo}
			t.dp.RemovePeer(e.peer, func() { t.post(e) })
		case protocol.Progress:
			t.env.Progress()
		case protocol.WakeAt:
			t.armBy(a.At)
		case protocol.JobDone:
			t.results = append(t.results, a.Result)
		}
	}
}
