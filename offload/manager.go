package offload

import (
	"cmp"
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

	pollInterval time.Duration
	hitTimeout   time.Duration
	wake         chan struct{} // wakes the poll goroutine
	stop         chan struct{} // closed by Close
	pollDone     chan struct{} // closed when the poll goroutine returned
	pollAlive    atomic.Bool   // the poll goroutine runs and services the polled tiers
	polling      bool          // it services them at all (tier_poll_interval > 0 and a polled tier)
	clock        clock         // the poll goroutine's timer, the manager's only one
	events       eventHub      // S2.8; its own lock, taken after mu

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

		deadlineAt time.Time // the nearest HitPending or Retry deadline the clock was asked for
		reset      *resetWait
	}
}

type reqState struct {
	req           *Request
	pendingStores int
	finished      bool
	requestLevel  []int // tiers that asked for RequestLevel, ascending
	parked        []Key // cascade keys still writing in the CPU tier
	sources       map[Key]int
	// deadlines holds, per key that answered HitPending or Retry and has
	// not settled, when it turns into a stable Miss (S4.1, S4.7); expired
	// holds the keys that did.
	deadlines     map[Key]deadline
	deadlinesPeak int // the most keys deadlines held
	expired       map[Key]struct{}
}

// StorePlan is the answer to PrepareStore: the keys that need storing, the
// CPU slots reserved for them (parallel to Keys) and the keys evicted to
// make room.
type StorePlan struct {
	Keys    []Key
	Slots   []int32
	Evicted []Key
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
	m := &Manager{cfg: cfg, log: log, blockBytes: cfg.Geometry.BlockBytes(), specs: slices.Clone(specs),
		progress: make(chan struct{}, 1), wake: make(chan struct{}, 1), stop: make(chan struct{}), clock: newClock(len(specs)),
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
	m.mu.cpu.emit = m.emitter("cpu")
	m.mu.jobs = make(map[uint64]*Job)
	m.mu.reqs = make(map[string]*reqState)
	m.mu.counters = newCounters(len(specs))
	m.mu.panicLogs = make([]failureLog, len(specs))
	m.polling = m.pollInterval > 0 && slices.ContainsFunc(specs, func(s TierSpec) bool { return s.Polled })
	m.pollAlive.Store(m.polling)
	for i, s := range specs {
		var t Tier
		env := TierEnv{Index: i, Wake: m.wakeFor(i), WakeAt: m.tierWakeAt(i), Progress: m.signalProgress, Emit: m.emitter(s.Name),
			Arena: arena, Logger: log.With("tier", s.Name)}
		if perr := m.tierCall(i, "new", func() { t, err = s.New(env) }); perr != nil {
			err = perr
		}
		if err != nil {
			err = fmt.Errorf("offload: creating tier %d (%s): %w", i, s.Name, err)
			m.mu.closed = true
			return nil, errors.Join(err, m.closeLocked())
		}
		m.mu.tiers = append(m.mu.tiers, t)
	}
	m.pollDone = make(chan struct{})
	go m.pollLoop() // stopped by Close
	return m, nil
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
	m.mu.Lock()
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

// Step is the manager with its lock held: the scheduling phase of an engine
// step (from Begin) or one call made outside a step (inside Do). A Step is
// valid until OnScheduleEnd, or until Do's function returns.
type Step struct {
	m     *Manager
	ended bool
	now   time.Time // read once per step, when a deadline first needs it
}

// Begin starts an engine step: it takes the manager lock and applies the
// results tiers have reported. End the step with OnScheduleEnd.
func (m *Manager) Begin() *Step {
	m.mu.Lock()
	s := &Step{m: m}
	if !m.mu.closed {
		m.collectLocked(nil)
	}
	return s
}

// Do runs fn as one step outside the engine's scheduling phase (an
// executor reporting a finished copy, an abort, an admin call): Begin, fn,
// OnScheduleEnd. It ends like every step (issue 13): the service pass,
// the promotions fn queued, the tiers' step-end hooks (a P2P lookup
// registered in fn is asked when Do returns).
func (m *Manager) Do(fn func(s *Step)) {
	s := m.Begin()
	defer s.OnScheduleEnd()
	fn(s)
}

// unlock releases the manager lock; the hits answered under it are no
// longer protected from eviction.
func (m *Manager) unlock() {
	m.mu.cpu.endHold()
	m.mu.Unlock()
}

func (s *Step) check(op string) error {
	switch {
	case s.ended:
		s.m.misuseLocked(op, "step_ended", ErrStepEnded)
		return fmt.Errorf("%s: %w", op, ErrStepEnded)
	case s.m.mu.closed:
		return fmt.Errorf("%s: %w", op, ErrClosed)
	}
	return nil
}

// misuseLocked logs and counts a caller's or a tier's mistake.
func (m *Manager) misuseLocked(op, reason string, err error) {
	m.mu.counters.errors[reason]++
	m.log.Warn("offload: "+op+" failed", "reason", reason, "err", err)
}

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
	return s.m.lookupLocked(k, req, -1, &s.now)
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

// now is the caller's clock reading, taken when first needed (zero until
// then), so a step's lookups read the clock once between them.
func (m *Manager) lookupLocked(k Key, req *Request, exclude int, now *time.Time) Result {
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
	return m.trackPendingLocked(st, k, m.lookupTiersLocked(k, req, exclude), now)
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
	if m.mu.resetting || !m.mu.admission.Admit(tier, 1, true) {
		return false
	}
	i := slices.IndexFunc(m.mu.pending, func(j *Job) bool { return j.Tier == tier && j.Req == req })
	id := m.mu.nextJob
	if i >= 0 {
		id = m.mu.pending[i].ID
	}
	added, slots, _, ok := m.mu.cpu.Reserve([]Key{k}, JobOwner(id))
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
	now := time.Now()
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

// PrepareLoad pins keys for a CPU → GPU copy on behalf of req and returns
// their slots. Every key must be ready (a Hit in this step); otherwise
// nothing is pinned and the error names the key (S2.3).
func (s *Step) PrepareLoad(keys []Key, req *Request) ([]int32, error) {
	if err := s.check("prepare load"); err != nil {
		return nil, err
	}
	slots, err := s.m.mu.cpu.Pin(keys, RequestOwner(req.ID), true)
	if err != nil {
		s.m.misuseLocked("prepare load", "not_ready", err)
		return nil, fmt.Errorf("prepare load for request %s: %w", req.ID, err)
	}
	return slots, nil
}

// CompleteLoad releases the pins PrepareLoad took for req.
func (s *Step) CompleteLoad(keys []Key, req *Request) error {
	if err := s.check("complete load"); err != nil {
		return err
	}
	m := s.m
	held, err := m.mu.cpu.Unpin(keys, RequestOwner(req.ID))
	if err != nil {
		m.misuseLocked("complete load", "not_pinned", err)
		return fmt.Errorf("complete load for request %s: %w", req.ID, err)
	}
	m.mu.counters.xfer[0][dirRead].add(len(keys)*m.blockBytes, held)
	return nil
}

// Touch marks keys recently used, the first most recently, in the CPU tier
// and in every tier that keeps its own recency.
func (s *Step) Touch(keys []Key, req *Request) {
	if s.check("touch") != nil {
		return
	}
	s.m.mu.cpu.Touch(keys)
	for i, t := range s.m.mu.tiers {
		if tt, ok := t.(Toucher); ok {
			s.m.tierCall(i, "touch", func() { tt.Touch(keys, req) })
		}
	}
}

// PrepareStore reserves CPU slots for the keys of keys that are not
// resident, evicting idle blocks if needed (S2.4). A key that a promotion
// is still writing counts as not resident: the computed block replaces
// it, and the promotion, whenever it ends, never makes its slot readable.
// It returns nil, nil when not enough blocks can be evicted. Every
// non-empty plan must be followed by exactly one CompleteStore. Keys
// already resident are cascaded to the tiers that asked for whole
// requests.
func (s *Step) PrepareStore(keys []Key, req *Request) (*StorePlan, error) {
	if err := s.check("prepare store"); err != nil {
		return nil, err
	}
	m := s.m
	st := m.mu.reqs[req.ID]
	if st == nil {
		err := fmt.Errorf("prepare store: request %s: %w (call OnNewRequest first)", req.ID, ErrUnknownRequest)
		m.misuseLocked("prepare store", "unknown_request", err)
		return nil, err
	}
	if m.mu.resetting {
		return nil, nil // S5.1: nothing new starts while the cache resets
	}
	// A block still being promoted is stored all the same: the engine
	// computed it, typically after the promotion stalled past
	// hit_pending_timeout (S4.1); the promotion's slot is detached.
	added, slots, evicted, ok := m.mu.cpu.reserveStore(keys, RequestOwner(req.ID))
	if !ok {
		return nil, nil
	}
	if len(added) > 0 {
		st.pendingStores++
	}
	if len(st.requestLevel) > 0 {
		var existing []Key
		for _, k := range keys {
			if !slices.Contains(added, k) && !slices.Contains(existing, k) {
				existing = append(existing, k)
			}
		}
		m.cascadeExistingLocked(existing, st)
	}
	return &StorePlan{Keys: added, Slots: slots, Evicted: evicted}, nil
}

// CompleteStore ends the GPU → CPU copy of a PrepareStore: with ok the
// blocks become readable and cascade to every secondary tier that
// admission allows; without, their slots are freed and nothing cascades
// (S2.4). A store that finishes after its request was aborted still
// completes in the CPU tier but cascades nowhere.
func (s *Step) CompleteStore(keys []Key, req *Request, ok bool) error {
	if err := s.check("complete store"); err != nil {
		return err
	}
	m := s.m
	done, took := m.mu.cpu.Commit(keys, RequestOwner(req.ID), ok)
	if ok {
		m.mu.counters.xfer[0][dirWrite].add(len(done)*m.blockBytes, took)
	}
	st := m.mu.reqs[req.ID]
	if st == nil || st.req != req {
		if len(done) > 0 {
			return nil // aborted while its copy was in flight
		}
		err := fmt.Errorf("complete store: request %s: %w", req.ID, ErrUnknownRequest)
		m.misuseLocked("complete store", "unknown_request", err)
		return err
	}
	if st.pendingStores == 0 {
		err := fmt.Errorf("complete store: request %s: %w", req.ID, ErrNoStore)
		m.misuseLocked("complete store", "no_store", err)
		return err
	}
	st.pendingStores--
	if ok && len(done) > 0 {
		for i := range m.mu.tiers {
			m.cascadeLocked(done, req, i)
		}
	}
	m.maybeFinalizeLocked(st, -1)
	return nil
}

// cascadeLocked creates and submits a cascade of ready keys to tier.
func (m *Manager) cascadeLocked(keys []Key, req *Request, tier int) {
	j, err := m.createStoreJobLocked(keys, req, tier)
	if err != nil || j == nil {
		return
	}
	m.submitLocked(j)
}

// CreateStoreJob pins keys, which must be ready, for a cascade to tier and
// submits it; the pins are released when the tier reports the job. It
// returns nil, nil when admission refuses (no pin, no job id).
func (s *Step) CreateStoreJob(keys []Key, req *Request, tier int) (*Job, error) {
	if err := s.check("create store job"); err != nil {
		return nil, err
	}
	if tier < 0 || tier >= len(s.m.mu.tiers) {
		return nil, fmt.Errorf("create store job: no secondary tier %d", tier)
	}
	j, err := s.m.createStoreJobLocked(keys, req, tier)
	if j != nil {
		if err := s.m.submitLocked(j); err != nil {
			return nil, fmt.Errorf("create store job for tier %d: %w", tier, err)
		}
	}
	return j, err
}

func (m *Manager) createStoreJobLocked(keys []Key, req *Request, tier int) (*Job, error) {
	if len(keys) == 0 || m.mu.resetting || !m.mu.admission.Admit(tier, len(keys), false) {
		return nil, nil
	}
	return m.pinJobLocked("create store job", keys, req, tier, false)
}

// pinJobLocked pins keys, which must be ready, for a cascade or a lease of
// tier and registers the job.
func (m *Manager) pinJobLocked(op string, keys []Key, req *Request, tier int, lease bool) (*Job, error) {
	id := m.mu.nextJob
	slots, err := m.mu.cpu.Pin(keys, JobOwner(id), false)
	if err != nil {
		m.misuseLocked(op, "not_ready", err)
		return nil, fmt.Errorf("%s for tier %d: %w", op, tier, err)
	}
	m.mu.nextJob++
	j := &Job{ID: id, Tier: tier, Epoch: m.mu.epoch, Lease: lease, Keys: slices.Clone(keys), Slots: slots, Req: req, Submitted: time.Now()}
	m.mu.jobs[id] = j
	return j, nil
}

// cascadeExistingLocked sends keys already in the CPU tier to st's
// request-level tiers; keys still being written are parked until they
// resolve (S2.4).
func (m *Manager) cascadeExistingLocked(keys []Key, st *reqState) {
	var ready []Key
	for _, k := range keys {
		switch m.mu.cpu.Lookup(k) {
		case Hit:
			ready = append(ready, k)
		case HitPending:
			if !slices.Contains(st.parked, k) {
				st.parked = append(st.parked, k)
			}
		}
	}
	if len(st.parked) > 0 && !slices.Contains(m.mu.parked, st) {
		m.mu.parked = append(m.mu.parked, st)
	}
	if len(ready) == 0 {
		return
	}
	for _, i := range st.requestLevel {
		m.cascadeLocked(ready, st.req, i)
	}
}

// flushParkedLocked retries every parked cascade key; a parked key always
// resolves, because a failed write frees its slot.
func (m *Manager) flushParkedLocked() {
	parked := m.mu.parked
	m.mu.parked = nil
	for _, st := range parked {
		keys := st.parked
		st.parked = nil
		m.cascadeExistingLocked(keys, st)
		m.maybeFinalizeLocked(st, -1)
	}
}

// OnNewRequest registers req and asks each tier which blocks it wants. It
// returns RequestLevel if any tier asked for whole requests.
func (s *Step) OnNewRequest(req *Request) (Level, error) {
	if err := s.check("new request"); err != nil {
		return ChunkLevel, err
	}
	return s.m.onNewRequestLocked(req, -1)
}

func (m *Manager) onNewRequestLocked(req *Request, exclude int) (Level, error) {
	if req == nil || req.ID == "" {
		return ChunkLevel, fmt.Errorf("new request: %w: a request needs an id", ErrUnknownRequest)
	}
	if _, ok := m.mu.reqs[req.ID]; ok {
		err := fmt.Errorf("new request %s: %w", req.ID, ErrRequestExists)
		m.misuseLocked("new request", "request_exists", err)
		return ChunkLevel, err
	}
	st := &reqState{req: req}
	m.mu.reqs[req.ID] = st
	req.st = st
	lvl := ChunkLevel
	for i, t := range m.mu.tiers {
		h, ok := t.(RequestHooks)
		if !ok || i == exclude {
			continue
		}
		l := ChunkLevel // also when the tier panics (S2.11)
		m.tierCall(i, "new request", func() { l = h.OnNewRequest(req) })
		if l == RequestLevel {
			st.requestLevel = append(st.requestLevel, i)
			lvl = RequestLevel
		}
	}
	return lvl, nil
}

// OnRequestFinished says req will make no new calls. The tiers see it
// once its stores completed and no cascade is parked (S2.5). Stores and
// loads already prepared may still complete afterwards.
func (s *Step) OnRequestFinished(req *Request) error {
	if err := s.check("request finished"); err != nil {
		return err
	}
	return s.m.onRequestFinishedLocked(req, -1)
}

func (m *Manager) onRequestFinishedLocked(req *Request, exclude int) error {
	st := m.mu.reqs[req.ID]
	if st == nil || st.req != req {
		err := fmt.Errorf("request finished: %s: %w", req.ID, ErrUnknownRequest)
		m.misuseLocked("request finished", "unknown_request", err)
		return err
	}
	st.finished = true
	dropDeadlinesLocked(st) // S4.3
	st.expired = nil
	m.maybeFinalizeLocked(st, exclude)
	return nil
}

func (m *Manager) maybeFinalizeLocked(st *reqState, exclude int) {
	if !st.finished || st.pendingStores > 0 || len(st.parked) > 0 {
		return
	}
	m.finalizeLocked(st, exclude)
}

func (m *Manager) finalizeLocked(st *reqState, exclude int) {
	delete(m.mu.reqs, st.req.ID)
	st.req.st = nil
	dropDeadlinesLocked(st)
	for i, t := range m.mu.tiers {
		if h, ok := t.(RequestHooks); ok && i != exclude {
			m.tierCall(i, "request finished", func() { h.OnRequestFinished(st.req) })
		}
	}
}

// Abort releases at once everything req holds — its pins, its queued
// promotions, its parked cascades — and tells the tiers (S2.9). Copies
// already in flight complete normally. Abort is idempotent.
func (s *Step) Abort(req *Request) {
	if s.check("abort") != nil {
		return
	}
	m := s.m
	if n := m.mu.cpu.ReleaseOwner(RequestOwner(req.ID)); n > 0 {
		m.log.Info("abort released pins", "request", req.ID, "pins", n)
	}
	m.mu.pending = slices.DeleteFunc(m.mu.pending, func(j *Job) bool {
		if j.Req != req {
			return false
		}
		m.mu.cpu.Commit(j.Keys, JobOwner(j.ID), false)
		return true
	})
	st := m.mu.reqs[req.ID]
	if st == nil || st.req != req {
		return
	}
	st.parked = nil
	m.mu.parked = slices.DeleteFunc(m.mu.parked, func(p *reqState) bool { return p == st })
	m.finalizeLocked(st, -1)
}

// OnScheduleEnd ends the step (S2.2): it applies finished jobs, lets tiers
// serve peers, submits the promotions queued in this step, retries parked
// cascades, tells tiers the step ended and releases the lock.
func (s *Step) OnScheduleEnd() {
	if s.ended {
		s.m.misuseLocked("schedule end", "step_ended", ErrStepEnded)
		return
	}
	m := s.m
	defer m.unlock()
	s.ended = true
	if m.mu.closed {
		return
	}
	if _, err := m.serviceLocked(nil); err != nil {
		for _, e := range joined(err) {
			if !errors.Is(e, ErrTierPanic) { // panics are logged where they are recovered
				m.log.Warn("offload: servicing the tiers at the step's end failed", "err", e)
			}
		}
	}
	for i, t := range m.mu.tiers {
		if e, ok := t.(StepEnder); ok {
			m.tierCall(i, "schedule end", e.OnScheduleEnd)
		}
	}
}

// serviceLocked is the one service pass, of the step's end and of the poll
// goroutine (issue 13): the tiers' results, their outside requests, the
// results those caused, the promotions queued meanwhile (S2.2), the
// parked cascades; it reports whether a tier still has pending work
// (Pender). only picks the tiers (nil: every tier); the queued promotions
// and parked cascades are the manager's and always flushed. The error
// joins the tiers' errors, each panic among them (S2.11).
func (m *Manager) serviceLocked(only func(tier int) bool) (again bool, err error) {
	pick := func(i int) bool { return only == nil || only(i) }
	errs := []error{m.collectLocked(only)}
	for i, t := range m.mu.tiers {
		if srv, ok := t.(Server); ok && pick(i) {
			if e := m.serveLocked(i, srv); e != nil {
				errs = append(errs, fmt.Errorf("tier %d (%s): %w", i, m.specs[i].Name, e))
			}
		}
	}
	errs = append(errs, m.collectLocked(only))
	m.flushPromotionsLocked()
	m.flushParkedLocked()
	for i, t := range m.mu.tiers {
		if p, ok := t.(Pender); ok && pick(i) {
			pending, e := m.pendingLocked(i, p)
			again = again || pending
			errs = append(errs, e)
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
	m.mu.admission.Completed(j, r, m.blockBytes)
	took := r.Duration
	if took <= 0 {
		took = time.Since(j.Submitted)
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
	m.mu.cpu.Commit(good, owner, true)
	m.mu.cpu.Commit(bad, owner, false)
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

// HasPendingWork reports whether the engine must keep stepping although it
// has nothing to schedule (S3.4). While the poll goroutine services the
// polled tiers, their work does not count. It counts: parked cascades;
// jobs, queued promotions and pending work of tiers that are not polled
// (or of every tier when the poll goroutine services none); a keep-alive
// while a tier that serves outside requests is not serviced by it; and a
// keep-alive when more than one secondary tier is configured and one of
// them is not polled.
func (m *Manager) HasPendingWork() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mu.closed {
		return false
	}
	alive := m.pollAlive.Load()
	byPoll := func(tier int) bool { return alive && m.specs[tier].Polled }
	if len(m.mu.parked) > 0 {
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

// Audit lists the CPU tier's pins held longer than olderThan (S1.3).
func (m *Manager) Audit(olderThan time.Duration) []PinInfo {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mu.cpu.Audit(olderThan)
}

// Close shuts the tiers down in reverse order, then unmaps the CPU arena.
// If a tier fails to close, the arena stays mapped, since that tier may
// still touch it. Close is idempotent.
func (m *Manager) Close() error {
	m.mu.Lock()
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
	m.closeEvents()
	m.mu.Lock()
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
	var now time.Time
	return p.m.lookupLocked(k, req, p.tier, &now)
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
