package offload

// Servicing (S3): the one service pass of the step's end and the poll
// goroutine — the tiers' results, their outside requests (Serve, through
// parent), promotions and parked cascades.

import (
	"errors"
	"fmt"
	"slices"
)

// serviceLocked is the one service pass, of the step's end and of the poll
// goroutine (issue 13): the tiers' results, their outside requests, the
// results those caused, the promotions queued meanwhile (S2.2), the
// parked cascades; it reports whether a tier still has pending work
// (Pender). only picks the tiers (nil: every tier); the queued promotions
// and parked cascades are the manager's and always flushed. The error
// joins the tiers' errors, each panic among them (S2.11).
func (m *Manager) serviceLocked(only func(tier int) bool) (again bool, err error) {
	var errs []error // nil on a good pass: a step allocates nothing here (B5)
	if e := m.flushProbesLocked(only); e != nil {
		errs = append(errs, e)
	}
	if e := m.collectLocked(only); e != nil {
		errs = append(errs, e)
	}
	for i, t := range m.mu.tiers {
		if srv, ok := t.(Server); ok && (only == nil || only(i)) {
			if e := m.serveLocked(i, srv); e != nil {
				errs = append(errs, fmt.Errorf("tier %d (%s): %w", i, m.specs[i].Name, e))
			}
		}
	}
	if e := m.flushProbesLocked(only); e != nil { // what Serve's own lookups answered Retry
		errs = append(errs, e)
	}
	if len(m.mu.probes) > 0 {
		m.signalProgress() // probes for tiers only a step services: the engine steps (HasPendingWork)
	}
	if e := m.collectLocked(only); e != nil {
		errs = append(errs, e)
	}
	m.flushPromotionsLocked()
	m.flushParkedLocked()
	for i, t := range m.mu.tiers {
		if p, ok := t.(Pender); ok && (only == nil || only(i)) {
			pending, e := m.pendingLocked(i, p)
			again = again || pending
			if e != nil {
				errs = append(errs, e)
			}
		}
	}
	return again, errors.Join(errs...)
}

// joined lists the errors that errors.Join joined into err, at any depth.
func joined(err error) []error {
	j, ok := err.(interface{ Unwrap() []error })
	if !ok {
		return []error{err}
	}
	var out []error
	for _, e := range j.Unwrap() {
		out = append(out, joined(e)...)
	}
	return out
}

// serveLocked lets tier i serve outside requests; a panic is its error
// (S2.11).
func (m *Manager) serveLocked(i int, srv Server) (err error) {
	m.clock.served(i) // Serve asks again for the times the tier still needs
	if perr := m.tierCall(i, "serve", func() { err = srv.Serve(&parent{m: m, tier: i}) }); perr != nil {
		return perr
	}
	return err
}

// pendingLocked asks tier i whether it has outstanding work. A panic is
// its error (S2.11) and answers false.
func (m *Manager) pendingLocked(i int, p Pender) (pending bool, err error) {
	err = m.tierCall(i, "pending", func() { pending = p.Pending() })
	return pending, err
}

// collectLocked applies the results the tiers reported: every tier, or
// those for which only returns true. It returns the panics of tiers
// (S2.11), each of which reported nothing this time.
func (m *Manager) collectLocked(only func(tier int) bool) error {
	got := false
	var errs []error
	for i, t := range m.mu.tiers {
		if only != nil && !only(i) {
			continue
		}
		var results []JobResult
		if err := m.tierCall(i, "finished", func() { results = t.Finished() }); err != nil {
			errs = append(errs, err)
		}
		for _, r := range results {
			m.applyResultLocked(i, r)
			got = true
		}
	}
	if got {
		m.signalProgress()
	}
	return errors.Join(errs...)
}

func (m *Manager) applyResultLocked(tier int, r JobResult) {
	j, ok := m.mu.jobs[r.ID]
	if !ok {
		m.misuseLocked("job result", "unknown_job", fmt.Errorf("%w: tier %d (%s) reported job %d", ErrUnknownJob, tier, m.specs[tier].Name, r.ID))
		return
	}
	if j.Tier != tier {
		m.misuseLocked("job result", "wrong_tier", fmt.Errorf("%w: tier %d (%s) reported job %d of tier %d", ErrWrongTier, tier, m.specs[tier].Name, r.ID, j.Tier))
		return
	}
	delete(m.mu.jobs, r.ID)
	owner := JobOwner(j.ID)
	if j.Lease {
		// S2.7, S6.5: a lease ends when the peer fetched (or gave up); how
		// long that took says nothing about the tier's store latency.
		if _, err := m.mu.cpu.Unpin(j.Keys, owner); err != nil {
			m.misuseLocked("lease result", "not_pinned", err)
		}
		return
	}
	m.mu.admission.Completed(j, r, m.blockBytes, m.nowLocked())
	took := r.Duration
	if took <= 0 {
		took = m.nowLocked().Sub(j.Submitted)
	}
	c := &m.mu.counters
	if !j.Promotion {
		if _, err := m.mu.cpu.Unpin(j.Keys, owner); err != nil {
			m.misuseLocked("cascade result", "not_pinned", err)
		}
		if r.OK {
			c.xfer[tier+1][dirWrite].add(len(j.Keys)*m.blockBytes, took)
		} else {
			c.jobFailures[tier][dirWrite]++
		}
		return
	}
	good := j.Keys
	if !r.OK {
		c.jobFailures[tier][dirRead]++
		good = nil
		for _, k := range r.Succeeded {
			if slices.Contains(j.Keys, k) {
				good = append(good, k)
			}
		}
	}
	if j.Epoch != m.mu.epoch {
		good = nil // from before a cache reset: never readable
	}
	bad := slices.DeleteFunc(slices.Clone(j.Keys), func(k Key) bool { return slices.Contains(good, k) })
	var chain *Chain
	if j.Req != nil {
		chain = j.Req.Chain
	}
	m.mu.cpu.Commit(good, owner, true, chain)
	m.mu.cpu.Commit(bad, owner, false, nil)
	if len(good) > 0 {
		c.xfer[tier+1][dirRead].add(len(good)*m.blockBytes, took)
	}
	if st := m.mu.reqs[j.Req.ID]; st != nil && st.sources != nil {
		for _, k := range bad {
			if st.sources[k] == tier {
				delete(st.sources, k)
			}
		}
	}
}

// parent is the Parent facade bound to one tier.
type parent struct {
	m    *Manager
	tier int
}

func (p *parent) OnNewRequest(req *Request) error {
	_, err := p.m.onNewRequestLocked(req, p.tier)
	return err
}

func (p *parent) Lookup(k Key, req *Request) Result {
	if p.m.mu.resetting {
		return Miss // S5.1: peer lookups answer Miss while the cache resets
	}
	return p.m.lookupLocked(k, req, p.tier)
}

// Lease implements Parent: pins for an outside request, never refused by
// admission (S6.5).
func (p *parent) Lease(keys []Key, req *Request) (*Job, error) {
	if len(keys) == 0 || p.m.mu.resetting {
		return nil, nil
	}
	j, err := p.m.pinJobLocked("lease", keys, req, p.tier, true)
	if j != nil {
		p.m.submitted(p.tier)
	}
	return j, err
}

func (p *parent) OnRequestFinished(req *Request) error {
	return p.m.onRequestFinishedLocked(req, p.tier)
}
