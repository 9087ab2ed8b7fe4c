package offload

import (
	"fmt"
	"runtime/debug"
)

// Panic-safe calls into tiers (S2.11). Every call the manager makes into a
// secondary tier — on the engine's step, in a poll pass, a reset, Metrics,
// HasPendingWork and Close — goes through tierCall (Lookup through
// lookupTierLocked, the same recovery without a closure, which the
// per-key lookup path cannot afford: B5), so a panicking tier becomes
// that tier's error: it is logged (the first panic of a tier with
// its stack, then at most one line per tier every 30 s), counted in
// kv_offload_tiering_tier_panics_total, and the process keeps serving.

// tierCall runs fn, a call into secondary tier i named by op, with the
// manager lock held. A panic in fn is recovered and returned as an error
// wrapping ErrTierPanic; fn's results are then whatever it had set (the
// caller's defaults).
func (m *Manager) tierCall(i int, op string, fn func()) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = m.tierPanickedLocked(i, op, v)
		}
	}()
	fn()
	return nil
}

// tierPanickedLocked counts and logs a panic of tier i in op.
func (m *Manager) tierPanickedLocked(i int, op string, v any) error {
	name := m.specs[i].Name
	err := fmt.Errorf("%w: tier %d (%s) in %s: %v", ErrTierPanic, i, name, op, v)
	m.mu.counters.tierPanics[i]++
	l := &m.mu.panicLogs[i]
	now := m.nowLocked()
	switch {
	case l.count == 0:
		m.log.Error("offload: tier panicked; treated as the tier's error", "tier", name, "op", op, "panic", v,
			"stack", string(debug.Stack()))
		l.lastLog = now
	case now.Sub(l.lastLog) >= failureLogEvery:
		m.log.Error("offload: tier still panicking", "tier", name, "op", op, "panic", v,
			"panics", l.count+1, "suppressed", l.suppressed)
		l.lastLog, l.suppressed = now, 0
	default:
		l.suppressed++
	}
	l.count++
	return err
}
