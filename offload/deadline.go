package offload

import "time"

// Bounded HitPending (S4). The first HitPending of a (request, key) starts
// a deadline of hit_pending_timeout; after it the pair answers a stable
// Miss. One timer fires at the nearest deadline, expires what is due and
// signals progress so that a sleeping engine looks again.

// trackPendingLocked records or checks the deadline of (st, k) for the
// answer r and returns the answer to give.
func (m *Manager) trackPendingLocked(st *reqState, k Key, r Result) Result {
	switch r {
	case HitPending:
		now := time.Now()
		d, ok := st.deadlines[k]
		if !ok {
			if st.deadlines == nil {
				st.deadlines = make(map[Key]time.Time)
			}
			d = now.Add(m.hitTimeout)
			st.deadlines[k] = d
			m.armDeadlineLocked(d)
			return r
		}
		if !now.Before(d) {
			m.expireLocked(st, k)
			return Miss
		}
	case Hit, Miss:
		if len(st.deadlines) > 0 {
			delete(st.deadlines, k) // resolved (S4.3)
		}
	}
	return r
}

func (m *Manager) expireLocked(st *reqState, k Key) {
	delete(st.deadlines, k)
	if st.expired == nil {
		st.expired = make(map[Key]struct{})
	}
	st.expired[k] = struct{}{}
	m.mu.counters.hitPendingTimeouts++
}

// armDeadlineLocked makes the timer fire no later than d.
func (m *Manager) armDeadlineLocked(d time.Time) {
	if m.mu.closed {
		return
	}
	if m.mu.deadlineTimer == nil {
		m.mu.deadlineAt = d
		m.mu.deadlineTimer = time.AfterFunc(time.Until(d), m.onDeadline)
		return
	}
	if m.mu.deadlineAt.IsZero() || d.Before(m.mu.deadlineAt) {
		m.mu.deadlineAt = d
		m.mu.deadlineTimer.Reset(time.Until(d))
	}
}

// onDeadline runs on the timer's goroutine: it expires every due deadline,
// signals progress if any did and re-arms for the next one.
func (m *Manager) onDeadline() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.mu.deadlineAt = time.Time{}
	if m.mu.closed {
		return
	}
	now := time.Now()
	var next time.Time
	expired := false
	for _, st := range m.mu.reqs {
		for k, d := range st.deadlines {
			if !now.Before(d) {
				m.expireLocked(st, k)
				expired = true
			} else if next.IsZero() || d.Before(next) {
				next = d
			}
		}
	}
	if !next.IsZero() {
		m.armDeadlineLocked(next)
	}
	if expired {
		m.signalProgress()
	}
}
