// Package engine is p2pd's reference engine core: a scheduler loop in one
// goroutine that runs requests through the tiering manager (one scheduling
// step a loop turn; a copy's end is reported through Do, a step too), and
// an Executor, the part a real engine replaces: the
// reference one "computes" KV blocks deterministically from their keys in
// a GPU cache (cudakv device memory when a GPU is present, host memory
// otherwise) and copies them between that cache and the CPU tier with
// cudakv. It keeps no GPU prefix cache beyond a request's life, so every
// request goes through the offload tiers.
//
// The loop steps only while it has schedulable requests, copies to finish
// or the manager reports pending work; otherwise it blocks on a wake
// channel fed by new requests, admin commands, finished copies and the
// manager's progress notification (SEMANTICS.md S5.2): an idle engine makes
// no wakeups.
package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
)

// Errors a request or a command can end with.
var (
	ErrShuttingDown = errors.New("engine: shutting down")
	ErrAborted      = errors.New("engine: request aborted")
	ErrTooLarge     = errors.New("engine: request needs more GPU blocks than the cache has")
	ErrPauseTimeout = errors.New("engine: pause timed out")
	ErrBadState     = errors.New("engine: not possible in this state")
)

// State is the engine's state.
type State int32

// States.
const (
	Running State = iota
	Pausing
	Paused
	ShuttingDown
)

func (s State) String() string {
	return [...]string{"running", "pausing", "paused", "shutting_down"}[s]
}

// Request is a prompt to prefill.
type Request struct {
	ID             string
	Tokens         []uint32
	TransferParams map[string]any
	// Digest says how the answer's kv_digest is computed (DigestCRC32C
	// when empty); see the Digest constants.
	Digest string
	// FetchOnly loads the prefix the tiers hold and computes nothing
	// (api.Request.FetchOnly): the rest is missed, not stored, and the
	// digest covers the loaded blocks.
	FetchOnly bool
}

// kv_digest kinds. The digest is computed after the prefill (elapsed_ms
// does not include it) and off the engine loop, which goes on scheduling.
const (
	// DigestCRC32C (the default): "crc32c:" and the SHA-256 of the
	// blocks' CRC32Cs in order. The copies compute them as they move the
	// bytes (a load's and a store's checksums), so the digest reads again
	// only the blocks no copy of the request moved. Any accidental
	// difference between two nodes' KV shows but for a 2^-32 chance per
	// block; not proof against a forger.
	DigestCRC32C = "crc32c"
	// DigestSHA256: the SHA-256 of the blocks' SHA-256s in order (a hash
	// tree two levels deep): collision-resistant, but every block is read
	// again and hashed, about 1.4 GB/s a core with SHA-NI, on every core
	// but one at once.
	DigestSHA256 = "sha256"
	// DigestNone: no digest.
	DigestNone = "none"
)

// ErrBadDigest is an unknown Request.Digest.
var ErrBadDigest = errors.New("engine: kv_digest: want sha256, crc32c or none")

// Config configures an Engine.
type Config struct {
	// GPUBlocks is the size of the GPU KV cache in blocks.
	GPUBlocks int
	// Backend is cudakv's backend for the reference executor: auto, cuda
	// or host.
	Backend string
	// Executor replaces the reference executor (a real engine's GPU
	// side); its GPU cache must have GPUBlocks blocks.
	Executor Executor
	// LoadWindow bounds how many blocks of a prompt's prefix the engine
	// has the tiers find out about at once (Retry: a peer's lookup round);
	// it asks about the next ones as soon as those are answered, while
	// they are fetched, and the blocks that are ready load meanwhile, one
	// part at a time. So a long prefix from a peer arrives in rounds
	// fetched without a gap and loads part by part as they land. 0: no
	// window (the whole prefix is looked up at once and loaded in one copy
	// once all of it is ready).
	LoadWindow int
	Logger     *slog.Logger
}

// PauseMode says what a pause does with requests (S5.3).
type PauseMode string

// Pause modes.
const (
	PauseWait  PauseMode = "wait"  // let running requests finish
	PauseAbort PauseMode = "abort" // abort running and waiting requests first
	PauseKeep  PauseMode = "keep"  // freeze them for resume
)

