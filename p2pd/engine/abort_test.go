package engine

import (
	"context"
	"errors"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
)

// refusingLoads is the reference executor whose loads are refused when
// submitted (cudakv.Mover.Load returns ErrBadPair, a closed mover, a CUDA
// submit error; a real engine's executor may refuse too).
type refusingLoads struct{ Executor }

func (refusingLoads) Load([]Pair, bool) (Copy, error) { return nil, errors.New("load refused") }

// A load the executor refuses at submission fails the request; the engine
// goes on serving. (Found in review: lookup runs inside the step's
// manager lock (Begin … OnScheduleEnd), and start → fail → abort called
// m.Do, which took that lock again: the loop deadlocked for good.) Not
// built with newEngineWith: its cleanup would block on a stuck manager
// lock, so a regression would hang the package instead of failing here
// within 5 s.
func TestRefusedLoadFailsRequest(t *testing.T) {
	m := tinyManager(t, 16)
	ref, err := NewReference(m, 8, "host", nil)
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(m, Config{GPUBlocks: 8, Executor: refusingLoads{ref}})
	if err != nil {
		t.Fatal(err)
	}
	go e.Run(context.Background())
	toks := tokens(6, 16*2)
	if _, err := e.Submit(context.Background(), Request{ID: "a", Tokens: toks}); err != nil {
		t.Fatal(err) // computed and stored: nothing to load
	}
	// A bound on a hang, not a wait for the result.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := e.Submit(ctx, Request{ID: "b", Tokens: toks}); err == nil { // 2 CPU hits: a load
		t.Fatal("a request whose load was refused succeeded")
	}
	if _, err := e.Submit(ctx, Request{ID: "c", Tokens: tokens(7, 16)}); err != nil {
		// The loop and the manager lock are stuck: leak them.
		t.Fatalf("a request after the refused load: %v (the engine loop hangs: the manager lock taken twice)", err)
	}
	if mt := m.Metrics(); mt.CPU.Pinned != 0 || mt.Requests != 0 {
		t.Errorf("after the refused load: %d slots pinned, %d requests tracked", mt.CPU.Pinned, mt.Requests)
	}
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	e.Shutdown(sctx)
	e.Close()
	m.Close()
}

// S5.5: a request that reaches the inbox after the loop's last drain is
// answered ErrShuttingDown, not left waiting. The window is Submit's
// State check (still Running) followed by its send after Run returned;
// the test opens it by setting the state back to Running once Run
// returned. (Submit's wait for the reply had no case for e.done, unlike
// command's.)
func TestSubmitAfterRunReturnedIsRefused(t *testing.T) {
	e, _ := newEngine(t, 16, 8)
	if err := e.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-e.Done()
	// As if Submit read the state before the loop stored ShuttingDown.
	e.state.Store(int32(Running))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // a bound on a hang
	defer cancel()
	// Submit's first select picks the inbox or e.done at random: 20 tries.
	errs := make(chan error, 20)
	for range cap(errs) {
		go func() {
			_, err := e.Submit(ctx, Request{ID: "late", Tokens: tokens(1, 16)})
			errs <- err
		}()
	}
	hung := 0
	for range cap(errs) {
		if err := <-errs; !errors.Is(err, ErrShuttingDown) {
			hung++
			if hung == 1 {
				t.Errorf("a request sent as Run returned: %v, want ErrShuttingDown", err)
			}
		}
	}
	if hung > 0 {
		t.Errorf("%d of %d such requests waited for an answer that never comes", hung, cap(errs))
	}
	e.state.Store(int32(ShuttingDown))
}

// gatedLoads is the reference executor whose loads end only once release
// is closed, then with fail's error (nil: the copy's own).
type gatedLoads struct {
	Executor
	started, release chan struct{}
	fail             error
}

type gatedCopy struct {
	Copy
	g *gatedLoads
}

func (c gatedCopy) Done() (bool, error) {
	select {
	case <-c.g.release:
	default:
		return false, nil
	}
	if c.g.fail != nil {
		return true, c.g.fail
	}
	return c.Copy.Done()
}

func (c gatedCopy) Wait() error {
	<-c.g.release
	if err := c.Copy.Wait(); err != nil {
		return err
	}
	return c.g.fail
}

