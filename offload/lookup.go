package offload

// Lookups and promotions (S2.1–S2.3): the CPU tier first, then the
// secondary tiers in order; a hit in a secondary tier queues a promotion,
// submitted at the end of the pass that queued it.

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
)

// Lookup answers whether key can be loaded for req (S2.1): Hit when it is
// ready in the CPU tier; HitPending while it is written there, or when a
// secondary tier has it and a promotion was queued; Retry while a tier is
// still finding out; Miss otherwise. A (request, key) that has not settled
// within hit_pending_timeout answers Miss from then on (S4.1, S4.7). A
// request not registered with OnNewRequest is a misuse: Miss, counted
// (S4.8).
func (s *Step) Lookup(k Key, req *Request) Result {
	if s.check("lookup") != nil {
		return Miss
	}
	return s.m.lookupLocked(k, req, -1)
}

// LookupPrefix scans keys in order the way an engine does: past Retry and
// HitPending (so one step asks every tier about the whole prefix) up to the
// first Miss. hits counts the leading Hits; settled is false while any
// block before that Miss is still Retry or HitPending, and the request
// should wait for progress (S2.10) before loading.
func (s *Step) LookupPrefix(keys []Key, req *Request) (hits int, settled bool) {
	gap := false
	settled = true
	for _, k := range keys {
		r := s.Lookup(k, req)
		if r == Miss {
			break
		}
		if r == Hit && !gap {
			hits++
			continue
		}
		gap = true
		settled = settled && r == Hit
	}
	return hits, settled
}

func (m *Manager) lookupLocked(k Key, req *Request, exclude int) Result {
	st := req.st
	if st == nil {
		// S4.8: no state for a request nothing would ever finish.
		err := fmt.Errorf("lookup: request %s: %w (call OnNewRequest first)", req.ID, ErrUnknownRequest)
		m.misuseLocked("lookup", "unknown_request", err)
		return Miss
	}
	if st.expired != nil {
		if _, ok := st.expired[k]; ok {
			return Miss // S4.1, S4.7: stable after the deadline, no new promotion
		}
	}
	if m.mu.resetting {
		return Miss // S5.1: nothing new starts while the cache resets
	}
	if at := m.mu.deadlineAt; !at.IsZero() && !m.nowLocked().Before(at) && len(st.deadlines) > 0 {
		// A deadline that passed before the poll goroutine's pass expired
		// it: Miss before any tier is asked, so no promotion starts (S4.1).
		// (deadlineAt is never after a live deadline: before it, none passed.)
		if d, ok := st.deadlines[k]; ok && !m.nowLocked().Before(d.at) {
			m.expireLocked(st, k, d)
			return Miss
		}
	}
	return m.trackPendingLocked(st, k, m.lookupTiersLocked(k, req, exclude))
}

func (m *Manager) lookupTiersLocked(k Key, req *Request, exclude int) Result {
	c := &m.mu.counters
	r := m.mu.cpu.lookupProtect(k)
	c.lookups[0][r]++
	if r != Miss {
		return r
	}
	retry := false
	for i, t := range m.mu.tiers {
		if i == exclude || !req.allows(&m.specs[i]) {
			continue
		}
		tr := m.lookupTierLocked(i, t, k, req)
		if tr == HitPending {
			m.misuseLocked("tier lookup", "tier_hit_pending", fmt.Errorf("tier %d (%s) answered hit_pending for %v; treated as retry", i, m.specs[i].Name, k))
			tr = Retry
		}
		c.lookups[i+1][tr]++
		switch tr {
		case Hit:
			// The first tier that has the block promotes it; later tiers are
			// not asked even if the promotion cannot start.
			if m.promoteLocked(i, k, req) {
				return HitPending
			}
			return Miss
		case Retry:
			retry = true
			if m.probers[i] != nil {
				m.mu.probes = append(m.mu.probes, probe{tier: i, req: req, key: k})
			}
		}
	}
	if retry {
		return Retry
	}
	return Miss
}

// lookupTierLocked asks tier i about k; a panic answers Miss (S2.11). It
// is tierCall without the closure, for the lookup path (B5).
func (m *Manager) lookupTierLocked(i int, t Tier, k Key, req *Request) (r Result) {
	defer func() {
		if v := recover(); v != nil {
			m.tierPanickedLocked(i, "lookup", v)
			r = Miss
		}
	}()
	return t.Lookup(k, req)
}

// promoteLocked reserves a CPU slot for k and queues it on the (tier, req)
// promotion of this pass.
func (m *Manager) promoteLocked(tier int, k Key, req *Request) bool {
	if m.mu.resetting || !m.mu.admission.Admit(tier, 1, true, m.nowLocked()) {
		return false
	}
	i := slices.IndexFunc(m.mu.pending, func(j *Job) bool { return j.Tier == tier && j.Req == req })
	id := m.mu.nextJob
	if i >= 0 {
		id = m.mu.pending[i].ID
	}
	sc := &m.mu.promo // scratch: a promotion allocates nothing per key (issue 12)
	sc.key[0] = k
	added, slots, _, ok := m.mu.cpu.reserve(sc.added[:0], sc.slots[:0], sc.key[:], JobOwner(id), false)
	sc.added, sc.slots = added[:0], slots[:0]
	if !ok || len(added) == 0 {
		m.mu.counters.promotionAllocFailures++
		return false
	}
	if i < 0 {
		m.mu.nextJob++
		m.mu.pending = append(m.mu.pending, &Job{ID: id, Tier: tier, Epoch: m.mu.epoch, Promotion: true, Req: req})
		i = len(m.mu.pending) - 1
	}
	j := m.mu.pending[i]
	j.Keys = append(j.Keys, k)
	j.Slots = append(j.Slots, slots[0])
	if st := m.mu.reqs[req.ID]; st != nil && st.req == req {
		if st.sources == nil {
			st.sources = make(map[Key]int)
		}
		st.sources[k] = tier
	}
	return true
}

