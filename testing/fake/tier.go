// Package fake holds hand-written fakes for tests: a secondary tier that
// answers and completes jobs on command.
package fake

import (
	"slices"
	"sync"
	"time"

	"github.com/kvtier/kvtier/offload"
)

// Tier is an in-memory secondary tier. By default it completes every job
// at once (the result is reported at the next Finished) and answers
// lookups from what it holds; a test can override answers per key, hold
// jobs until it releases them, and fail them. It copies real bytes between
// its map and the CPU arena. Safe for use by the manager and a test at once.
type Tier struct {
	mu      sync.Mutex
	env     offload.TierEnv
	blocks  map[offload.Key][]byte
	answers map[offload.Key]offload.Result
	hold    bool
	level   offload.Level
	held    []*offload.Job
	done    []offload.JobResult
	calls   Calls
	serve   func(p offload.Parent) error
	polled  bool
	peer    map[uint64]bool      // leases taken through the Parent (Run)
	looked  map[offload.Key]bool // every key looked up (LookedUp)
}

// Calls records what the manager asked of the tier.
type Calls struct {
	Lookups  int
	Loads    []*offload.Job
	Stores   []*offload.Job
	New      []*offload.Request
	Finished []*offload.Request
	Touches  [][]offload.Key
	Serves   int
	Resets   int
}

// NewTier returns an empty fake tier that asks for level on every request.
func NewTier(level offload.Level) *Tier {
	return &Tier{blocks: make(map[offload.Key][]byte), answers: make(map[offload.Key]offload.Result), level: level,
		peer: make(map[uint64]bool), looked: make(map[offload.Key]bool)}
}

// SetPolled makes Spec mark the tier as polled (S3.1).
func (t *Tier) SetPolled(on bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.polled = on
}

// Spec returns a TierSpec whose constructor binds and returns t.
func (t *Tier) Spec(name string) offload.TierSpec {
	t.mu.Lock()
	defer t.mu.Unlock()
	return offload.TierSpec{Name: name, Medium: offload.MediumCPU, Locality: offload.Local, Polled: t.polled,
		New: func(env offload.TierEnv) (offload.Tier, error) {
			t.mu.Lock()
			defer t.mu.Unlock()
			t.env = env
			return t, nil
		}}
}

// Put stores a block in the tier.
func (t *Tier) Put(k offload.Key, data []byte) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.blocks[k] = slices.Clone(data)
}

// Has reports whether the tier holds k.
func (t *Tier) Has(k offload.Key) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.blocks[k]
	return ok
}

// Get returns the tier's copy of k.
func (t *Tier) Get(k offload.Key) []byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.blocks[k]
}

// Answer makes lookups of k answer r regardless of what the tier holds.
func (t *Tier) Answer(k offload.Key, r offload.Result) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.answers[k] = r
}

// ClearAnswer undoes Answer.
func (t *Tier) ClearAnswer(k offload.Key) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.answers, k)
}

// Hold makes the tier keep submitted jobs until Release; false completes
// new jobs at once again.
func (t *Tier) Hold(on bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.hold = on
}

// Held returns the ids of the jobs being held, in submission order.
func (t *Tier) Held() []uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	ids := make([]uint64, len(t.held))
	for i, j := range t.held {
		ids[i] = j.ID
	}
	return ids
}

// Release ends held job id: with ok it copies the bytes and succeeds,
// otherwise it fails without touching any slot. It reports whether the job
// was held.
func (t *Tier) Release(id uint64, ok bool) bool { return t.release(id, ok, 0) }

// ReleaseTook is Release(id, true) with the result reporting that the
// transfer took took.
func (t *Tier) ReleaseTook(id uint64, took time.Duration) bool { return t.release(id, true, took) }

func (t *Tier) release(id uint64, ok bool, took time.Duration) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	i := slices.IndexFunc(t.held, func(j *offload.Job) bool { return j.ID == id })
	if i < 0 {
		return false
	}
	j := t.held[i]
	t.held = slices.Delete(t.held, i, i+1)
	if ok {
		t.runLocked(j)
		t.done[len(t.done)-1].Duration = took
	} else {
		t.done = append(t.done, offload.JobResult{ID: j.ID})
	}
	t.wakeLocked()
	return true
}

// ReleasePartial ends a held promotion with only succeeded arriving.
func (t *Tier) ReleasePartial(id uint64, succeeded []offload.Key) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	i := slices.IndexFunc(t.held, func(j *offload.Job) bool { return j.ID == id })
	if i < 0 {
		return false
	}
	j := t.held[i]
	t.held = slices.Delete(t.held, i, i+1)
	for n, k := range j.Keys {
		if slices.Contains(succeeded, k) {
			copy(t.env.Arena.Slot(int(j.Slots[n])), t.blocks[k])
		}
	}
	t.done = append(t.done, offload.JobResult{ID: j.ID, Succeeded: succeeded})
	t.wakeLocked()
	return true
}

// Inject queues a result the manager did not ask for (an unknown job, a
// job of another tier, a duplicate).
func (t *Tier) Inject(r offload.JobResult) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.done = append(t.done, r)
}

// LookedUp says whether the manager ever looked k up in the tier.
func (t *Tier) LookedUp(k offload.Key) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.looked[k]
}

