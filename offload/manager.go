package offload

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Manager is the tiering manager: the CPU primary tier, the secondary
// tiers, and every transfer between them. One mutex guards it (S2.0); see
// Begin, Do and the package documentation for how callers hold it.
type Manager struct {
	cfg        Config
	log        *slog.Logger
	blockBytes int
	specs      []TierSpec
	progress   chan struct{}

	now          func() time.Time // Config.Now: read through nowLocked, or by the poll goroutine
	pollInterval time.Duration
	hitTimeout   time.Duration
	wake         chan struct{}  // wakes the poll goroutine
	stop         chan struct{}  // closed by Close
	pollDone     chan struct{}  // closed when the poll goroutine returned
	scrubbing    sync.WaitGroup // scrub batches reading the arena without the lock (Scrub); Close waits for them
	probers      []Prober       // per secondary tier, the tier if it is one (set once built)
	pollAlive    atomic.Bool    // the poll goroutine runs and services the polled tiers
	engineReqs   atomic.Int32   // requests registered by a step and not yet finalized (TierEnv.EngineBusy)
	polling      bool           // it services them at all (tier_poll_interval > 0 and a polled tier)
	clock        clock          // the poll goroutine's timer, the manager's only one
	events       eventHub       // S2.8; its own lock, taken after mu

	mu struct {
		sync.Mutex
		closed    bool
		resetting bool
		cpu       *CPUTier
		tiers     []Tier
		admission Admission
		nextJob   uint64
		epoch     uint64
		jobs      map[uint64]*Job
		pending   []*Job // promotions queued this pass, in order (S2.2)
		reqs      map[string]*reqState
		parked    []*reqState // requests with parked cascade keys, in order
		counters  counters
		panicLogs []failureLog // per secondary tier, rate-limits panic logs (S2.11)
		// Prober tiers' Retry answers, for the next pass that services the
		// tier (flushProbesLocked): bounded by one step's lookups, kept at
		// the largest step's size.
		probes     []probe
		probeKeys  []Key            // flushProbesLocked's scratch
		probeFirst map[*Request]int // flushProbesLocked's scratch, emptied each pass
		scrubs     uint64           // scrubs started: each pins as an owner of its own (scrubOwner)
		promo      struct {         // promoteLocked's scratch: one key's reservation
			key   [1]Key
			added []Key
			slots []int32
		}

		// now is this hold's time (nowLocked): zero until first needed,
		// cleared when the lock is taken.
		now time.Time

		deadlineAt time.Time // the nearest HitPending or Retry deadline the clock was asked for
		deadlines  int       // HitPending/Retry deadlines live in all requests
		reset      *resetWait
	}
}

// New builds the CPU tier described by cfg and the secondary tiers of specs,
// in lookup order.
func New(cfg Config, specs ...TierSpec) (*Manager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	m := &Manager{cfg: cfg, log: log, now: now, blockBytes: cfg.Geometry.BlockBytes(), specs: slices.Clone(specs),
		progress: make(chan struct{}, 1), wake: make(chan struct{}, 1), stop: make(chan struct{}), clock: newClock(len(specs), now),
		pollInterval: time.Duration(cfg.TierPollInterval), hitTimeout: time.Duration(cfg.HitPendingTimeout)}
	for i, s := range specs {
		if s.Name == "" || s.New == nil {
			return nil, fmt.Errorf("%w: tier %d: a tier needs a name and a constructor", ErrConfig, i)
		}
	}
	switch cfg.Admission {
	case "always":
		m.mu.admission = Always{}
	case "backpressure":
		bp, err := NewBackpressure(specs)
		if err != nil {
			return nil, err
		}
		m.mu.admission = bp
	}
	policy, err := NewPolicy(cfg.CPUPolicy, cfg.CPUSlots())
	if err != nil {
		return nil, err
	}
	arena, err := NewArena(cfg.CPUSlots(), m.blockBytes, ArenaOptions{Lock: cfg.CPUMlock, HugePages: cfg.CPUHugePages})
	if err != nil {
		return nil, err
	}
	if arena.LockErr != nil {
		log.Warn("CPU arena not locked in RAM", "err", arena.LockErr)
	}
	if arena.HugePagesErr != nil {
		log.Info("CPU arena without transparent huge pages", "err", arena.HugePagesErr)
	}
	m.mu.cpu = NewCPUTier(arena, policy)
	m.mu.cpu.emit = func(e Event) { e.Tier = "cpu"; m.emitShared(e) } // its slices are never changed
	m.events.seq = cfg.EventSeqBase
	m.mu.cpu.now = m.nowLocked
	m.mu.jobs = make(map[uint64]*Job)
	m.mu.reqs = make(map[string]*reqState)
	m.mu.counters = newCounters(len(specs))
	m.mu.panicLogs = make([]failureLog, len(specs))
	m.probers = make([]Prober, len(specs))
	m.polling = m.pollInterval > 0 && slices.ContainsFunc(specs, func(s TierSpec) bool { return s.Polled })
	m.pollAlive.Store(m.polling)
	for i, s := range specs {
		var t Tier
		env := TierEnv{Index: i, Wake: m.wakeFor(i), WakeAt: m.tierWakeAt(i), Now: m.now, Progress: m.signalProgress, Emit: m.emitter(s.Name),
			EngineBusy: m.EngineBusy, Arena: arena, Logger: log.With("tier", s.Name), Fingerprint: cfg.Fingerprint()}
		if perr := m.tierCall(i, "new", func() { t, err = s.New(env) }); perr != nil {
			err = perr
		}
		if err != nil {
			err = fmt.Errorf("offload: creating tier %d (%s): %w", i, s.Name, err)
			m.mu.closed = true
			return nil, errors.Join(err, m.closeLocked())
		}
		if p, ok := t.(Prober); ok {
			m.probers[i] = p
		}
		m.mu.tiers = append(m.mu.tiers, t)
	}
	m.pollDone = make(chan struct{})
	go m.pollLoop() // stopped by Close
	return m, nil
}

