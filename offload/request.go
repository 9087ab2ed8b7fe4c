package offload

// The request lifecycle (S2.6, S4.3): registration, finishing, aborting,
// and finalising once nothing of the request is in flight.

import (
	"fmt"
	"slices"
)

type reqState struct {
	req           *Request
	pendingStores int
	finished      bool
	engine        bool  // registered by a step, not by a tier (EngineBusy)
	requestLevel  []int // tiers that asked for RequestLevel, ascending
	parked        []Key // cascade keys still writing in the CPU tier
	sources       map[Key]int
	// deadlines holds, per key that answered HitPending or Retry and has
	// not settled, when it turns into a stable Miss (S4.1, S4.7); expired
	// holds the keys that did.
	deadlines     map[Key]deadline
	deadlinesPeak int // the most keys deadlines held
	expired       map[Key]struct{}
}

// OnNewRequest registers req and asks each tier which blocks it wants. It
// returns RequestLevel if any tier asked for whole requests.
func (s *Step) OnNewRequest(req *Request) (Level, error) {
	if err := s.check("new request"); err != nil {
		return ChunkLevel, err
	}
	return s.m.onNewRequestLocked(req, -1)
}

func (m *Manager) onNewRequestLocked(req *Request, exclude int) (Level, error) {
	if req == nil || req.ID == "" {
		return ChunkLevel, fmt.Errorf("new request: %w: a request needs an id", ErrUnknownRequest)
	}
	if _, ok := m.mu.reqs[req.ID]; ok {
		err := fmt.Errorf("new request %s: %w", req.ID, ErrRequestExists)
		m.misuseLocked("new request", "request_exists", err)
		return ChunkLevel, err
	}
	st := &reqState{req: req, engine: exclude < 0}
	m.mu.reqs[req.ID] = st
	if st.engine {
		m.engineReqs.Add(1)
	}
	req.st = st
	lvl := ChunkLevel
	for i, t := range m.mu.tiers {
		h, ok := t.(RequestHooks)
		if !ok || i == exclude {
			continue
		}
		l := ChunkLevel // also when the tier panics (S2.11)
		m.tierCall(i, "new request", func() { l = h.OnNewRequest(req) })
		if l == RequestLevel {
			st.requestLevel = append(st.requestLevel, i)
			lvl = RequestLevel
		}
	}
	return lvl, nil
}

// EngineBusy says whether the engine has requests of its own in flight:
// registered by a step (not by a tier serving a peer) and not yet
// finalized. Any goroutine may call it, without the lock.
func (m *Manager) EngineBusy() bool { return m.engineReqs.Load() > 0 }

// OnRequestFinished says req will make no new calls. The tiers see it
// once its stores completed and no cascade is parked (S2.5). Stores and
// loads already prepared may still complete afterwards.
func (s *Step) OnRequestFinished(req *Request) error {
	if err := s.check("request finished"); err != nil {
		return err
	}
	return s.m.onRequestFinishedLocked(req, -1)
}

func (m *Manager) onRequestFinishedLocked(req *Request, exclude int) error {
	st := m.mu.reqs[req.ID]
	if st == nil || st.req != req {
		err := fmt.Errorf("request finished: %s: %w", req.ID, ErrUnknownRequest)
		m.misuseLocked("request finished", "unknown_request", err)
		return err
	}
	st.finished = true
	m.dropDeadlinesLocked(st) // S4.3
	st.expired = nil
	m.maybeFinalizeLocked(st, exclude)
	return nil
}

func (m *Manager) maybeFinalizeLocked(st *reqState, exclude int) {
	if !st.finished || st.pendingStores > 0 || len(st.parked) > 0 {
		return
	}
	m.finalizeLocked(st, exclude)
}

func (m *Manager) finalizeLocked(st *reqState, exclude int) {
	delete(m.mu.reqs, st.req.ID)
	if st.engine {
		m.engineReqs.Add(-1)
	}
	st.req.st = nil
	// Promotions and probes queued for it in this pass are never handed
	// over: the tiers hear of nothing for it after its end.
	m.dropPendingLocked(st.req)
	m.dropProbesLocked(st.req)
	m.dropDeadlinesLocked(st)
	for i, t := range m.mu.tiers {
		if h, ok := t.(RequestHooks); ok && i != exclude {
			m.tierCall(i, "request finished", func() { h.OnRequestFinished(st.req) })
		}
	}
}

// Abort releases at once everything req holds — its pins, its queued
// promotions, its parked cascades — and tells the tiers (S2.9). Copies
// already in flight complete normally. Abort is idempotent.
func (s *Step) Abort(req *Request) {
	if s.check("abort") != nil {
		return
	}
	m := s.m
	if n := m.mu.cpu.ReleaseOwner(RequestOwner(req.ID)); n > 0 {
		m.log.Info("abort released pins", "request", req.ID, "pins", n)
	}
	m.dropPendingLocked(req)
	m.dropProbesLocked(req) // S2.9: no tier starts finding out for it
	st := m.mu.reqs[req.ID]
	if st == nil || st.req != req {
		return
	}
	st.parked = nil
	m.mu.parked = slices.DeleteFunc(m.mu.parked, func(p *reqState) bool { return p == st })
	m.finalizeLocked(st, -1)
}

// dropPendingLocked forgets the promotions queued for req in this pass,
// freeing their slots.
func (m *Manager) dropPendingLocked(req *Request) {
	m.mu.pending = slices.DeleteFunc(m.mu.pending, func(j *Job) bool {
		if j.Req != req {
			return false
		}
		m.mu.cpu.Commit(j.Keys, JobOwner(j.ID), false, nil)
		return true
	})
}

// dropProbesLocked forgets the Retry answers queued for req's probes.
func (m *Manager) dropProbesLocked(req *Request) {
	if len(m.mu.probes) > 0 {
		m.mu.probes = slices.DeleteFunc(m.mu.probes, func(p probe) bool { return p.req == req })
	}
}
