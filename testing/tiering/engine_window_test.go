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

// The engine loads a prefix from a secondary tier part by part while the
// next part is promoted (engine.Config.LoadWindow): with a window of 4
// blocks, the 10 blocks the tier holds are promoted in jobs of 4, 4 and 2
// keys, each part loads while the next job is still held, and the answer
// is that of the whole prefix, byte for byte. Without the window the
// whole prefix is one job and one load.
func TestEngineLoadsInWindows(t *testing.T) {
	for _, tc := range []struct {
		window int
		jobs   [][2]int // each promotion's keys: [from, to)
	}{
		{4, [][2]int{{0, 4}, {4, 8}, {8, 10}}},
		{0, [][2]int{{0, 10}}},
	} {
		w := newWindowed(t, tc.window)
		w.ft.Hold(true)
		got := w.submit(context.Background())
		for n, span := range tc.jobs {
			until(t, "a promotion", func() bool { return len(w.ft.Held()) == 1 })
			job := w.ft.Calls().Loads[n]
			if want := w.keys[span[0]:span[1]]; !slices.Equal(job.Keys, want) {
				t.Errorf("window %d: promotion %d has %d keys, want keys [%d, %d)", tc.window, n, len(job.Keys), span[0], span[1])
			}
			// Every earlier part is loading or loaded while this one is promoted.
			if loads := w.x.sizes(); len(loads) != n {
				t.Errorf("window %d: %d loads started while promotion %d is held, want %d", tc.window, len(loads), n, n)
			}
			w.ft.Release(job.ID, true)
			until(t, "the part's load", func() bool { return len(w.x.sizes()) == n+1 })
		}
		a := <-got
		if a.err != nil {
			t.Fatal(a.err)
		}
		var want []int
		for _, span := range tc.jobs {
			want = append(want, span[1]-span[0])
		}
		if loads := w.x.sizes(); !slices.Equal(loads, want) {
			t.Errorf("window %d: loads of %v blocks, want %v", tc.window, loads, want)
		}
		if a.res.Sources.Peer != 10 || a.res.Sources.Computed != 0 {
			t.Errorf("window %d: sources %+v, want 10 from the tier", tc.window, a.res.Sources)
		}
		if a.res.KVDigest != w.digest {
			t.Errorf("window %d: digest %s, want %s (the blocks' bytes)", tc.window, a.res.KVDigest, w.digest)
		}
	}
}

// S2.9: a request that leaves between two parts (its caller stopped
// waiting: the first part loaded, the second still promoted) holds
// nothing once the promotion ends, and loses nothing: the next request
// for the prompt loads all of it, the same bytes.
func TestEngineLeavesBetweenParts(t *testing.T) {
	w := newWindowed(t, 4)
	w.ft.Hold(true)
	ctx, cancel := context.WithCancel(context.Background())
	got := w.submit(ctx)
	until(t, "the first promotion", func() bool { return len(w.ft.Held()) == 1 })
	w.ft.Release(w.ft.Held()[0], true)
	until(t, "the second promotion", func() bool { return len(w.ft.Calls().Loads) == 2 && len(w.ft.Held()) == 1 })
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
