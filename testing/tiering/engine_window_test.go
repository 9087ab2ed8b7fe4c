package tiering

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash/crc32"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/crc32c"
	"github.com/kvtier/kvtier/p2pd/api"
	"github.com/kvtier/kvtier/p2pd/engine"
	"github.com/kvtier/kvtier/testing/fake"
)

// loadLog is the reference executor, recording the size of each load the
// engine starts.
type loadLog struct {
	engine.Executor
	mu    sync.Mutex
	loads []int
}

func (l *loadLog) Load(p []engine.Pair, sums bool) (engine.Copy, error) {
	l.mu.Lock()
	l.loads = append(l.loads, len(p))
	l.mu.Unlock()
	return l.Executor.Load(p, sums)
}

func (l *loadLog) sizes() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.loads)
}

// until polls cond until it holds, failing the test after 10 s.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// windowed is an engine over a manager whose one secondary tier holds
// the 10 blocks of a prompt, with their digest.
type windowed struct {
	h      *harness
	ft     *fake.Tier
	e      *engine.Engine
	x      *loadLog
	keys   []offload.Key
	toks   []uint32
	digest string
}

func newWindowed(t *testing.T, window int) *windowed {
	t.Helper()
	w := &windowed{ft: fake.NewTier(offload.RequestLevel)}
	w.h = newHarness(t, 64, nil, w.ft)
	cfg := w.h.m.Config()
	w.toks = make([]uint32, 10*cfg.Geometry.BlockTokens)
	for i := range w.toks {
		w.toks[i] = uint32(window*1000 + i)
	}
	w.keys = offload.NewChain(cfg.KeyScheme(), cfg.Geometry.BlockTokens, w.toks).Keys
	leaves := sha256.New()
	for _, k := range w.keys {
		b := make([]byte, w.h.m.BlockBytes())
		engine.Fill(b, k)
		w.ft.Put(k, b)
		leaves.Write(binary.BigEndian.AppendUint32(nil, crc32.Checksum(b, crc32c.Table)))
	}
	w.digest = "crc32c:" + hex.EncodeToString(leaves.Sum(nil))
	ref, err := engine.NewReference(w.h.m, 16, "host", nil)
	if err != nil {
		t.Fatal(err)
	}
	w.x = &loadLog{Executor: ref}
	if w.e, err = engine.New(w.h.m, engine.Config{GPUBlocks: 16, Executor: w.x, LoadWindow: window}); err != nil {
		t.Fatal(err)
	}
	go w.e.Run(context.Background())
	t.Cleanup(func() { // before the harness closes the manager
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := w.e.Shutdown(ctx); err != nil {
			t.Error(err)
		}
		w.e.Close()
	})
	return w
}

type answer struct {
	res api.Result
	err error
}

// submit runs the prompt with ctx; its answer comes on the channel.
func (w *windowed) submit(ctx context.Context) <-chan answer {
	return w.submitBlocks(ctx, len(w.keys))
}

// submitBlocks runs the prompt's first n blocks.
func (w *windowed) submitBlocks(ctx context.Context, n int) <-chan answer {
	got := make(chan answer, 1)
	toks := w.toks[:n*w.h.m.Config().Geometry.BlockTokens]
	go func() {
		res, err := w.e.Submit(ctx, engine.Request{ID: "w", Tokens: toks})
		got <- answer{res, err}
	}()
	return got
}

// finding makes the tier answer Retry for the prompt's blocks [from, to)
// (still finding out, as a peer before its answer); found answers from
// what it holds again and wakes the engine, as a peer's answer does.
func (w *windowed) finding(from, to int) {
	for _, k := range w.keys[from:to] {
		w.ft.Answer(k, offload.Retry)
	}
}

func (w *windowed) found(from, to int) {
	w.h.m.Do(func(*offload.Step) { // at once: no engine step sees a part of them
		for _, k := range w.keys[from:to] {
			w.ft.ClearAnswer(k)
		}
	})
	w.ft.Wake()
}

// held says whether the tier holds exactly the promotions of the given
// spans of the prompt, in order.
func (w *windowed) held(spans ...[2]int) bool {
	ids := w.ft.Held()
	if len(ids) != len(spans) {
		return false
	}
	loads := w.ft.Calls().Loads
	for i, id := range ids {
		var keys []offload.Key
		for _, j := range loads {
			if j.ID == id {
				keys = j.Keys
			}
		}
		if !slices.Equal(keys, w.keys[spans[i][0]:spans[i][1]]) {
			return false
		}
	}
	return true
}

