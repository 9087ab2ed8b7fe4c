package offload

import (
	"errors"
	"fmt"
	"time"
)

// Poll goroutine (S3.1–S3.3, S3.5). It services the polled tiers under the
// manager lock as soon as one of them wakes it, and every tier_poll_interval
// while a polled tier still has pending work. With nothing outstanding it
// blocks on the wake channel with no timer armed: an idle node makes no
// wakeups.

const (
	// minBackoff is the least time between attempts while passes fail.
	minBackoff = time.Second
	// failureLogEvery bounds the failure summaries logged while failures
	// persist.
	failureLogEvery = 30 * time.Second
)

func (m *Manager) pollLoop() {
	defer close(m.pollDone)
	defer m.pollAlive.Store(false)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	armed := false
	var fails failureLog
	for {
		wake := m.wake
		if fails.count > 0 {
			wake = nil // backing off: the next attempt waits for the timer
		}
		var tick <-chan time.Time
		if armed {
			tick = timer.C
		}
		select {
		case <-m.stop:
			return
		case <-wake:
		case <-tick:
			armed = false
		}
		again, err := m.pollPass()
		if armed {
			timer.Stop()
			armed = false
		}
		if err != nil {
			m.pollFailed(&fails, err)
			timer.Reset(max(m.pollInterval, minBackoff))
			armed = true
			continue
		}
		if fails.count > 0 {
			m.log.Info("offload: tier servicing recovered", "failures", fails.count)
			fails = failureLog{}
		}
		if again {
			timer.Reset(m.pollInterval)
			armed = true
		}
	}
}

// failureLog rate-limits the poll goroutine's error logs.
type failureLog struct {
	count      int
	suppressed int
	lastLog    time.Time
}

func (m *Manager) pollFailed(f *failureLog, err error) {
	now := time.Now()
	f.count++
	m.mu.Lock()
	m.mu.counters.pollErrors++
	m.mu.counters.pollBackoffs++
	m.mu.Unlock()
	switch {
	case f.count == 1:
		m.log.Error("offload: tier servicing failed; backing off", "err", err, "backoff", max(m.pollInterval, minBackoff))
		f.lastLog = now
	case now.Sub(f.lastLog) >= failureLogEvery:
		m.log.Error("offload: tier servicing still failing", "err", err, "failures", f.count, "suppressed", f.suppressed)
		f.lastLog, f.suppressed = now, 0
	default:
		f.suppressed++
	}
}

// pollPass services the polled tiers once: their results (so the releases
// they cause are applied here, S3.5), their outside requests, then the
// promotions queued in the pass (S2.2). It reports whether a polled tier
// still has pending work, and any error from a tier, a panic included
// (S2.11: every call into a tier is recovered by tierCall).
func (m *Manager) pollPass() (again bool, err error) {
	m.mu.Lock()
	defer m.unlock()
	if m.mu.closed {
		return false, nil
	}
	polled := func(i int) bool { return m.specs[i].Polled }
	errs := []error{m.collectLocked(polled)}
	for i, t := range m.mu.tiers {
		if srv, ok := t.(Server); ok && polled(i) {
			if e := m.serveLocked(i, srv); e != nil {
				errs = append(errs, fmt.Errorf("tier %d (%s): %w", i, m.specs[i].Name, e))
			}
		}
	}
	errs = append(errs, m.collectLocked(polled))
	m.flushPromotionsLocked()
	for i, t := range m.mu.tiers {
		if p, ok := t.(Pender); ok && polled(i) {
			pending, e := m.pendingLocked(i, p)
			again = again || pending
			errs = append(errs, e)
		}
	}
	return again, errors.Join(errs...)
}