// Calls returns a copy of what the manager asked so far.
func (t *Tier) Calls() Calls {
	t.mu.Lock()
	defer t.mu.Unlock()
	c := t.calls
	c.Loads, c.Stores = slices.Clone(c.Loads), slices.Clone(c.Stores)
	c.New, c.Finished = slices.Clone(c.New), slices.Clone(c.Finished)
	c.Touches = slices.Clone(c.Touches)
	return c
}

// Wake calls the tier's Wake, as a socket reader does when a message
// arrives.
func (t *Tier) Wake() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.wakeLocked()
}

// WakeAt asks the manager's clock for a service by at, as a tier with a
// timeout of its own does (TierEnv.WakeAt).
func (t *Tier) WakeAt(at time.Time) {
	t.mu.Lock()
	wakeAt := t.env.WakeAt
	t.mu.Unlock()
	wakeAt(at)
}

func (t *Tier) wakeLocked() {
	if t.env.Wake != nil {
		t.env.Wake()
	}
}

// runLocked performs job j and queues its result: a promotion fails when
// the tier lacks a key (the keys it has still arrive).
func (t *Tier) runLocked(j *offload.Job) {
	res := offload.JobResult{ID: j.ID, OK: true, Bytes: int64(len(j.Keys) * t.env.Arena.SlotBytes())}
	var got []offload.Key
	for n, k := range j.Keys {
		slot := t.env.Arena.Slot(int(j.Slots[n]))
		if !j.Promotion {
			if _, ok := t.blocks[k]; !ok {
				t.blocks[k] = slices.Clone(slot)
			}
			continue
		}
		if b, ok := t.blocks[k]; ok {
			copy(slot, b)
			got = append(got, k)
		} else {
			res.OK = false
		}
	}
	if !res.OK {
		res.Succeeded, res.Bytes = got, 0
	}
	t.done = append(t.done, res)
}

// Lookup implements offload.Tier.
func (t *Tier) Lookup(k offload.Key, _ *offload.Request) offload.Result {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.calls.Lookups++
	t.looked[k] = true
	if r, ok := t.answers[k]; ok {
		return r
	}
	if _, ok := t.blocks[k]; ok {
		return offload.Hit
	}
	return offload.Miss
}

// SubmitLoad implements offload.Tier.
func (t *Tier) SubmitLoad(j *offload.Job) { t.submit(j, &t.calls.Loads) }

// SubmitStore implements offload.Tier.
func (t *Tier) SubmitStore(j *offload.Job) { t.submit(j, &t.calls.Stores) }

func (t *Tier) submit(j *offload.Job, log *[]*offload.Job) {
	t.mu.Lock()
	defer t.mu.Unlock()
	*log = append(*log, j)
	if t.hold {
		t.held = append(t.held, j)
		return
	}
	t.runLocked(j)
	t.wakeLocked()
}

// Finished implements offload.Tier.
func (t *Tier) Finished() []offload.JobResult {
	t.mu.Lock()
	defer t.mu.Unlock()
	d := t.done
	t.done = nil
	return d
}

// OnNewRequest implements offload.RequestHooks.
func (t *Tier) OnNewRequest(req *offload.Request) offload.Level {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.calls.New = append(t.calls.New, req)
	return t.level
}

// OnRequestFinished implements offload.RequestHooks.
func (t *Tier) OnRequestFinished(req *offload.Request) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.calls.Finished = append(t.calls.Finished, req)
}

// Touch implements offload.Toucher.
func (t *Tier) Touch(keys []offload.Key, _ *offload.Request) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.calls.Touches = append(t.calls.Touches, slices.Clone(keys))
}

// OnServe sets what every Serve call does: fn may use the Parent, return
// an error or panic.
func (t *Tier) OnServe(fn func(p offload.Parent) error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.serve = fn
}

// Serve implements offload.Server. It runs the function set by OnServe
// without holding the fake's own lock, so it may call back into the
// manager (which calls the fake).
func (t *Tier) Serve(p offload.Parent) error {
	t.mu.Lock()
	fn := t.serve
	t.calls.Serves++
	t.mu.Unlock()
	if fn != nil {
		return fn(p)
	}
	return nil
}

// Run performs a job the tier created through its Parent (a lease
// pinning blocks for a peer) as if it had been submitted.
func (t *Tier) Run(j *offload.Job) {
	t.mu.Lock()
	t.peer[j.ID] = true
	t.mu.Unlock()
	t.submit(j, &t.calls.Stores)
}

// OnReset implements offload.Resetter: held jobs made through the Parent
// (pins for peers) fail at once.
func (t *Tier) OnReset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.calls.Resets++
	t.held = slices.DeleteFunc(t.held, func(j *offload.Job) bool {
		if t.peer[j.ID] {
			t.done = append(t.done, offload.JobResult{ID: j.ID})
			return true
		}
		return false
	})
}

// Pending implements offload.Pender: held jobs are outstanding work.
func (t *Tier) Pending() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.held) > 0
}

var (
	_ offload.Tier         = (*Tier)(nil)
	_ offload.RequestHooks = (*Tier)(nil)
	_ offload.Toucher      = (*Tier)(nil)
	_ offload.Pender       = (*Tier)(nil)
	_ offload.Server       = (*Tier)(nil)
	_ offload.Resetter     = (*Tier)(nil)
)
