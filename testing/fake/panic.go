package fake

import (
	"slices"
	"sync"

	"github.com/kvtier/kvtier/offload"
)

// PanicTier is a Tier that panics in the methods named with PanicIn and
// otherwise behaves as the Tier it wraps. Besides Tier's interfaces it
// implements offload.StepEnder, offload.StatsReporter and io.Closer, so
// that every call the manager makes into a tier can panic (S2.11).
type PanicTier struct {
	*Tier
	mu sync.Mutex
	in []string
}

// PanicMethods lists every method PanicIn accepts; "New" is the tier's
// constructor.
var PanicMethods = []string{"New", "Lookup", "SubmitLoad", "SubmitStore", "Finished", "OnNewRequest",
	"OnRequestFinished", "Touch", "Serve", "OnScheduleEnd", "OnReset", "Pending", "Stats", "Close"}

// NewPanicTier returns an empty PanicTier that asks for level on every
// request and panics nowhere yet.
func NewPanicTier(level offload.Level) *PanicTier { return &PanicTier{Tier: NewTier(level)} }

// PanicIn makes the named methods panic from now on, and no others.
func (p *PanicTier) PanicIn(methods ...string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.in = slices.Clone(methods)
}

func (p *PanicTier) check(method string) {
	p.mu.Lock()
	on := slices.Contains(p.in, method)
	p.mu.Unlock()
	if on {
		panic("fake: " + method + " panicked")
	}
}

// Spec returns a TierSpec whose constructor binds the wrapped Tier and
// returns p.
func (p *PanicTier) Spec(name string) offload.TierSpec {
	s := p.Tier.Spec(name)
	bind := s.New
	s.New = func(env offload.TierEnv) (offload.Tier, error) {
		p.check("New")
		if _, err := bind(env); err != nil {
			return nil, err
		}
		return p, nil
	}
	return s
}

// Lookup implements offload.Tier.
func (p *PanicTier) Lookup(k offload.Key, req *offload.Request) offload.Result {
	p.check("Lookup")
	return p.Tier.Lookup(k, req)
}

// SubmitLoad implements offload.Tier; a panic drops the job.
func (p *PanicTier) SubmitLoad(j *offload.Job) {
	p.check("SubmitLoad")
	p.Tier.SubmitLoad(j)
}

// SubmitStore implements offload.Tier; a panic drops the job.
func (p *PanicTier) SubmitStore(j *offload.Job) {
	p.check("SubmitStore")
	p.Tier.SubmitStore(j)
}

// Finished implements offload.Tier; a panic keeps the results for the
// next call.
func (p *PanicTier) Finished() []offload.JobResult {
	p.check("Finished")
	return p.Tier.Finished()
}

// OnNewRequest implements offload.RequestHooks.
func (p *PanicTier) OnNewRequest(req *offload.Request) offload.Level {
	p.check("OnNewRequest")
	return p.Tier.OnNewRequest(req)
}

// OnRequestFinished implements offload.RequestHooks.
func (p *PanicTier) OnRequestFinished(req *offload.Request) {
	p.check("OnRequestFinished")
	p.Tier.OnRequestFinished(req)
}

// Touch implements offload.Toucher.
func (p *PanicTier) Touch(keys []offload.Key, req *offload.Request) {
	p.check("Touch")
	p.Tier.Touch(keys, req)
}

// Serve implements offload.Server.
func (p *PanicTier) Serve(parent offload.Parent) error {
	p.check("Serve")
	return p.Tier.Serve(parent)
}

// OnScheduleEnd implements offload.StepEnder.
func (p *PanicTier) OnScheduleEnd() { p.check("OnScheduleEnd") }

// OnReset implements offload.Resetter.
func (p *PanicTier) OnReset() {
	p.check("OnReset")
	p.Tier.OnReset()
}

// Pending implements offload.Pender.
func (p *PanicTier) Pending() bool {
	p.check("Pending")
	return p.Tier.Pending()
}

// Stats implements offload.StatsReporter: no metrics of its own.
func (p *PanicTier) Stats() []offload.Stat {
	p.check("Stats")
	return nil
}

// Close implements io.Closer.
func (p *PanicTier) Close() error {
	p.check("Close")
	return nil
}

var (
	_ offload.Tier          = (*PanicTier)(nil)
	_ offload.RequestHooks  = (*PanicTier)(nil)
	_ offload.Toucher       = (*PanicTier)(nil)
	_ offload.Pender        = (*PanicTier)(nil)
	_ offload.Server        = (*PanicTier)(nil)
	_ offload.Resetter      = (*PanicTier)(nil)
	_ offload.StepEnder     = (*PanicTier)(nil)
	_ offload.StatsReporter = (*PanicTier)(nil)
)