// The engine asks a tier that is still finding out (a peer) about a
// window of blocks at a time and loads the prefix part by part
// (engine.Config.LoadWindow): with a window of 4, it asks about blocks
// 0 – 3 alone; once they are answered they are promoted and it asks about
// 4 – 7 while they arrive, and so on, so the promotions overlap; each part
// loads as it lands, while the later ones are still promoted; the answer
// is the whole prefix's, byte for byte.
func TestEngineLoadsInWindows(t *testing.T) {
	w := newWindowed(t, 4)
	w.ft.Hold(true)
	w.finding(0, 10)
	got := w.submit(context.Background())
	until(t, "the first window's lookups", func() bool { return w.ft.Calls().Lookups >= 4 })
	w.h.m.Do(func(*offload.Step) {}) // the engine's step that asked them has ended
	for i, k := range w.keys[4:] {
		if w.ft.LookedUp(k) {
			t.Errorf("block %d, beyond the window, was looked up before the window was answered", 4+i)
		}
	}
	w.found(0, 4)
	until(t, "the first promotion", func() bool { return w.held([2]int{0, 4}) })
	w.found(4, 8)
	until(t, "the second promotion beside the first", func() bool { return w.held([2]int{0, 4}, [2]int{4, 8}) })
	w.found(8, 10)
	until(t, "the third promotion beside them", func() bool { return w.held([2]int{0, 4}, [2]int{4, 8}, [2]int{8, 10}) })
	if loads := w.x.sizes(); len(loads) != 0 {
		t.Errorf("loads %v before any promotion ended", loads)
	}
	for n, id := range w.ft.Held() {
		w.ft.Release(id, true)
		until(t, "the part's load", func() bool { return len(w.x.sizes()) == n+1 })
	}
	a := <-got
	if a.err != nil {
		t.Fatal(a.err)
	}
	if loads := w.x.sizes(); !slices.Equal(loads, []int{4, 4, 2}) {
		t.Errorf("loads of %v blocks, want 4, 4, 2", loads)
	}
	if a.res.Sources.Peer != 10 || a.res.Sources.Computed != 0 {
		t.Errorf("sources %+v, want 10 from the tier", a.res.Sources)
	}
	if a.res.KVDigest != w.digest {
		t.Errorf("digest %s, want %s (the blocks' bytes)", a.res.KVDigest, w.digest)
	}
}

// Without a window the same prefix is asked about at once, promoted as
// one job once all of it is answered, and loaded in one copy.
func TestEngineWithoutWindow(t *testing.T) {
	w := newWindowed(t, 0)
	w.ft.Hold(true)
	w.finding(0, 10)
	got := w.submit(context.Background())
	until(t, "the lookups", func() bool { return w.ft.Calls().Lookups >= 10 })
	w.found(0, 4)
	until(t, "the promotion", func() bool { return len(w.ft.Held()) == 1 })
	if !w.held([2]int{0, 4}) {
		t.Fatalf("held %v, want the answered blocks 0 – 3", w.ft.Held())
	}
	w.found(4, 10)
	until(t, "the second promotion", func() bool { return len(w.ft.Held()) == 2 })
	for _, id := range w.ft.Held() {
		w.ft.Release(id, true)
	}
	a := <-got
	if a.err != nil {
		t.Fatal(a.err)
	}
	if loads := w.x.sizes(); !slices.Equal(loads, []int{10}) || a.res.Sources.Peer != 10 || a.res.KVDigest != w.digest {
		t.Errorf("loads %v, sources %+v, digest %s; want one load of 10 from the tier, digest %s", loads, a.res.Sources, a.res.KVDigest, w.digest)
	}
}