// flushPromotionsLocked submits the promotions queued in this pass: one
// load job per (tier, request), tiers in order, requests in the order they
// first promoted (S2.2).
func (m *Manager) flushPromotionsLocked() {
	pending := m.mu.pending
	if len(pending) == 0 {
		return
	}
	m.mu.pending = nil
	slices.SortStableFunc(pending, func(a, b *Job) int { return cmp.Compare(a.Tier, b.Tier) })
	now := m.nowLocked()
	for _, j := range pending {
		j.Submitted = now
		m.mu.jobs[j.ID] = j
		m.submitLocked(j)
	}
}

// submitLocked hands job j, already in the job table, to its tier. If the
// tier panics (S2.11) the job fails at once, as if the tier had reported
// it failed: a promotion frees its slots, a cascade its pins.
func (m *Manager) submitLocked(j *Job) error {
	t := m.mu.tiers[j.Tier]
	op, submit := "submit store", t.SubmitStore
	if j.Promotion {
		op, submit = "submit load", t.SubmitLoad
	}
	if err := m.tierCall(j.Tier, op, func() { submit(j) }); err != nil {
		m.applyResultLocked(j.Tier, JobResult{ID: j.ID})
		m.signalProgress()
		return err
	}
	m.submitted(j.Tier)
	return nil
}

// submitted starts the poll goroutine polling a polled tier that was just
// given a job: its completion may show only to polling (S3.1).
func (m *Manager) submitted(tier int) {
	if m.specs[tier].Polled && m.pollAlive.Load() {
		signal(m.wake)
	}
}

// LoadSource names where req's block k came from: the name of the
// secondary tier that promoted it for req, or "cpu".
func (s *Step) LoadSource(k Key, req *Request) string {
	if st := s.m.mu.reqs[req.ID]; st != nil {
		if i, ok := st.sources[k]; ok {
			return s.m.specs[i].Name
		}
	}
	return "cpu"
}

// probe is a Prober tier's Retry answer, handed to it in the next pass.
type probe struct {
	tier int
	req  *Request
	key  Key
}

// flushProbesLocked hands each Prober tier that only picks (nil: every
// tier) the keys it answered Retry for since the last pass: one Probe per
// (tier, request), the requests in the order they first looked up, the
// keys in lookup order. Probes of other tiers wait for a pass that picks
// them. A panic is the tier's error (S2.11).
func (m *Manager) flushProbesLocked(only func(tier int) bool) error {
	ps := m.mu.probes
	if len(ps) == 0 {
		return nil
	}
	if !grouped(ps) {
		// Group stably by (tier, the request's first appearance); the sort
		// reuses the list, the map is scratch kept across passes.
		if m.mu.probeFirst == nil {
			m.mu.probeFirst = map[*Request]int{}
		}
		first := m.mu.probeFirst
		for i, p := range ps {
			if _, ok := first[p.req]; !ok {
				first[p.req] = i
			}
		}
		slices.SortStableFunc(ps, func(a, b probe) int {
			return cmp.Or(cmp.Compare(a.tier, b.tier), cmp.Compare(first[a.req], first[b.req]))
		})
		clear(first)
	}
	var errs []error
	kept := ps[:0]
	for start := 0; start < len(ps); {
		end := start + 1
		for end < len(ps) && ps[end].tier == ps[start].tier && ps[end].req == ps[start].req {
			end++
		}
		tier, req := ps[start].tier, ps[start].req
		if only != nil && !only(tier) {
			kept = append(kept, ps[start:end]...)
			start = end
			continue
		}
		keys := m.mu.probeKeys[:0]
		for _, p := range ps[start:end] {
			keys = append(keys, p.key)
		}
		m.mu.probeKeys = keys
		if err := m.tierCall(tier, "probe", func() { m.probers[tier].Probe(req, keys) }); err != nil {
			errs = append(errs, err)
		}
		start = end
	}
	clear(ps[len(kept):])
	m.mu.probes = kept
	return errors.Join(errs...)
}

// grouped reports whether each (tier, request) of ps forms one run — the
// usual case, an engine looking up each request's prefix in turn — so
// flushProbesLocked need not sort. It gives up (false) past a few runs.
func grouped(ps []probe) bool {
	const maxRuns = 8
	var runs [maxRuns]probe
	n := 0
	for i, p := range ps {
		if i > 0 && p.tier == ps[i-1].tier && p.req == ps[i-1].req {
			continue
		}
		for _, r := range runs[:n] {
			if r.tier == p.tier && r.req == p.req {
				return false // this pair came before, in another run
			}
		}
		if n == maxRuns {
			return false
		}
		runs[n] = p
		n++
	}
	return true
}
