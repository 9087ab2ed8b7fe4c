// Package offload is kvtier's engine-independent tiering core: block keys,
// the CPU primary tier (one mmap'd arena of equal slots), the tiering manager
// that moves blocks between that tier and secondary tiers (disk, peers), the
// secondary-tier contract, admission policies and metrics.
//
// The manager is a state machine guarded by one lock. An engine holds the
// lock for the scheduling phase of a step:
//
//	s := m.Begin()
//	switch s.Lookup(key, req) { ... }
//	slots, err := s.PrepareLoad(keys, req)
//	s.OnScheduleEnd() // ends the step and releases the lock
//
// Calls made outside a step (an executor reporting that a copy finished)
// take the lock through Do, which is a step too and ends like one. Tiers
// never take the lock: they queue results and call the Wake function they
// were given; none runs a timer (TierEnv.WakeAt asks the poll goroutine's). SEMANTICS.md in the project's
// shared documents is the behavioural contract; its rule numbers (S2.4 …)
// are cited in comments and tests.
package offload
