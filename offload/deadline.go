package offload

import (
	"sync"
	"time"
)

// Bounded HitPending and Retry (S4). The first unsettled answer (HitPending
// or Retry) of a (request, key) starts a deadline of hit_pending_timeout;
// after it the pair answers a stable Miss. The poll goroutine's clock
// fires at the nearest deadline; its pass expires what is due and signals
// progress so that a sleeping engine looks again.

// Timeout reasons: the unsettled answer a (request, key) gave last before
// its deadline expired, the reason label of
// kv_offload_tiering_hit_pending_timeouts_total.
const (
	timeoutHitPending = iota
	timeoutRetry
)

var timeoutReasons = [2]string{"hit_pending", "retry"}

// deadline is the unsettled state of one (request, key).
type deadline struct {
	at    time.Time // when the pair turns into a stable Miss
	retry bool      // the last unsettled answer was Retry, not HitPending
}

// trackPendingLocked records or checks the deadline of (st, k) for the
// answer r and returns the answer to give. The deadline starts at the first
// HitPending or Retry and is never refreshed, also not when the answer
// alternates between the two (S4.2, S4.7).
func (m *Manager) trackPendingLocked(st *reqState, k Key, r Result) Result {
	switch r {
	case HitPending, Retry:
		now := m.nowLocked()
		d, ok := st.deadlines[k]
		if !ok {
			if st.deadlines == nil {
				st.deadlines, _ = spareDeadlines.Get().(map[Key]deadline)
				if st.deadlines == nil {
					st.deadlines = make(map[Key]deadline)
				}
			}
			at := now.Add(m.hitTimeout)
			st.deadlines[k] = deadline{at: at, retry: r == Retry}
			m.mu.deadlines++
			st.deadlinesPeak = max(st.deadlinesPeak, len(st.deadlines))
			m.armDeadlineLocked(at)
			return r
		}
		d.retry = r == Retry
		if !now.Before(d.at) {
			m.expireLocked(st, k, d)
			return Miss
		}
		st.deadlines[k] = d
	case Hit, Miss:
		if n := len(st.deadlines); n > 0 {
			delete(st.deadlines, k) // resolved (S4.3); one hash lookup (B5)
			if len(st.deadlines) < n {
				m.forgotDeadlinesLocked(1)
			}
		}
	}
	return r
}

func (m *Manager) expireLocked(st *reqState, k Key, d deadline) {
	delete(st.deadlines, k)
	m.forgotDeadlinesLocked(1)
	if st.expired == nil {
		st.expired = make(map[Key]struct{})
	}
	st.expired[k] = struct{}{}
	reason := timeoutHitPending
	if d.retry {
		reason = timeoutRetry
	}
	m.mu.counters.timeouts[reason]++
}

// forgotDeadlinesLocked counts n deadlines gone; with none left the
// clock is no longer asked for one (an idle node arms no timer, S3.1).
func (m *Manager) forgotDeadlinesLocked(n int) {
	m.mu.deadlines -= n
	if m.mu.deadlines == 0 && !m.mu.deadlineAt.IsZero() {
		m.mu.deadlineAt = time.Time{}
		m.clock.setDeadline(time.Time{})
	}
}

// armDeadlineLocked asks the poll goroutine's clock for a pass by d,
// unless it was already asked for one at or before d (deadlines are added
// in time order, so lookups rarely ask).
func (m *Manager) armDeadlineLocked(d time.Time) {
	if m.mu.deadlineAt.IsZero() || d.Before(m.mu.deadlineAt) {
		m.mu.deadlineAt = d
		m.clock.setDeadline(d)
	}
}

// expireDueLocked, in the poll goroutine's pass, expires every deadline
// due by now, signals progress if one did and asks the clock for the
// next one (again when none is due: the clock may have fired for an
// earlier time asked by someone else).
func (m *Manager) expireDueLocked(now time.Time) {
	if m.mu.deadlineAt.IsZero() {
		return
	}
	if now.Before(m.mu.deadlineAt) {
		m.clock.setDeadline(m.mu.deadlineAt)
		return
	}
	m.mu.deadlineAt = time.Time{}
	var next time.Time
	expired := false
	for _, st := range m.mu.reqs {
		for k, d := range st.deadlines {
			if !now.Before(d.at) {
				m.expireLocked(st, k, d)
				expired = true
			} else if next.IsZero() || d.at.Before(next) {
				next = d.at
			}
		}
	}
	if !next.IsZero() {
		m.armDeadlineLocked(next)
	} else {
		m.clock.setDeadline(time.Time{})
	}
	if expired {
		m.signalProgress()
	}
}

// spareDeadlines holds the emptied deadline maps of finished requests, so
// a new request's lookups reuse one instead of growing their own (issue
// 12: lookups allocate nothing per key). The garbage collector empties
// it; maps that once held more than maxSpareDeadlines keys are dropped.
var spareDeadlines sync.Pool

const maxSpareDeadlines = 4096

// dropDeadlinesLocked forgets st's deadlines (S4.3), keeping the map for
// the next request.
func (m *Manager) dropDeadlinesLocked(st *reqState) {
	if n := len(st.deadlines); n > 0 {
		m.forgotDeadlinesLocked(n)
	}
	if st.deadlines != nil && st.deadlinesPeak <= maxSpareDeadlines {
		clear(st.deadlines)
		spareDeadlines.Put(st.deadlines)
	}
	st.deadlines, st.deadlinesPeak = nil, 0
}
