package offload

// The step: holding the manager lock (S2.0). An engine step is Begin …
// OnScheduleEnd; Do is a step outside the scheduling phase. Every step ends
// with the one service pass and the tiers' step-end hooks.

import (
	"errors"
	"fmt"
)

// Step is the manager with its lock held: the scheduling phase of an engine
// step (from Begin) or one call made outside a step (inside Do). A Step is
// valid until OnScheduleEnd, or until Do's function returns.
type Step struct {
	m     *Manager
	ended bool
}

// Begin starts an engine step: it takes the manager lock and applies the
// results tiers have reported. End the step with OnScheduleEnd.
func (m *Manager) Begin() *Step {
	m.lock()
	s := &Step{m: m}
	if !m.mu.closed {
		m.collectLocked(nil)
	}
	return s
}

// Do runs fn as one step outside the engine's scheduling phase (an
// executor reporting a finished copy, an abort, an admin call): Begin, fn,
// OnScheduleEnd. It ends like every step (issue 13): the service pass,
// the promotions fn queued, the tiers' step-end hooks (a P2P lookup
// registered in fn is asked when Do returns).
func (m *Manager) Do(fn func(s *Step)) {
	s := m.Begin()
	defer s.OnScheduleEnd()
	fn(s)
}

// unlock releases the manager lock; the hits answered under it are no
// longer protected from eviction.
func (m *Manager) unlock() {
	m.mu.cpu.endHold()
	m.mu.Unlock()
}

func (s *Step) check(op string) error {
	switch {
	case s.ended:
		s.m.misuseLocked(op, "step_ended", ErrStepEnded)
		return fmt.Errorf("%s: %w", op, ErrStepEnded)
	case s.m.mu.closed:
		return fmt.Errorf("%s: %w", op, ErrClosed)
	}
	return nil
}

// misuseLocked logs and counts a caller's or a tier's mistake.
func (m *Manager) misuseLocked(op, reason string, err error) {
	m.mu.counters.errors[reason]++
	m.log.Warn("offload: "+op+" failed", "reason", reason, "err", err)
}

// OnScheduleEnd ends the step (S2.2): it applies finished jobs, lets tiers
// serve peers, submits the promotions queued in this step, retries parked
// cascades, tells tiers the step ended and releases the lock.
func (s *Step) OnScheduleEnd() {
	if s.ended {
		s.m.misuseLocked("schedule end", "step_ended", ErrStepEnded)
		return
	}
	m := s.m
	defer m.unlock()
	s.ended = true
	if m.mu.closed {
		return
	}
	if _, err := m.serviceLocked(nil); err != nil {
		for _, e := range joined(err) {
			if !errors.Is(e, ErrTierPanic) { // panics are logged where they are recovered
				m.log.Warn("offload: servicing the tiers at the step's end failed", "err", e)
			}
		}
	}
	for i, t := range m.mu.tiers {
		if e, ok := t.(StepEnder); ok {
			m.tierCall(i, "schedule end", e.OnScheduleEnd)
		}
	}
}
