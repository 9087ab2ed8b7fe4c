package offload

import (
	"log/slog"
	"time"
)

// Tier is the contract every secondary tier implements (disk, P2P, …).
// Every method is called with the manager lock held and must not block.
type Tier interface {
	// Lookup answers Hit (present and loadable), Miss or Retry (still
	// finding out). Never HitPending.
	Lookup(k Key, req *Request) Result
	// SubmitLoad starts a promotion: copy job.Keys into the reserved CPU
	// slots job.Slots. The result comes back through Finished.
	SubmitLoad(job *Job)
	// SubmitStore starts a cascade: copy the pinned CPU slots job.Slots
	// out. The tier skips keys it already has. The result comes back
	// through Finished.
	SubmitStore(job *Job)
	// Finished returns every job that ended since the last call, each once.
	Finished() []JobResult
}

// Optional tier capabilities, found by type assertion.
type (
	// RequestHooks is implemented by tiers that keep per-request state.
	RequestHooks interface {
		// OnNewRequest says whether the tier wants only newly computed
		// blocks (ChunkLevel) or every block of the request (RequestLevel).
		OnNewRequest(req *Request) Level
		// OnRequestFinished is called once, after the last submit for req.
		OnRequestFinished(req *Request)
	}
	// Server is implemented by tiers that serve requests from outside the
	// engine (peers): Serve runs under the manager lock with a facade that
	// is valid only during the call. An error counts as a failed poll pass
	// (S3.3); the tier keeps being served.
	Server interface{ Serve(p Parent) error }
	// StepEnder is implemented by tiers that batch work per engine step
	// (for example lookups sent to a peer once per step).
	StepEnder interface{ OnScheduleEnd() }
	// Prober is implemented by tiers that find out asynchronously (a
	// peer). Their Lookup stays pure: a key they were not asked about
	// answers Retry and changes nothing. The next service pass that
	// services them (the step's end, before the step-end hooks; a poll
	// pass) hands them every key they answered Retry for since, one call
	// per request, in lookup order, and they start finding out (issue
	// 13). keys is valid only during the call.
	Prober interface {
		Probe(req *Request, keys []Key)
	}
	// Toucher is implemented by tiers that keep their own recency.
	Toucher interface {
		Touch(keys []Key, req *Request)
	}
	// Pender is implemented by tiers with outstanding work: jobs in
	// flight, results not yet collected, or state that only polling
	// reveals (a transfer's status).
	Pender interface{ Pending() bool }
	// Resetter is implemented by tiers that hold pins for outside requests
	// (a peer's lookup waiting for its fetch): OnReset, called under the
	// lock when a cache reset starts, releases them by reporting those jobs
	// finished (S5.1).
	Resetter interface{ OnReset() }
	// StatsReporter is implemented by tiers with metrics of their own; the
	// manager's snapshot and Prometheus text include them with the tier's
	// label.
	StatsReporter interface{ Stats() []Stat }
)

// Stat is one tier-specific metric.
type Stat struct {
	// Name is the full metric name, e.g. "kv_offload_disk_corruptions_total".
	Name string `json:"name"`
	// Type is "counter", "gauge" or "histogram" (Hist, not Value).
	Type  string  `json:"type"`
	Help  string  `json:"help"`
	Value float64 `json:"value"`
	// Labels are extra label name/value pairs beside the tier's; stats of
	// one name with different labels are samples of one family.
	Labels []string   `json:"labels,omitempty"`
	Hist   *Histogram `json:"histogram,omitempty"`
}

// Level says which blocks of a request a tier wants.
type Level uint8

const (
	// ChunkLevel: the tier receives only newly computed blocks.
	ChunkLevel Level = iota
	// RequestLevel: the tier receives every block of the request, including
	// prefix hits already in the CPU tier (a P2P producer wants this).
	RequestLevel
)

// Parent is the facade a tier uses from inside Serve, bound to that tier:
// its lookups skip the tier itself and its leases belong to it. Per
// external request the order is OnNewRequest, any Lookup and Lease calls,
// then OnRequestFinished (also when nothing was found).
type Parent interface {
	OnNewRequest(req *Request) error
	Lookup(k Key, req *Request) Result
	// Lease pins keys (which must be ready) for this tier on behalf of an
	// outside request, a peer's fetch (S6.5), and returns the lease: a Job
	// with Lease set, which the tier reports through Finished once the
	// pins may go. A lease is not a store: admission never refuses it and
	// its end feeds no store metric and no backpressure estimate (S2.7).
	// It returns nil, nil for no keys or while the cache resets.
	Lease(keys []Key, req *Request) (*Job, error)
	OnRequestFinished(req *Request) error
}

// Medium is what a tier stores blocks on.
type Medium uint8

// Mediums, for tier filters.
const (
	MediumAny Medium = iota
	MediumCPU
	MediumStorage
)

// Locality says whether a tier is on this node or across the network.
type Locality uint8

// Localities, for tier filters and backpressure defaults.
const (
	LocalityAny Locality = iota
	Local
	Remote
)

// TierMatcher matches tiers by medium and locality; a zero field matches
// anything, and so does a tier's zero field.
type TierMatcher struct {
	Medium   Medium
	Locality Locality
}