// lock takes the manager lock; the hold's time is not read yet.
func (m *Manager) lock() {
	m.mu.Lock()
	m.mu.now = time.Time{}
}

// nowLocked is the time of this hold of the manager lock (issue 13, time
// is an input): Config.Now is read once, when first needed, and every
// deadline, stamp and admission decision of the hold uses that reading.
func (m *Manager) nowLocked() time.Time {
	if m.mu.now.IsZero() {
		m.mu.now = m.now()
	}
	return m.mu.now
}

// wakeFor returns tier i's Wake: a polled tier wakes the poll goroutine
// while it runs; otherwise the engine is woken to step (S2.10).
func (m *Manager) wakeFor(i int) func() {
	return func() {
		if m.specs[i].Polled && m.pollAlive.Load() {
			signal(m.wake)
			return
		}
		signal(m.progress)
	}
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// Tier returns the secondary tier built from the spec named name, or nil.
// Callers that hold the tier's own handle (the node's admin API, tests)
// still touch its state only where the tier says so.
func (m *Manager) Tier(name string) Tier {
	m.lock()
	defer m.mu.Unlock()
	for i, s := range m.specs {
		if s.Name == name && i < len(m.mu.tiers) {
			return m.mu.tiers[i]
		}
	}
	return nil
}

// Arena returns the CPU tier's memory, for registering it with a GPU or
// NIXL.
func (m *Manager) Arena() *Arena { return m.mu.cpu.Arena() }

// Config returns the manager's configuration.
func (m *Manager) Config() Config { return m.cfg }

// BlockBytes is the size of one block.
func (m *Manager) BlockBytes() int { return m.blockBytes }

// Progress returns the notification channel of S2.10: it receives a value
// after a job completed, a promotion landed or a lookup answer may have
// changed. An engine with requests waiting on HitPending or Retry sleeps on
// it. It has one slot: several signals may arrive as one.
func (m *Manager) Progress() <-chan struct{} { return m.progress }

func (m *Manager) signalProgress() { signal(m.progress) }

// Audit lists the CPU tier's pins held longer than olderThan (S1.3).
func (m *Manager) Audit(olderThan time.Duration) []PinInfo {
	m.lock()
	defer m.mu.Unlock()
	return m.mu.cpu.Audit(olderThan)
}

// Close shuts the tiers down in reverse order, then unmaps the CPU arena.
// If a tier fails to close, the arena stays mapped, since that tier may
// still touch it. Close is idempotent.
func (m *Manager) Close() error {
	m.lock()
	if m.mu.closed {
		m.mu.Unlock()
		return nil
	}
	m.mu.closed = true
	m.mu.Unlock()
	// Stop the poll goroutine before any tier closes (it may be waiting
	// for the lock, so it is joined without holding it).
	close(m.stop)
	<-m.pollDone
	m.scrubbing.Wait() // no new batch starts: closed is set
	m.closeEvents()
	m.lock()
	defer m.mu.Unlock()
	return m.closeLocked()
}

func (m *Manager) closeLocked() error {
	var errs []error
	for i, t := range slices.Backward(m.mu.tiers) {
		if c, ok := t.(io.Closer); ok {
			var err error
			if perr := m.tierCall(i, "close", func() { err = c.Close() }); perr != nil {
				err = perr
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("closing tier %d (%s): %w", i, m.specs[i].Name, err))
			}
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if m.mu.cpu != nil {
		return m.mu.cpu.Arena().Close()
	}
	return nil
}
