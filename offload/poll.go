package offload

import (
	"sync"
	"time"
)

// Poll goroutine (S3.1–S3.5, S4.1). It owns the manager's one timer
// (issue 13, one clock): the HitPending and Retry deadlines, the deadlines
// tiers ask for (TierEnv.WakeAt: P2P timeouts), tier_poll_interval while a
// polled tier has pending work, the backoff while passes fail, and the
// cache reset's wait. It services the polled tiers under the manager lock as
// soon as one of them wakes it. With nothing outstanding it blocks with no
// timer armed: an idle node makes no wakeups. With tier_poll_interval <= 0
// it services no tier (S3.4's "no poll goroutine") and keeps only the
// clock: a deadline a tier asked for signals progress instead, so that the
// engine steps and services it (S3.2).

const (
	// minBackoff is the least time between attempts while passes fail.
	minBackoff = time.Second
	// failureLogEvery bounds the failure summaries logged while failures
	// persist.
	failureLogEvery = 30 * time.Second
)

// clock is the poll goroutine's timer. Whoever needs a pass by some time
// asks wakeAt; the timer then fires at the earliest time asked since it
// last fired. Every pass asks again for what is still ahead (the
// manager's deadlines, Serve's timeouts, the poll interval), so a time
// asked while the timer had already fired is not lost. Times the tiers
// ask for (tierAt) bring a service of the tiers; the manager's own only a
// clock pass.
type clock struct {
	mu     sync.Mutex
	timer  *time.Timer
	at     time.Time // when the timer fires; zero while it is disarmed
	tierAt time.Time // the earliest service a tier asked for; zero: none
}

func newClock() clock {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return clock{timer: t}
}

// wakeAt makes the poll goroutine's timer fire no later than t. Any
// goroutine may call it, holding any lock.
func (m *Manager) wakeAt(t time.Time) {
	c := &m.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armLocked(t)
}

// tierWakeAt is TierEnv.WakeAt: a service of the tiers by t.
func (m *Manager) tierWakeAt(t time.Time) {
	c := &m.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.tierAt.IsZero() || t.Before(c.tierAt) {
		c.tierAt = t
	}
	c.armLocked(t)
}

func (c *clock) armLocked(t time.Time) {
	if c.at.IsZero() || t.Before(c.at) {
		c.at = t
		c.timer.Reset(time.Until(t))
	}
}

// fired notes that the timer fired and is disarmed.
func (c *clock) fired() {
	c.mu.Lock()
	c.at = time.Time{}
	c.mu.Unlock()
}

// tierDue reports whether a service a tier asked for is due by now, and
// forgets it if so; one still ahead stays armed.
func (c *clock) tierDue(now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.tierAt.IsZero() {
		return false
	}
	if now.Before(c.tierAt) {
		c.armLocked(c.tierAt)
		return false
	}
	c.tierAt = time.Time{}
	return true
}

func (m *Manager) pollLoop() {
	defer close(m.pollDone)
	defer m.pollAlive.Store(false)
	defer m.clock.timer.Stop()
	var fails failureLog
	var tick time.Time // the goroutine's own next service: the poll interval or the backoff's end
	for {
		wake := m.wake
		if fails.count > 0 {
			wake = nil // backing off: the next attempt waits for the timer
		}
		woken := false
		select {
		case <-m.stop:
			return
		case <-wake:
			woken = true
		case <-m.clock.timer.C:
			m.clock.fired()
		}
		now := time.Now()
		tierDue := m.clock.tierDue(now)
		service := woken || tierDue || (!tick.IsZero() && !now.Before(tick))
		if fails.count > 0 && now.Before(tick) {
			service = false // S3.3: no attempt before the backoff ends
		}
		if !service {
			// A deadline of the manager's own: expire, serve no tier.
			m.mu.Lock()
			if !m.mu.closed {
				m.clockPassLocked(now, false)
			}
			m.unlock()
			if !tick.IsZero() {
				m.wakeAt(tick)
			}
			continue
		}
		tick = time.Time{}
		again, err := m.pollPass(now, tierDue)
		if err != nil {
			m.pollFailed(&fails, err)
			tick = now.Add(max(m.pollInterval, minBackoff))
			m.wakeAt(tick)
			continue
		}
		if fails.count > 0 {
			m.log.Info("offload: tier servicing recovered", "failures", fails.count)
			fails = failureLog{}
		}
		if again {
			tick = now.Add(m.pollInterval)
			m.wakeAt(tick)
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

// pollPass is the poll goroutine's pass: the clock's work, then, when it
// services tiers, one service pass over the polled ones (S3.5: the
// releases their results cause are applied here). It reports whether a
// polled tier still has pending work, and any error from a tier, a panic
// included (S2.11: every call into a tier is recovered by tierCall).
func (m *Manager) pollPass(now time.Time, tierDue bool) (again bool, err error) {
	m.mu.Lock()
	defer m.unlock()
	if m.mu.closed {
		return false, nil
	}
	m.clockPassLocked(now, tierDue)
	if !m.polling {
		return false, nil
	}
	return m.serviceLocked(func(i int) bool { return m.specs[i].Polled })
}

// clockPassLocked does what is due by now on the poll goroutine's clock
// without servicing a tier: it expires deadlines, drives a cache reset's
// wait and, when a time a tier asked for is due (tierDue), signals
// progress if that may have been a tier the poll goroutine does not
// service (its Serve then runs at the step's end).
func (m *Manager) clockPassLocked(now time.Time, tierDue bool) {
	m.expireDueLocked(now)
	m.resetWaitLocked(now)
	if !tierDue {
		return
	}
	for i, t := range m.mu.tiers {
		if _, ok := t.(Server); ok && !(m.polling && m.specs[i].Polled) {
			m.signalProgress()
			return
		}
	}
}