// Engine is the scheduler loop and its executor.
type Engine struct {
	m      *offload.Manager
	x      Executor
	xname  string // x.Backend() at New: Backend is read after Close (status during shutdown)
	log    *slog.Logger
	geo    offload.Geometry
	keys   offload.KeyScheme
	total  int
	window int // Config.LoadWindow

	inbox   chan any      // *job, *pauseCmd, resumeCmd, *shutdownCmd, cancelCmd
	wake    chan struct{} // copies finished
	done    chan struct{} // the loop returned
	wg      sync.WaitGroup
	hashing chan struct{} // a token per block being hashed for a kv_digest (digest.go)

	state           atomic.Int32
	sumsWarned      atomic.Bool // a copy's checksums did not match its blocks (logged once)
	running, queued atomic.Int32

	// loop-owned
	stopped         <-chan struct{} // Run's ctx: when it ends, the engine shuts down at once
	waiting, active []*job
	free            []int32
	pause           *pauseCmd
	shutdown        *shutdownCmd
	stopAdmit       bool
}

// job is a request inside the loop.
type job struct {
	r       Request
	reply   chan jobReply
	keys    []offload.Key
	chain   *offload.Chain // the prompt's blocks (keys is chain.Keys), for stored events
	req     *offload.Request
	gpu     []int32
	start   time.Time
	phase   int
	hits    int // keys[:hits] are loaded or loading
	part    int // keys[part:hits] is the load in flight (copying)
	src     api.Sources
	plan    *offload.StorePlan
	copy    Copy
	copying bool
	digest  chan struct{} // closed when its digest goroutine no longer reads its GPU blocks
	sums    chan struct{} // a store's: closed once its blocks' checksums are recorded
	// crcs holds, for a crc32c kv_digest, the CRC32C of each of keys'
	// GPU blocks that a copy computed as it went (the load's, the
	// store's); crcKnown says which, the rest are read again.
	crcs     []uint32
	crcKnown []bool
	stored   []int // a store's pairs' indexes in keys
}

type jobReply struct {
	res api.Result
	err error
}

const (
	phaseLookup  = iota // finding the prefix, loading what is ready part by part
	phaseLoading        // the prefix is known: its last part loads
	phaseStoring
)

type pauseCmd struct {
	mode     PauseMode
	clear    bool
	deadline time.Time
	reply    chan error
}

type resumeCmd struct{ reply chan error }

// cancelCmd withdraws a job whose caller stopped waiting (Submit's ctx
// ended): it leaves the queue, or is aborted if it runs.
type cancelCmd struct {
	j   *job
	err error
}

type shutdownCmd struct {
	deadline time.Time
	reply    chan error
}

// New returns an engine over m with a GPU cache of cfg.GPUBlocks blocks;
// Run starts it.
func New(m *offload.Manager, cfg Config) (*Engine, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.GPUBlocks <= 0 {
		return nil, fmt.Errorf("engine: gpu_blocks %d must be positive", cfg.GPUBlocks)
	}
	if cfg.LoadWindow < 0 {
		return nil, fmt.Errorf("engine: load_window %d is negative", cfg.LoadWindow)
	}
	mc := m.Config()
	x := cfg.Executor
	if x == nil {
		var err error
		if x, err = NewReference(m, cfg.GPUBlocks, cfg.Backend, log); err != nil {
			return nil, err
		}
	}
	e := &Engine{m: m, x: x, log: log, geo: mc.Geometry, keys: mc.KeyScheme(), total: cfg.GPUBlocks, window: cfg.LoadWindow,
		inbox: make(chan any, 64), wake: make(chan struct{}, 1), done: make(chan struct{}),
		hashing: make(chan struct{}, digestWorkers())}
	for b := cfg.GPUBlocks - 1; b >= 0; b-- {
		e.free = append(e.free, int32(b))
	}
	e.xname = x.Backend()
	log.Info("engine: executor ready", "copies", e.xname, "gpu_blocks", cfg.GPUBlocks)
	return e, nil
}

// Backend names the copy backend ("host" or "cuda: <device>"); it does
// not ask the executor, which may be closed (GET /v0/status answers until
// the node's end, after Close).
func (e *Engine) Backend() string { return e.xname }

// State returns the engine's state.
func (e *Engine) State() State { return State(e.state.Load()) }

