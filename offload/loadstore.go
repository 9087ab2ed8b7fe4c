package offload

// Loads, stores and cascades (S2.4, S2.5, S2.7): pinning hits for a load,
// reserving slots for a store, and writing stored blocks on to the
// secondary tiers (parked while a block is still being written).

import (
	"fmt"
	"slices"
)

// PrepareLoad pins keys for a CPU → GPU copy on behalf of req and returns
// their slots. Every key must be ready (a Hit in this step); otherwise
// nothing is pinned and the error names the key (S2.3).
func (s *Step) PrepareLoad(keys []Key, req *Request) ([]int32, error) {
	if err := s.check("prepare load"); err != nil {
		return nil, err
	}
	slots, err := s.m.mu.cpu.Pin(keys, RequestOwner(req.ID), true)
	if err != nil {
		s.m.misuseLocked("prepare load", "not_ready", err)
		return nil, fmt.Errorf("prepare load for request %s: %w", req.ID, err)
	}
	return slots, nil
}

// CompleteLoad releases the pins PrepareLoad took for req.
func (s *Step) CompleteLoad(keys []Key, req *Request) error {
	if err := s.check("complete load"); err != nil {
		return err
	}
	m := s.m
	held, err := m.mu.cpu.Unpin(keys, RequestOwner(req.ID))
	if err != nil {
		m.misuseLocked("complete load", "not_pinned", err)
		return fmt.Errorf("complete load for request %s: %w", req.ID, err)
	}
	m.mu.counters.xfer[0][dirRead].add(len(keys)*m.blockBytes, held)
	return nil
}

// Touch marks keys recently used, the first most recently, in the CPU tier
// and in every tier that keeps its own recency.
func (s *Step) Touch(keys []Key, req *Request) {
	if s.check("touch") != nil {
		return
	}
	s.m.mu.cpu.Touch(keys)
	for i, t := range s.m.mu.tiers {
		if tt, ok := t.(Toucher); ok {
			s.m.tierCall(i, "touch", func() { tt.Touch(keys, req) })
		}
	}
}

// StorePlan is the answer to PrepareStore: the keys that need storing, the
// CPU slots reserved for them (parallel to Keys) and the keys evicted to
// make room.
type StorePlan struct {
	Keys    []Key
	Slots   []int32
	Evicted []Key // shared with event subscribers (S2.8): read-only
}

// PrepareStore reserves CPU slots for the keys of keys that are not
// resident, evicting idle blocks if needed (S2.4). A key that a promotion
// is still writing counts as not resident: the computed block replaces
// it, and the promotion, whenever it ends, never makes its slot readable.
// It returns nil, nil when not enough blocks can be evicted. Every
// non-empty plan must be followed by exactly one CompleteStore. Keys
// already resident are cascaded to the tiers that asked for whole
// requests.
func (s *Step) PrepareStore(keys []Key, req *Request) (*StorePlan, error) {
	if err := s.check("prepare store"); err != nil {
		return nil, err
	}
	m := s.m
	st := m.mu.reqs[req.ID]
	if st == nil {
		err := fmt.Errorf("prepare store: request %s: %w (call OnNewRequest first)", req.ID, ErrUnknownRequest)
		m.misuseLocked("prepare store", "unknown_request", err)
		return nil, err
	}
	if m.mu.resetting {
		return nil, nil // S5.1: nothing new starts while the cache resets
	}
	// A block still being promoted is stored all the same: the engine
	// computed it, typically after the promotion stalled past
	// hit_pending_timeout (S4.1); the promotion's slot is detached.
	added, slots, evicted, ok := m.mu.cpu.reserveStore(keys, RequestOwner(req.ID))
	if !ok {
		return nil, nil
	}
	if len(added) > 0 {
		st.pendingStores++
	}
	if len(st.requestLevel) > 0 {
		var existing []Key
		for _, k := range keys {
			if !slices.Contains(added, k) && !slices.Contains(existing, k) {
				existing = append(existing, k)
			}
		}
		m.cascadeExistingLocked(existing, st)
	}
	return &StorePlan{Keys: added, Slots: slots, Evicted: evicted}, nil
}

