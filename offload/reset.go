package offload

import (
	"context"
	"errors"
	"time"
)

// ErrResetting is returned by ResetCache while another reset runs.
var ErrResetting = errors.New("offload: cache reset already in progress")

// resetWarnAfter is how long a reset waits for in-flight transfers before
// it logs a warning (it keeps waiting).
const resetWarnAfter = 5 * time.Second

// ResetCache empties the cache in three phases (S5.1):
//
//  1. Under the lock it enters resetting: lookups (peers' too) answer Miss
//     and no promotion, store or cascade starts; tiers holding pins for
//     outside requests release them.
//  2. Without the lock it waits until every tier's in-flight transfers
//     have ended. They complete normally (the poll goroutine or steps apply
//     them; this wait applies them too); none is aborted. It warns after
//     5 s and keeps waiting until ctx ends.
//  3. Under the lock it empties the CPU tier (one EventCleared), queued
//     promotions, parked cascades and HitPending deadlines, bumps the cache
//     epoch and leaves resetting.
//
// If ctx ends during phase 2, phase 3 runs anyway: blocks still held by a
// transfer are detached — invisible, their slots never reused until the
// transfer ends — and a result from before the reset never makes a block
// readable. Secondary tiers keep their data.
func (m *Manager) ResetCache(ctx context.Context) error {
	m.mu.Lock()
	switch {
	case m.mu.closed:
		m.mu.Unlock()
		return ErrClosed
	case m.mu.resetting:
		m.mu.Unlock()
		return ErrResetting
	}
	m.mu.resetting = true
	for i, t := range m.mu.tiers {
		if r, ok := t.(Resetter); ok {
			m.tierCall(i, "reset", r.OnReset)
		}
	}
	m.unlock()

	start := time.Now()
	every := m.pollInterval
	if every <= 0 {
		every = time.Millisecond
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	warned := false
wait:
	for {
		m.mu.Lock()
		m.collectLocked(nil)
		inFlight := len(m.mu.jobs)
		m.unlock()
		if inFlight == 0 {
			break
		}
		if !warned && time.Since(start) >= resetWarnAfter {
			m.log.Warn("offload: cache reset still waiting for transfers", "in_flight", inFlight, "waited", time.Since(start))
			warned = true
		}
		select {
		case <-ctx.Done():
			m.log.Warn("offload: cache reset proceeding with transfers in flight; their slots stay detached until they end",
				"in_flight", inFlight, "err", context.Cause(ctx))
			break wait
		case <-tick.C:
		}
	}

	m.mu.Lock()
	defer m.unlock()
	if m.mu.closed {
		return ErrClosed
	}
	for _, j := range m.mu.pending {
		m.mu.cpu.Commit(j.Keys, JobOwner(j.ID), false)
	}
	m.mu.pending = nil
	m.mu.cpu.Reset()
	m.mu.parked = nil
	for _, st := range m.mu.reqs {
		dropDeadlinesLocked(st)
		st.parked, st.expired, st.sources = nil, nil, nil
		m.maybeFinalizeLocked(st, -1)
	}
	m.mu.epoch++
	m.emit(Event{Kind: EventCleared, Tier: "cpu", Epoch: m.mu.epoch}) // S2.8
	m.mu.admission.Reset()
	m.mu.resetting = false
	m.mu.counters.resets++
	m.signalProgress()
	return nil
}