func (g *gatedLoads) Load(p []Pair, sums bool) (Copy, error) {
	t, err := g.Executor.Load(p, sums)
	if err != nil {
		return nil, err
	}
	close(g.started)
	return gatedCopy{t, g}, nil
}

func newGated(t *testing.T, fail error) (*Engine, *offload.Manager, *gatedLoads) {
	g := &gatedLoads{started: make(chan struct{}), release: make(chan struct{}), fail: fail}
	e, m := newEngineWith(t, 16, 8, func(m *offload.Manager) Executor {
		x, err := NewReference(m, 8, "host", nil)
		if err != nil {
			t.Fatal(err)
		}
		g.Executor = x
		return g
	})
	return e, m, g
}

func checkClean(t *testing.T, e *Engine, m *offload.Manager, when string) {
	t.Helper()
	if mt := m.Metrics(); mt.CPU.Pinned != 0 || mt.Requests != 0 || mt.CPU.Writing != 0 {
		t.Errorf("%s: %d slots pinned, %d writing, %d requests tracked", when, mt.CPU.Pinned, mt.CPU.Writing, mt.Requests)
	}
	if run, wait := e.Counts(); run != 0 || wait != 0 {
		t.Errorf("%s: %d jobs active, %d waiting", when, run, wait)
	}
}

// checkFreed shuts e down and checks that every GPU block went back to the
// free list (read once Run returned: the loop owns it).
func checkFreed(t *testing.T, e *Engine) {
	t.Helper()
	if err := e.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-e.Done()
	if len(e.free) != e.total || len(e.active) != 0 {
		t.Errorf("after Run returned: %d of %d GPU blocks free, %d jobs active", len(e.free), e.total, len(e.active))
	}
}

// S2.9, S5.3: a request aborted while its load is in flight is released
// once the copy ended, whether it failed or not: no pin, no request state,
// every GPU block free, and the blocks it loaded stay loadable.
func TestAbortedLoadLeavesNothing(t *testing.T) {
	for _, fail := range []error{nil, errors.New("the load failed")} {
		e, m, g := newGated(t, fail)
		toks := tokens(8, 16*2)
		if _, err := e.Submit(context.Background(), Request{ID: "a", Tokens: toks}); err != nil {
			t.Fatal(err)
		}
		loaded := make(chan error, 1)
		go func() {
			_, err := e.Submit(context.Background(), Request{ID: "b", Tokens: toks})
			loaded <- err
		}()
		<-g.started
		paused := make(chan error, 1)
		go func() { paused <- e.Pause(PauseAbort, false, 10*time.Second) }()
		if err := <-loaded; !errors.Is(err, ErrAborted) {
			t.Fatalf("the aborted load's request: %v", err)
		}
		close(g.release)
		if err := <-paused; err != nil {
			t.Fatal(err)
		}
		checkClean(t, e, m, "after the aborted load")
		if err := e.Resume(); err != nil {
			t.Fatal(err)
		}
		g.started = make(chan struct{}) // closed again by the next load; release stays closed
		r, err := e.Submit(context.Background(), Request{ID: "c", Tokens: toks})
		if fail == nil && (err != nil || r.Sources.CPU != 2) {
			t.Errorf("the prefix after the aborted load: %+v, %v", r, err)
		}
		checkFreed(t, e)
	}
}

