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
//     them; the poll goroutine collects every tier's results for this
//     wait); none is aborted. It warns after 5 s and keeps waiting until
//     ctx ends.
//  3. Under the lock it empties the CPU tier (one EventCleared), queued
//     promotions, parked cascades and HitPending deadlines, bumps the cache
//     epoch and leaves resetting.
//
// If ctx ends during phase 2, phase 3 runs anyway: blocks still held by a
// transfer are detached — invisible, their slots never reused until the
// transfer ends — and a result from before the reset never makes a block
// readable. Secondary tiers keep their data.
func (m *Manager) ResetCache(ctx context.Context) error {
	m.lock()
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
	// Phase 2 is the poll goroutine's: it collects every tier's results
	// until none is in flight (resetWaitLocked).
	w := &resetWait{start: m.nowLocked(), drained: make(chan struct{})}
	m.mu.reset = w
	m.unlock()
	m.wakeAt(w.start)
	select {
	case <-w.drained:
	case <-m.stop: // Close: the poll goroutine no longer drives the wait
	case <-ctx.Done():
		m.lock()
		inFlight := len(m.mu.jobs)
		m.unlock()
		m.log.Warn("offload: cache reset proceeding with transfers in flight; their slots stay detached until they end",
			"in_flight", inFlight, "err", context.Cause(ctx))
	}

	m.lock()
	defer m.unlock()
	if m.mu.closed {
		return ErrClosed
	}
	for _, j := range m.mu.pending {
		m.mu.cpu.Commit(j.Keys, JobOwner(j.ID), false, nil)
	}
	m.mu.pending = nil
	m.mu.cpu.Reset()
	m.mu.parked = nil
	for _, st := range m.mu.reqs {
		m.dropDeadlinesLocked(st)
		st.parked, st.expired, st.sources = nil, nil, nil
		m.maybeFinalizeLocked(st, -1)
	}
	m.mu.epoch++
	m.emit(Event{Kind: EventCleared, Tier: "cpu", Epoch: m.mu.epoch}) // S2.8
	m.mu.admission.Reset()
	m.mu.resetting, m.mu.reset = false, nil
	m.mu.counters.resets++
	m.signalProgress()
	return nil
}

// resetWait is a cache reset's phase 2, driven by the poll goroutine.
type resetWait struct {
	start   time.Time
	warned  bool
	drained chan struct{} // closed when no transfer is in flight
}

// resetWaitLocked, in the poll goroutine's pass, collects every tier's
// results (polled or not: the engine may be paused) while a reset waits
// for transfers in flight; it closes drained once none is, and otherwise
// asks the clock to come back after tier_poll_interval (1 ms if that is
// not positive).
func (m *Manager) resetWaitLocked(now time.Time) {
	w := m.mu.reset
	if w == nil || isClosed(w.drained) {
		return
	}
	m.collectLocked(nil)
	inFlight := len(m.mu.jobs)
	if inFlight == 0 {
		close(w.drained)
		return
	}
	if !w.warned && now.Sub(w.start) >= resetWarnAfter {
		m.log.Warn("offload: cache reset still waiting for transfers", "in_flight", inFlight, "waited", now.Sub(w.start))
		w.warned = true
	}
	every := m.pollInterval
	if every <= 0 {
		every = time.Millisecond
	}
	m.wakeAt(now.Add(every))
}

func isClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