// CompleteStore ends the GPU → CPU copy of a PrepareStore: with ok the
// blocks become readable and cascade to every secondary tier that
// admission allows; without, their slots are freed and nothing cascades
// (S2.4). A store that finishes after its request was aborted still
// completes in the CPU tier but cascades nowhere.
func (s *Step) CompleteStore(keys []Key, req *Request, ok bool) error {
	if err := s.check("complete store"); err != nil {
		return err
	}
	m := s.m
	done, took := m.mu.cpu.Commit(keys, RequestOwner(req.ID), ok, req.Chain)
	if ok {
		m.mu.counters.xfer[0][dirWrite].add(len(done)*m.blockBytes, took)
	}
	st := m.mu.reqs[req.ID]
	if st == nil || st.req != req {
		if len(done) > 0 {
			return nil // aborted while its copy was in flight
		}
		err := fmt.Errorf("complete store: request %s: %w", req.ID, ErrUnknownRequest)
		m.misuseLocked("complete store", "unknown_request", err)
		return err
	}
	if st.pendingStores == 0 {
		err := fmt.Errorf("complete store: request %s: %w", req.ID, ErrNoStore)
		m.misuseLocked("complete store", "no_store", err)
		return err
	}
	st.pendingStores--
	if ok && len(done) > 0 {
		for i := range m.mu.tiers {
			m.cascadeLocked(done, req, i)
		}
	}
	m.maybeFinalizeLocked(st, -1)
	return nil
}

// cascadeLocked creates and submits a cascade of ready keys to tier.
func (m *Manager) cascadeLocked(keys []Key, req *Request, tier int) {
	j, err := m.createStoreJobLocked(keys, req, tier)
	if err != nil || j == nil {
		return
	}
	m.submitLocked(j)
}

func (m *Manager) createStoreJobLocked(keys []Key, req *Request, tier int) (*Job, error) {
	if len(keys) == 0 || m.mu.resetting || !m.mu.admission.Admit(tier, len(keys), false, m.nowLocked()) {
		return nil, nil
	}
	return m.pinJobLocked("create store job", keys, req, tier, false)
}

// pinJobLocked pins keys, which must be ready, for a cascade or a lease of
// tier and registers the job.
func (m *Manager) pinJobLocked(op string, keys []Key, req *Request, tier int, lease bool) (*Job, error) {
	id := m.mu.nextJob
	slots, err := m.mu.cpu.Pin(keys, JobOwner(id), false)
	if err != nil {
		m.misuseLocked(op, "not_ready", err)
		return nil, fmt.Errorf("%s for tier %d: %w", op, tier, err)
	}
	m.mu.nextJob++
	j := &Job{ID: id, Tier: tier, Epoch: m.mu.epoch, Lease: lease, Keys: slices.Clone(keys), Slots: slots, Req: req, Submitted: m.nowLocked()}
	m.mu.jobs[id] = j
	return j, nil
}

// cascadeExistingLocked sends keys already in the CPU tier to st's
// request-level tiers; keys still being written are parked until they
// resolve (S2.4).
func (m *Manager) cascadeExistingLocked(keys []Key, st *reqState) {
	var ready []Key
	for _, k := range keys {
		switch m.mu.cpu.Lookup(k) {
		case Hit:
			ready = append(ready, k)
		case HitPending:
			if !slices.Contains(st.parked, k) {
				st.parked = append(st.parked, k)
			}
		}
	}
	if len(st.parked) > 0 && !slices.Contains(m.mu.parked, st) {
		m.mu.parked = append(m.mu.parked, st)
	}
	if len(ready) == 0 {
		return
	}
	for _, i := range st.requestLevel {
		m.cascadeLocked(ready, st.req, i)
	}
}

// flushParkedLocked retries every parked cascade key; a parked key always
// resolves, because a failed write frees its slot.
func (m *Manager) flushParkedLocked() {
	parked := m.mu.parked
	m.mu.parked = nil
	for _, st := range parked {
		keys := st.parked
		st.parked = nil
		m.cascadeExistingLocked(keys, st)
		m.maybeFinalizeLocked(st, -1)
	}
}