// S2.9: a request that leaves between two parts (its caller stopped
// waiting: the first part loaded, the second still promoted) holds
// nothing once the promotion ends, and loses nothing: the next request
// for the prompt loads all of it, the same bytes.
func TestEngineLeavesBetweenParts(t *testing.T) {
	w := newWindowed(t, 4)
	w.ft.Hold(true)
	w.finding(4, 10)
	ctx, cancel := context.WithCancel(context.Background())
	got := w.submit(ctx)
	until(t, "the first promotion", func() bool { return w.held([2]int{0, 4}) })
	w.ft.Release(w.ft.Held()[0], true)
	until(t, "the first part's load", func() bool { return len(w.x.sizes()) == 1 })
	w.found(4, 8)
	until(t, "the second promotion", func() bool { return w.held([2]int{4, 8}) })
	cancel()
	if a := <-got; a.err == nil {
		t.Fatalf("a cancelled request answered %+v", a.res)
	}
	until(t, "the request's end", func() bool { run, wait := w.e.Counts(); return run == 0 && wait == 0 })
	w.ft.Hold(false)
	w.ft.Release(w.ft.Held()[0], true)
	until(t, "the promotion's end", func() bool {
		mt := w.h.m.Metrics()
		return mt.CPU.Pinned == 0 && mt.CPU.Writing == 0 && mt.Requests == 0
	})
	w.found(8, 10)
	a := <-w.submit(context.Background())
	if a.err != nil {
		t.Fatal(a.err)
	}
	if s := a.res.Sources; s.CPU+s.Peer != 10 || s.Computed != 0 || a.res.KVDigest != w.digest {
		t.Errorf("the prompt again: sources %+v, digest %s; want 10 loaded, digest %s", s, a.res.KVDigest, w.digest)
	}
}

// With a window, blocks already in the CPU tier load while the rest is
// promoted; without one the prefix loads in one copy once all of it is
// ready (the engine's behaviour before windows).
func TestEngineLoadsReadyPartFirst(t *testing.T) {
	for _, tc := range []struct {
		window int
		early  []int // the loads started while the promotion is held
		loads  []int
	}{
		{8, []int{4}, []int{4, 6}},
		{0, nil, []int{10}},
	} {
		w := newWindowed(t, tc.window)
		if a := <-w.submitBlocks(context.Background(), 4); a.err != nil || a.res.Sources.Peer != 4 {
			t.Fatalf("window %d: the first 4 blocks: %+v, %v", tc.window, a.res, a.err)
		}
		w.ft.Hold(true)
		before := len(w.x.sizes())
		got := w.submit(context.Background())
		until(t, "the promotion", func() bool { return len(w.ft.Held()) == 1 })
		if tc.early != nil {
			until(t, "the early load", func() bool { return len(w.x.sizes()) > before })
		}
		if early := w.x.sizes()[before:]; !slices.Equal(early, tc.early) {
			t.Errorf("window %d: loads %v while the rest is promoted, want %v", tc.window, early, tc.early)
		}
		w.ft.Release(w.ft.Held()[0], true)
		a := <-got
		if a.err != nil {
			t.Fatal(a.err)
		}
		if loads := w.x.sizes()[before:]; !slices.Equal(loads, tc.loads) {
			t.Errorf("window %d: loads %v, want %v", tc.window, loads, tc.loads)
		}
		if s := a.res.Sources; s.CPU != 4 || s.Peer != 6 || a.res.KVDigest != w.digest {
			t.Errorf("window %d: sources %+v, digest %s; want 4 from the CPU tier, 6 from the peer, digest %s", tc.window, s, a.res.KVDigest, w.digest)
		}
	}
}

// S5.3: a keep-mode pause freezes the requests, but not the tiers: a
// promotion in flight in a tier that only the engine's steps service (not
// polled) still completes, and the pause returns once it has, instead of
// timing out while the frozen engine never steps. On resume the request
// goes on and loads the promoted blocks. (Found in the review of
// load_window; it held without a window too.)
func TestPauseKeepLetsTiersFinish(t *testing.T) {
	w := newWindowed(t, 0)
	w.ft.Hold(true)
	got := w.submit(context.Background())
	until(t, "the promotion", func() bool { return len(w.ft.Held()) == 1 })
	paused := make(chan error, 1)
	go func() { paused <- w.e.Pause(engine.PauseKeep, false, 10*time.Second) }()
	until(t, "the pause", func() bool { return w.e.State() != engine.Running })
	w.ft.Release(w.ft.Held()[0], true)
	if err := <-paused; err != nil {
		t.Fatalf("keep-mode pause with a promotion that ended: %v", err)
	}
	if err := w.e.Resume(); err != nil {
		t.Fatal(err)
	}
	a := <-got
	if a.err != nil || a.res.Sources.Peer != 10 || a.res.KVDigest != w.digest {
		t.Errorf("after resume: %+v, %v; want 10 blocks from the tier, digest %s", a.res, a.err, w.digest)
	}
}
