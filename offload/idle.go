package offload

// Idleness (S3.4): whether the engine must keep stepping.

// HasPendingWork reports whether the engine must keep stepping although it
// has nothing to schedule (S3.4). While the poll goroutine services the
// polled tiers, their work does not count. It counts: parked cascades;
// Retry answers of Prober tiers that only a step hands over;
// jobs, queued promotions and pending work of tiers that are not polled
// (or of every tier when the poll goroutine services none); a keep-alive
// while a tier that serves outside requests is not serviced by it; and a
// keep-alive when more than one secondary tier is configured and one of
// them is not polled.
func (m *Manager) HasPendingWork() bool {
	m.lock()
	defer m.mu.Unlock()
	if m.mu.closed {
		return false
	}
	alive := m.pollAlive.Load()
	byPoll := func(tier int) bool { return alive && m.specs[tier].Polled }
	if len(m.mu.parked) > 0 || len(m.mu.probes) > 0 { // probes left: tiers only a step services
		return true
	}
	for _, j := range m.mu.jobs {
		if !byPoll(j.Tier) {
			return true
		}
	}
	for _, j := range m.mu.pending {
		if !byPoll(j.Tier) {
			return true
		}
	}
	unpolled := false
	for i, t := range m.mu.tiers {
		if byPoll(i) {
			continue
		}
		if p, ok := t.(Pender); ok {
			if pending, _ := m.pendingLocked(i, p); pending {
				return true
			}
		}
		if _, ok := t.(Server); ok && m.specs[i].Polled {
			return true // serves peers, and only engine steps service it now
		}
		if !m.specs[i].Polled {
			unpolled = true
		}
	}
	return unpolled && len(m.mu.tiers) > 1
}
