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

// clock is the poll goroutine's timer, armed at the earliest time anyone
// asked for. The manager asks for its own (wakeAt: the nearest deadline,
// the poll interval, a reset's next look); those are forgotten when the
// timer fires, and every pass asks again for what is still ahead, so a
// time asked while the timer had already fired is not lost. Each tier asks
// for its own (TierEnv.WakeAt); a tier's asks are forgotten when the timer
// brings its service, and when its Serve runs, which asks again for what
// the tier still needs — so a deadline the tier no longer has disarms the
// timer instead of bringing an idle node a pass.
type clock struct {
	mu    sync.Mutex
	now   func() time.Time // Config.Now
	timer *time.Timer
	at    time.Time   // when the timer fires; zero while it is disarmed
	own   time.Time   // the manager's earliest ask (poll tick, backoff, reset); zero: none
	dl    time.Time   // the nearest HitPending/Retry deadline (setDeadline); zero: none
	tiers []time.Time // per tier, its earliest ask since its last Serve
}

func newClock(tiers int, now func() time.Time) clock {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return clock{now: now, timer: t, tiers: make([]time.Time, tiers)}
}

func earlier(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// rearmLocked arms the timer at the earliest ask, or disarms it.
func (c *clock) rearmLocked() {
	want := earlier(c.own, c.dl)
	for _, t := range c.tiers {
		want = earlier(want, t)
	}
	switch {
	case want.IsZero():
		if !c.at.IsZero() {
			c.timer.Stop()
			c.at = time.Time{}
		}
	case !want.Equal(c.at):
		c.at = want
		c.timer.Reset(want.Sub(c.now()))
	}
}

// NextDeadline is when the manager's clock fires next — the nearest
// HitPending/Retry deadline, a time a tier asked for, the poll interval
// while work is pending — or zero when nothing is armed (an idle node).
func (m *Manager) NextDeadline() time.Time {
	c := &m.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.at
}

// wakeAt makes the poll goroutine's timer fire no later than t. Any
// goroutine may call it, holding any lock.
func (m *Manager) wakeAt(t time.Time) {
	c := &m.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.own.IsZero() && !t.Before(c.own) {
		return
	}
	c.own = t
	c.rearmLocked()
}

// setDeadline makes the nearest HitPending/Retry deadline d (zero: none
// left, which may disarm the timer).
func (c *clock) setDeadline(d time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !d.Equal(c.dl) {
		c.dl = d
		c.rearmLocked()
	}
}

// tierWakeAt is tier i's TierEnv.WakeAt: a service of the tier by t.
func (m *Manager) tierWakeAt(i int) func(time.Time) {
	return func(t time.Time) {
		c := &m.clock
		c.mu.Lock()
		defer c.mu.Unlock()
		if cur := c.tiers[i]; !cur.IsZero() && !t.Before(cur) {
			return
		}
		c.tiers[i] = t
		c.rearmLocked()
	}
}

// served forgets tier i's asks: its Serve is running and asks again.
func (c *clock) served(i int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.tiers[i].IsZero() {
		c.tiers[i] = time.Time{}
		c.rearmLocked()
	}
}

// fired, once the timer fired, forgets what was due by now and re-arms
// for the rest; it reports whether a tier's ask was among what was due.
func (c *clock) fired(now time.Time) (tierDue bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.at = time.Time{}
	if !c.own.IsZero() && !now.Before(c.own) {
		c.own = time.Time{}
	}
	if !c.dl.IsZero() && !now.Before(c.dl) {
		c.dl = time.Time{} // the pass expires it and asks for the next
	}
	for i, t := range c.tiers {
		if !t.IsZero() && !now.Before(t) {
			c.tiers[i] = time.Time{}
			tierDue = true
		}
	}
	c.rearmLocked()
	return tierDue
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
		woken, tierDue := false, false
		select {
		case <-m.stop:
			return
		case <-wake:
			woken = true
		case <-m.clock.timer.C:
			tierDue = m.clock.fired(m.now())
		}
		now := m.now()
		service := woken || tierDue || (!tick.IsZero() && !now.Before(tick))
		if fails.count > 0 && now.Before(tick) {
			service = false // S3.3: no attempt before the backoff ends
		}
		if !service {
			// A deadline of the manager's own, or a tier's while backing
			// off: expire, signal, serve no tier.
			m.lock()
			if !m.mu.closed {
				m.clockPassLocked(m.nowLocked(), tierDue) // the time under the lock: never before a hold that came first
			}
			m.unlock()
			if !tick.IsZero() {
				m.wakeAt(tick)
			}
			continue
		}
		tick = time.Time{}
		again, err := m.pollPass(tierDue)
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
	now := m.now()
	f.count++
	m.lock()
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
func (m *Manager) pollPass(tierDue bool) (again bool, err error) {
	m.lock()
	defer m.unlock()
	if m.mu.closed {
		return false, nil
	}
	// The pass's time is read under the lock (nowLocked), not when the
	// goroutine woke: a step that held the lock meanwhile stamped its jobs
	// later than that, and a stamp must never be after the pass that
	// measures it (found in review: negative transfer seconds).
	m.clockPassLocked(m.nowLocked(), tierDue)
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