func (m TierMatcher) matches(s *TierSpec) bool {
	return (m.Medium == MediumAny || s.Medium == MediumAny || m.Medium == s.Medium) &&
		(m.Locality == LocalityAny || s.Locality == LocalityAny || m.Locality == s.Locality)
}

// Request is one inference request as the manager sees it. The manager and
// tiers keep the pointer: the same *Request reaches every job and tier
// call made for it.
type Request struct {
	// ID names the request; it owns the request's pins.
	ID string
	// TransferParams are the request's kv_transfer_params, for tiers.
	TransferParams map[string]any
	// LoadTiers, when non-nil, limits which secondary tiers lookups ask:
	// a tier is asked when any matcher matches it (an empty list asks
	// none). It never limits the CPU tier or stores.
	LoadTiers []TierMatcher
	// Chain, when set, describes the request's prompt blocks: the CPU
	// tier's stored events then carry their parent key and token ids.
	Chain *Chain

	tierState map[int]any
	st        *reqState // the manager's state while registered
}

// TierState returns what tier index stored on the request with
// SetTierState (a tier's parsed parameters), or nil.
func (r *Request) TierState(index int) any { return r.tierState[index] }

// SetTierState stores v for tier index on the request.
func (r *Request) SetTierState(index int, v any) {
	if r.tierState == nil {
		r.tierState = make(map[int]any)
	}
	r.tierState[index] = v
}

func (r *Request) allows(s *TierSpec) bool {
	if r.LoadTiers == nil {
		return true
	}
	for _, m := range r.LoadTiers {
		if m.matches(s) {
			return true
		}
	}
	return false
}

// Job moves blocks between the CPU tier and one secondary tier.
type Job struct {
	ID uint64
	// Tier is the index of the secondary tier that owns the job.
	Tier int
	// Epoch is the cache epoch the job was made in; a result from an older
	// epoch never makes a block readable.
	Epoch uint64
	// Promotion is true for secondary → CPU, false for a cascade CPU →
	// secondary.
	Promotion bool
	// Lease is true for pins a tier holds for an outside request
	// (Parent.Lease); Slots are pinned as for a cascade, but nothing is
	// stored.
	Lease bool
	Keys  []Key
	// Slots are the CPU slots, parallel to Keys: reserved (writing) for a
	// promotion, pinned for a cascade.
	Slots     []int32
	Req       *Request
	Submitted time.Time
}

// JobResult reports the end of a job.
type JobResult struct {
	ID uint64
	OK bool
	// Succeeded lists the keys of a failed promotion that did arrive
	// (partial success); ignored when OK.
	Succeeded []Key
	// Bytes and Duration, when the tier measures them, feed metrics and
	// backpressure; zero means unknown.
	Bytes    int64
	Duration time.Duration
}

// TierEnv is what a tier receives at construction.
type TierEnv struct {
	// Index is the tier's position among the secondary tiers.
	Index int
	// Wake tells the manager that the tier has results or requests to
	// service. It never blocks and may be called from any goroutine.
	Wake func()
	// WakeAt asks for a servicing pass no later than t, for the tier's
	// own deadlines: the manager's poll goroutine holds the only timer
	// (issue 13), and every pass asks the tier again (Serve), so a tier
	// asks for its next deadline each time. A tier that the poll goroutine
	// does not service is stepped instead (progress). It never blocks and
	// may be called from any goroutine, holding any lock.
	WakeAt func(t time.Time)
	// Now is the manager's clock (Config.Now): the time a tier's protocol
	// deadlines are measured in and WakeAt is asked in, so that a test
	// moving the manager's time moves the tier's too. Any goroutine may
	// call it.
	Now func() time.Time
	// Progress tells the engine that a lookup answer of this tier may have
	// changed (S2.10), for example when a peer answered; it never blocks.
	Progress func()
	// Emit reports keys the tier stored or removed (S2.8): an Event with
	// Kind EventStored or EventRemoved and Keys; the manager fills in the
	// rest and copies Keys. It never blocks, may be called from any
	// goroutine, also with the tier's own lock held, and keeps nothing
	// while nobody subscribed.
	Emit func(Event)
	// EngineBusy says whether the engine has requests of its own in
	// flight (Manager.EngineBusy): a tier's bulk work can leave the
	// engine a CPU meanwhile and take every CPU while it is idle. Any
	// goroutine may call it; it takes no lock.
	EngineBusy func() bool
	// Arena is the CPU tier's memory, for zero-copy I/O into and out of
	// slots. The tier must not touch slots it holds no job for.
	Arena  *Arena
	Logger *slog.Logger
	// Fingerprint is the node's config fingerprint (S1.1: KV layout, key
	// scheme, seed), for a tier that keeps blocks across restarts.
	Fingerprint string
}

// TierSpec configures one secondary tier of a manager.
type TierSpec struct {
	// Name labels the tier in metrics and events ("disk", "p2p").
	Name     string
	Medium   Medium
	Locality Locality
	// Polled says the tier serves outside requests or completes work on
	// its own goroutines, so the poll goroutine services it (S3.1): its
	// Wake wakes that goroutine, and its work does not keep the engine
	// stepping (S3.4).
	Polled bool
	// HighWater and LowWater override the backpressure marks in seconds
	// per MiB (S2.7); zero takes the default for the tier's locality.
	HighWater, LowWater float64
	// New builds the tier.
	New func(env TierEnv) (Tier, error)
}