// Counts returns the running and waiting requests.
func (e *Engine) Counts() (running, waiting int) {
	return int(e.running.Load()), int(e.queued.Load())
}

// Submit runs a request and waits for its prefill, or ctx.
func (e *Engine) Submit(ctx context.Context, r Request) (api.Result, error) {
	if e.State() == ShuttingDown {
		return api.Result{}, ErrShuttingDown
	}
	switch r.Digest {
	case "":
		r.Digest = DigestCRC32C
	case DigestSHA256, DigestCRC32C, DigestNone:
	default:
		return api.Result{}, fmt.Errorf("%w, not %q", ErrBadDigest, r.Digest)
	}
	// Sized and hashed here, not in the loop: a 30-byte {"seed": 1,
	// "tokens": 4194304} would hold the loop while it hashed the keys of
	// four million tokens, only to refuse it as too large.
	if n := len(r.Tokens) / e.geo.BlockTokens; n > e.total {
		return api.Result{}, fmt.Errorf("%w: %d blocks, the cache has %d", ErrTooLarge, n, e.total)
	}
	reply := make(chan jobReply, 1)
	j := &job{r: r, reply: reply}
	j.chain = offload.NewChain(e.keys, e.geo.BlockTokens, r.Tokens)
	j.keys = j.chain.Keys
	select {
	case e.inbox <- j:
	case <-e.done:
		return api.Result{}, ErrShuttingDown
	case <-ctx.Done():
		return api.Result{}, ctx.Err()
	}
	select {
	case rep := <-reply:
		return rep.res, rep.err
	case <-e.done: // sent after the loop's last drain: nothing will answer
		select {
		case rep := <-reply:
			return rep.res, rep.err
		default:
			return api.Result{}, ErrShuttingDown
		}
	case <-ctx.Done():
		// Nobody will read the answer: the request leaves the queue, or is
		// aborted, instead of running for no one (a client retrying against
		// a paused node would grow the queue, S8.5).
		select {
		case e.inbox <- cancelCmd{j: j, err: context.Cause(ctx)}:
		case <-e.done:
		}
		return api.Result{}, ctx.Err()
	}
}

// Pause stops scheduling (S5.3) and returns once the engine is quiet, or
// with ErrPauseTimeout (the engine then goes back to running).
func (e *Engine) Pause(mode PauseMode, clearCache bool, timeout time.Duration) error {
	c := &pauseCmd{mode: mode, clear: clearCache, deadline: time.Now().Add(timeout), reply: make(chan error, 1)}
	return e.command(c, c.reply)
}

// Resume restarts scheduling (S5.4).
func (e *Engine) Resume() error {
	c := resumeCmd{reply: make(chan error, 1)}
	return e.command(c, c.reply)
}

// Shutdown stops admitting, lets running requests finish until ctx ends
// (its deadline, or its cancellation), aborts what is left, and returns
// once Run returned (S5.5), in the style of net/http.Server.Shutdown. A
// ctx that never ends lets every running request finish.
func (e *Engine) Shutdown(ctx context.Context) error {
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(100 * 365 * 24 * time.Hour)
	}
	c := &shutdownCmd{deadline: deadline, reply: make(chan error, 1)}
	select {
	case e.inbox <- c:
	case <-e.done:
		return nil
	}
	cancelled := ctx.Done()
	for {
		select {
		case err := <-c.reply:
			<-e.done
			return err
		case <-e.done:
			return nil
		case <-cancelled: // cancelled before its deadline: abort now
			cancelled = nil
			now := &shutdownCmd{deadline: time.Now(), reply: make(chan error, 1)}
			select {
			case e.inbox <- now:
			case <-e.done:
			}
		}
	}
}

func (e *Engine) command(c any, reply chan error) error {
	select {
	case e.inbox <- c:
	case <-e.done:
		return ErrShuttingDown
	}
	select {
	case err := <-reply:
		return err
	case <-e.done:
		select {
		case err := <-reply:
			return err
		default:
			return ErrShuttingDown
		}
	}
}

// Close releases the executor; call it after Run returned.
func (e *Engine) Close() error {
	e.wg.Wait()
	return e.x.Close()
}

// Done is closed when Run returned.
func (e *Engine) Done() <-chan struct{} { return e.done }
