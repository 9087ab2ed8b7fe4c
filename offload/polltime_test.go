package offload

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// stampTier holds store jobs until OnScheduleEnd, then reports them done
// with no duration of its own (the manager measures from Submitted).
type stampTier struct {
	env     TierEnv
	mu      sync.Mutex
	jobs    []*Job
	release bool
}

func (t *stampTier) Lookup(Key, *Request) Result { return Miss }
func (t *stampTier) SubmitLoad(*Job)             {}
func (t *stampTier) SubmitStore(j *Job)          { t.mu.Lock(); t.jobs = append(t.jobs, j); t.mu.Unlock() }
func (t *stampTier) OnScheduleEnd()              { t.mu.Lock(); t.release = true; t.mu.Unlock() }
func (t *stampTier) Finished() []JobResult {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.release {
		return nil
	}
	var out []JobResult
	for _, j := range t.jobs {
		out = append(out, JobResult{ID: j.ID, OK: true})
	}
	t.jobs = nil
	return out
}

// Issue 13 (found in review): the poll goroutine's pass takes its time
// under the lock. Woken while an engine step held the lock, it waits; the
// step stamps a cascade 10 s later; the pass that then collects it must
// not measure it from an earlier reading (a negative write time, a
// counter going down, a negative backpressure sample).
func TestPollPassTimeAfterLock(t *testing.T) {
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var off atomic.Int64
	read := make(chan struct{}, 64)
	cfg := DefaultConfig()
	cfg.Geometry = Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(8 * cfg.slotStride())
	cfg.TierPollInterval = Duration(time.Second)
	cfg.Admission = "backpressure"
	cfg.Now = func() time.Time {
		select {
		case read <- struct{}{}:
		default:
		}
		return base.Add(time.Duration(off.Load()))
	}
	tier := &stampTier{}
	m, err := New(cfg, TierSpec{Name: "stamp", Locality: Local, Polled: true,
		New: func(env TierEnv) (Tier, error) { tier.env = env; return tier, nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	s := m.Begin() // the engine holds the lock
	for len(read) > 0 {
		<-read
	}
	tier.env.Wake()
	select { // the poll goroutine woke, read the clock (0 s), and waits for the lock
	case <-read:
	case <-time.After(5 * time.Second):
		t.Fatal("the poll goroutine never read the clock")
	}
	off.Store(int64(10 * time.Second)) // the step's work, 10 s later
	req := &Request{ID: "r"}
	s.OnNewRequest(req)
	p, err := s.PrepareStore(testKeys(1), req)
	if err != nil || p == nil {
		t.Fatalf("PrepareStore: %v %v", p, err)
	}
	s.CompleteStore(p.Keys, req, true) // the cascade, submitted at 10 s
	s.OnRequestFinished(req)
	s.OnScheduleEnd() // the poll pass runs now and collects it
	deadline := time.After(5 * time.Second)
	for m.Metrics().Tiers[1].ActiveCascades != 0 {
		select {
		case <-m.Progress():
		case <-time.After(10 * time.Millisecond):
		case <-deadline:
			t.Fatal("the cascade never finished")
		}
	}
	if ws := m.Metrics().Tiers[1].WriteSeconds; ws < 0 {
		t.Errorf("the tier's write seconds = %v after one cascade: the pass ran at a time before the step's", ws)
	}
}