// A load copy that fails (not aborted) fails its request and frees
// everything; the engine goes on.
func TestFailedLoadFailsCleanly(t *testing.T) {
	e, m, g := newGated(t, errors.New("the load failed"))
	toks := tokens(9, 16*2)
	if _, err := e.Submit(context.Background(), Request{ID: "a", Tokens: toks}); err != nil {
		t.Fatal(err)
	}
	close(g.release)
	if _, err := e.Submit(context.Background(), Request{ID: "b", Tokens: toks}); err == nil {
		t.Fatal("a request whose load failed succeeded")
	}
	if err := e.Pause(PauseWait, false, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	checkClean(t, e, m, "after the failed load")
	e.Resume()
	checkFreed(t, e)
}

// pausedVisits is the reference executor whose first Visit waits for
// release, and which records a Compute into a block a Visit still reads.
type pausedVisits struct {
	Executor
	started, release chan struct{}
	once             atomic.Bool
	reading          atomic.Int32 // the block the gated Visit reads, -1 none
	clash            atomic.Bool
}

func (g *pausedVisits) Visit(gpu int32, fn func([]byte)) error {
	if g.once.CompareAndSwap(false, true) {
		g.reading.Store(gpu)
		close(g.started)
		<-g.release
		defer g.reading.Store(-1)
	}
	return g.Executor.Visit(gpu, fn)
}

func (g *pausedVisits) Compute(gpu int32, k offload.Key) error {
	if g.reading.Load() == gpu {
		g.clash.Store(true)
	}
	return g.Executor.Compute(gpu, k)
}

// S5.3: pause(abort) while a digest reads a finished request's GPU blocks
// returns only once it ended, the request gets its digest, and no later
// request computes into a block the digest reads.
func TestPauseAbortWaitsForDigest(t *testing.T) {
	g := &pausedVisits{started: make(chan struct{}), release: make(chan struct{})}
	g.reading.Store(-1)
	e, m := newEngineWith(t, 32, 8, func(m *offload.Manager) Executor {
		x, err := NewReference(m, 8, "host", nil)
		if err != nil {
			t.Fatal(err)
		}
		g.Executor = x
		return g
	})
	answered := make(chan error, 1)
	go func() {
		r, err := e.Submit(context.Background(), Request{ID: "a", Tokens: tokens(10, 16*4), Digest: DigestSHA256}) // reads every block
		if err == nil && len(r.KVDigest) != 64 {
			err = errors.New("no digest")
		}
		answered <- err
	}()
	<-g.started
	// Another request fits in the blocks the digest does not hold.
	if _, err := e.Submit(context.Background(), Request{ID: "b", Tokens: tokens(11, 16*4), Digest: DigestNone}); err != nil {
		t.Fatal(err)
	}
	paused := make(chan error, 1)
	go func() { paused <- e.Pause(PauseAbort, false, 10*time.Second) }()
	for e.State() != Pausing {
		runtime.Gosched()
	}
	select {
	case err := <-paused:
		t.Fatalf("pause returned while a digest read GPU blocks: %v", err)
	default:
	}
	close(g.release)
	if err := <-answered; err != nil {
		t.Errorf("the digesting request: %v", err)
	}
	if err := <-paused; err != nil {
		t.Fatal(err)
	}
	checkClean(t, e, m, "after the pause")
	if g.clash.Load() {
		t.Error("a request computed into a GPU block a digest was reading")
	}
	e.Resume()
	checkFreed(t, e)
}

// waitFor polls cond until it holds, failing the test after 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after 5 s: %s", what)
		}
		runtime.Gosched()
	}
}

// S8.5: a request whose caller stopped waiting (Submit's ctx ended: the
// admin client disconnected) leaves the engine. Queued while paused, it
// leaves the queue at once (it stayed there until resume, then ran for
// no one: a client retrying against a paused node grew the queue without
// bound); running, it is aborted once its copy ends, and stores nothing.
func TestCancelledRequestLeaves(t *testing.T) {
	e, m, g := newGated(t, nil)
	toks := tokens(12, 16*2)
	if _, err := e.Submit(context.Background(), Request{ID: "a", Tokens: toks}); err != nil {
		t.Fatal(err)
	}
	if err := e.Pause(PauseWait, false, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	queued := make(chan error, 1)
	go func() {
		_, err := e.Submit(ctx, Request{ID: "queued", Tokens: toks})
		queued <- err
	}()
	waitFor(t, "the request was not queued", func() bool { _, w := e.Counts(); return w == 1 })
	cancel()
	if err := <-queued; !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled queued request: %v", err)
	}
	waitFor(t, "a cancelled request stays queued", func() bool { _, w := e.Counts(); return w == 0 })
	if err := e.Resume(); err != nil {
		t.Fatal(err)
	}

	// Running: its load is held; two blocks hit, two would be computed.
	ctx, cancel = context.WithCancel(context.Background())
	running := make(chan error, 1)
	go func() {
		_, err := e.Submit(ctx, Request{ID: "running", Tokens: append(slices.Clone(toks), tokens(13, 16*2)...)})
		running <- err
	}()
	<-g.started
	cancel()
	if err := <-running; !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled running request: %v", err)
	}
	waitFor(t, "the cancelled request was not aborted", func() bool { return m.Metrics().Requests == 0 })
	close(g.release)
	if err := e.Pause(PauseWait, false, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if used := m.Metrics().CPU.Used; used != 2 {
		t.Errorf("%d CPU blocks used, want the first request's 2: the cancelled one computed and stored its own", used)
	}
	checkClean(t, e, m, "after the cancelled requests")
	e.Resume()
	checkFreed(t, e)
}

// A prompt is sized and keyed by Submit, not by the engine loop: one
// larger than the GPU cache is refused before it is hashed, without the
// loop, and the loop receives a job with its keys. (Found in review: the
// loop hashed every prompt it received, so a 30-byte {"seed": 1,
// "tokens": 4194304} held it for 0.12 s, pauses and every other request
// behind it, before refusing it as too large.) The engine here has no
// loop running: the loop's work would wait for ever.
func TestPromptKeyedOffTheLoop(t *testing.T) {
	m := tinyManager(t, 16)
	defer m.Close()
	e, err := New(m, Config{GPUBlocks: 8, Backend: "host"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // a bound on a hang
	defer cancel()
	if _, err := e.Submit(ctx, Request{ID: "huge", Tokens: make([]uint32, 1<<22)}); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a prompt of 262,144 blocks against 8: %v, want ErrTooLarge from Submit", err)
	}
	sent := make(chan error, 1)
	go func() {
		_, err := e.Submit(ctx, Request{ID: "a", Tokens: tokens(14, 16*3)})
		sent <- err
	}()
	j := (<-e.inbox).(*job)
	if len(j.keys) != 3 || j.chain == nil {
		t.Errorf("the loop received a job with %d keys, want its 3 computed", len(j.keys))
	}
	cancel()
	<-sent
}

// closedNames is the reference executor that records a Backend call
// after its Close (the CUDA backend's name lived in the context Close
// frees).
type closedNames struct {
	Executor
	closed, askedAfter atomic.Bool
}

func (c *closedNames) Backend() string {
	if c.closed.Load() {
		c.askedAfter.Store(true)
	}
	return c.Executor.Backend()
}

func (c *closedNames) Close() error { c.closed.Store(true); return c.Executor.Close() }

// Engine.Backend answers after Close without asking the closed executor:
// GET /v0/status answers until the node's end, and Node.Shutdown closes
// the engine before the admin API (found in review: with the CUDA
// backend that read the name from a freed context).
func TestBackendAfterClose(t *testing.T) {
	c := &closedNames{}
	e, _ := newEngineWith(t, 16, 8, func(m *offload.Manager) Executor {
		x, err := NewReference(m, 8, "host", nil)
		if err != nil {
			t.Fatal(err)
		}
		c.Executor = x
		return c
	})
	if err := e.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	e.Close()
	if got := e.Backend(); got != "host" || c.askedAfter.Load() {
		t.Errorf("Backend after Close: %q, asked the closed executor: %v", got, c.askedAfter.Load())
	}
}

// S5.1: a pause with clear_cache either pauses with the cache cleared or
// leaves the node running; when the reset fails the answer says why, as
// a conflict (here the manager is closed: ErrShuttingDown; a reset already
// running gives ErrBadState), and the engine runs. It used to report a
// bare error (a 500) while the node stayed paused, the cache not cleared.
func TestPauseClearFailureKeepsRunning(t *testing.T) {
	e, m := newEngine(t, 8, 8)
	m.Close()
	err := e.Pause(PauseWait, true, time.Second)
	if !errors.Is(err, ErrShuttingDown) || !errors.Is(err, offload.ErrClosed) {
		t.Errorf("pause with clear_cache on a closed manager: %v, want ErrShuttingDown wrapping offload.ErrClosed", err)
	}
	if s := e.State(); s != Running {
		t.Errorf("state %v after the failed clear, want running", s)
	}
}
