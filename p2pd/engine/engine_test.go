package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"hash/crc32"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/crc32c"
	"github.com/kvtier/kvtier/p2pd/api"
)

func newEngine(t *testing.T, slots, gpu int) (*Engine, *offload.Manager) {
	t.Helper()
	return newEngineWith(t, slots, gpu, nil)
}

// newEngineWith is newEngine with an executor made by x (nil: the
// reference).
func newEngineWith(t *testing.T, slots, gpu int, x func(*offload.Manager) Executor) (*Engine, *offload.Manager) {
	t.Helper()
	return newEngineLogged(t, slots, gpu, x, nil)
}

// newEngineLogged is newEngineWith logging to log (nil: nowhere).
func newEngineLogged(t *testing.T, slots, gpu int, x func(*offload.Manager) Executor, log *slog.Logger) (*Engine, *offload.Manager) {
	t.Helper()
	m := tinyManager(t, slots)
	c := Config{GPUBlocks: gpu, Backend: "host", Logger: log}
	if x != nil {
		c.Executor = x(m)
	}
	e, err := New(m, c)
	if err != nil {
		t.Fatal(err)
	}
	go e.Run(context.Background())
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		e.Shutdown(ctx)
		e.Close()
		m.Close()
	})
	return e, m
}

// tinyManager is a manager of slots tiny-geometry CPU slots and no other
// tier; the caller closes it.
func tinyManager(t *testing.T, slots int) *offload.Manager {
	t.Helper()
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(slots * cfg.Geometry.BlockBytes())
	m, err := offload.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func tokens(seed, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(seed*7919 + i)
	}
	return out
}

// A prompt computed once is loaded back from the CPU tier the second time,
// with the same digest; sources add up to the blocks.
func TestPrefillTwice(t *testing.T) {
	e, _ := newEngine(t, 64, 32)
	ctx := context.Background()
	r1, err := e.Submit(ctx, Request{ID: "a", Tokens: tokens(1, 16*8+5)})
	if err != nil {
		t.Fatal(err)
	}
	if r1.Blocks != 8 || r1.Sources.Computed != 8 {
		t.Fatalf("first run %+v, want 8 blocks computed", r1)
	}
	r2, err := e.Submit(ctx, Request{ID: "b", Tokens: tokens(1, 16*8)})
	if err != nil {
		t.Fatal(err)
	}
	if r2.Sources.CPU != 8 || r2.Sources.Computed != 0 || r2.KVDigest != r1.KVDigest {
		t.Errorf("second run %+v, want 8 CPU hits and digest %s", r2, r1.KVDigest)
	}
	if _, err := e.Submit(ctx, Request{ID: "big", Tokens: tokens(2, 16*40)}); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a request larger than the cache: %v", err)
	}
}

// S5.3, S5.4: pause wait on an idle engine returns at once; a paused
// engine queues new requests until resume; pause twice is refused.
func TestPauseResume(t *testing.T) {
	e, _ := newEngine(t, 64, 32)
	if err := e.Pause(PauseWait, false, time.Second); err != nil {
		t.Fatal(err)
	}
	if e.State() != Paused {
		t.Fatalf("state %v", e.State())
	}
	if err := e.Pause(PauseWait, false, time.Second); !errors.Is(err, ErrBadState) {
		t.Errorf("second pause: %v", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := e.Submit(context.Background(), Request{ID: "q", Tokens: tokens(3, 32)})
		done <- err
	}()
	deadline := time.Now().Add(5 * time.Second)
	for _, w := e.Counts(); w != 1; _, w = e.Counts() {
		if time.Now().After(deadline) {
			t.Fatal("the request was not queued")
		}
		time.Sleep(time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("a request ran while paused: %v", err)
	default:
	}
	if err := e.Resume(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Errorf("queued request after resume: %v", err)
	}
}

// S5.3: pause with clear_cache empties the CPU tier after quiescing.
func TestPauseClearCache(t *testing.T) {
	e, m := newEngine(t, 64, 32)
	if _, err := e.Submit(context.Background(), Request{ID: "a", Tokens: tokens(4, 64)}); err != nil {
		t.Fatal(err)
	}
	if err := e.Pause(PauseWait, true, time.Second); err != nil {
		t.Fatal(err)
	}
	if used := m.Metrics().CPU.Used; used != 0 {
		t.Errorf("CPU tier holds %d blocks after pause with clear_cache", used)
	}
}

// S7.2: every block the engine stores enters the CPU tier with its CRC32C
// kept with the slot, computed by the copy.
func TestStoredBlocksKeepChecksums(t *testing.T) {
	e, m := newEngine(t, 64, 32)
	toks := tokens(3, 16*6)
	if _, err := e.Submit(context.Background(), Request{ID: "a", Tokens: toks}); err != nil {
		t.Fatal(err)
	}
	keys := offload.BlockKeys(m.Config().HashSeed, m.Config().Geometry.BlockTokens, toks)
	req := &offload.Request{ID: "check"}
	m.Do(func(s *offload.Step) {
		s.OnNewRequest(req)
		slots, err := s.PrepareLoad(keys, req)
		if err != nil {
			t.Fatal(err)
		}
		for i, slot := range slots {
			crc, ok := m.Arena().Sum(int(slot))
			if want := crc32.Checksum(m.Arena().Slot(int(slot)), crc32c.Table); !ok || crc != want {
				t.Errorf("block %d: kept checksum %08x (%v), want %08x", i, crc, ok, want)
			}
		}
		s.CompleteLoad(keys, req)
		s.OnRequestFinished(req)
	})
}

// Issue 12: kv_digest is crc32c by default (off the copies' checksums),
// SHA-256 over the KV on request, or skipped (none); equal prompts give
// equal digests of a kind, different prompts different ones; an unknown
// kind is refused.
func TestDigestKinds(t *testing.T) {
	e, _ := newEngine(t, 64, 32)
	ctx := context.Background()
	run := func(id string, seed int, kind string) api.Result {
		t.Helper()
		r, err := e.Submit(ctx, Request{ID: id, Tokens: tokens(seed, 16*4), Digest: kind})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	sha, again := run("a", 1, DigestSHA256), run("b", 1, DigestSHA256)
	if len(sha.KVDigest) != 64 || again.KVDigest != sha.KVDigest {
		t.Errorf("sha256 digests %q, %q (same prompt); want 64 hex digits of SHA-256, equal", sha.KVDigest, again.KVDigest)
	}
	c1, c2, other := run("c", 1, ""), run("d", 1, DigestCRC32C), run("e", 2, DigestCRC32C)
	if !strings.HasPrefix(c1.KVDigest, "crc32c:") || c1.KVDigest != c2.KVDigest || c1.KVDigest == other.KVDigest {
		t.Errorf("crc32c digests %q (the default), %q (same prompt), %q (another)", c1.KVDigest, c2.KVDigest, other.KVDigest)
	}
	if none := run("f", 1, DigestNone); none.KVDigest != "" {
		t.Errorf("digest none gave %q", none.KVDigest)
	}
	if _, err := e.Submit(ctx, Request{ID: "g", Tokens: tokens(1, 16), Digest: "md5"}); !errors.Is(err, ErrBadDigest) {
		t.Errorf("digest md5: %v, want ErrBadDigest", err)
	}
}

// S7.2: a store counts as done only once its blocks' checksums are
// recorded, so a block never becomes ready without its checksum kept.
func TestStoreDoneWaitsForChecksums(t *testing.T) {
	e, _ := newEngine(t, 8, 8)
	tk, err := e.x.Store([]Pair{{GPU: 0, CPU: 0}})
	if err != nil {
		t.Fatal(err)
	}
	if err := tk.Wait(); err != nil {
		t.Fatal(err)
	}
	j := &job{copy: tk, sums: make(chan struct{})}
	if done, _ := j.copyDone(); done {
		t.Fatal("a store counted as done before its checksums were recorded")
	}
	close(j.sums)
	if done, err := j.copyDone(); !done || err != nil {
		t.Fatalf("copyDone after the checksums: %v, %v", done, err)
	}
}

// Issue 12: the digests read the cache in place and hash blocks in
// parallel; they still are what the kinds define, whatever the number of
// blocks hashed at once: the SHA-256 of the blocks' SHA-256s in order, or
// of their CRC32Cs (big-endian), as ReadBlock sees the blocks.
func TestDigestDefinition(t *testing.T) {
	e, _ := newEngine(t, 64, 32)
	if _, err := e.Submit(context.Background(), Request{ID: "a", Tokens: tokens(3, 16*4)}); err != nil {
		t.Fatal(err)
	}
	gpu := []int32{0, 1, 2, 3, 2}
	sha, crcs := sha256.New(), sha256.New()
	buf := make([]byte, e.geo.BlockBytes())
	for _, b := range gpu {
		if err := e.x.(*reference).mv.ReadBlock(int(b), buf); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(buf)
		sha.Write(sum[:])
		crcs.Write(binary.BigEndian.AppendUint32(nil, crc32.Checksum(buf, crc32c.Table)))
	}
	for _, workers := range []int{1, 2, 8} {
		e.hashing = make(chan struct{}, workers) // no digest runs meanwhile: Submit answered after its own
		for kind, want := range map[string]string{
			DigestSHA256: hex.EncodeToString(sha.Sum(nil)),
			DigestCRC32C: "crc32c:" + hex.EncodeToString(crcs.Sum(nil)),
		} {
			if got, err := e.digestOf(kind, gpu, nil, nil); err != nil || got != want {
				t.Errorf("digest %s, %d at once = %q, %v; want %q", kind, workers, got, err, want)
			}
		}
	}
}

// countingExecutor is the reference executor, counting the calls the
// engine makes: a real engine's executor sits where it does.
type countingExecutor struct {
	Executor
	computes, loads, stores, visits int
}

func (c *countingExecutor) Compute(gpu int32, k offload.Key) error {
	c.computes++
	return c.Executor.Compute(gpu, k)
}

func (c *countingExecutor) Load(p []Pair, sums bool) (Copy, error) {
	c.loads++
	return c.Executor.Load(p, sums)
}

func (c *countingExecutor) Store(p []Pair) (Copy, error) { c.stores++; return c.Executor.Store(p) }

// newCountingEngine is an engine (64 GPU blocks, 32 CPU slots) whose
// executor is wrap of a countingExecutor over the reference one, logging
// to log (nil: nowhere).
func newCountingEngine(t *testing.T, wrap func(*countingExecutor) Executor, log *slog.Logger) (*Engine, *countingExecutor) {
	var x *countingExecutor
	e, _ := newEngineLogged(t, 64, 32, func(m *offload.Manager) Executor {
		ref, err := NewReference(m, 32, "host", nil)
		if err != nil {
			t.Fatal(err)
		}
		x = &countingExecutor{Executor: ref}
		return wrap(x)
	}, log)
	return e, x
}

func (c *countingExecutor) Visit(gpu int32, fn func([]byte)) error {
	c.visits++
	return c.Executor.Visit(gpu, fn)
}

// Issue 13: the engine's GPU side is an Executor that a real engine's
// replaces. A prompt is computed and stored once, then loaded; a sha256
// digest reads every block through the executor. (The engine loop is the only
// caller of Compute/Load/Store; the digest goroutine's Visits end before
// the answer, so the counts are read after it.)
func TestExecutorReplaceable(t *testing.T) {
	e, x := newCountingEngine(t, func(x *countingExecutor) Executor { return x }, nil)
	ctx := context.Background()
	for i, id := range []string{"a", "b"} {
		r, err := e.Submit(ctx, Request{ID: id, Tokens: tokens(1, 16*4), Digest: DigestSHA256})
		if err != nil {
			t.Fatal(err)
		}
		if len(r.KVDigest) != 64 {
			t.Errorf("request %s: digest %q", id, r.KVDigest)
		}
		want := [4]int{4, 0, 1, 4} // computed, stored once
		if i == 1 {
			want = [4]int{4, 1, 1, 8} // then loaded back
		}
		if got := [4]int{x.computes, x.loads, x.stores, x.visits}; got != want {
			t.Errorf("after %s: computes, loads, stores, visits = %v, want %v", id, got, want)
		}
	}
	if b := e.Backend(); b != "host" {
		t.Errorf("Backend() = %q, the executor's", b)
	}
}

// Lifecycle in the net/http.Server style (issue 13): Run ends when its
// context ends (the engine shuts down at once), after which requests are
// refused; Shutdown with a context that never ends returns once the loop
// stopped.
func TestRunContext(t *testing.T) {
	m := tinyManager(t, 8)
	defer m.Close()
	e, err := New(m, Config{GPUBlocks: 8, Backend: "host"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ctx, cancel := context.WithCancel(context.Background())
	go e.Run(ctx)
	if _, err := e.Submit(context.Background(), Request{ID: "a", Tokens: tokens(1, 16)}); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case <-e.Done():
	case <-time.After(10 * time.Second): // a bound on a hang, not a wait for the result
		t.Fatal("Run did not return after its context ended")
	}
	if _, err := e.Submit(context.Background(), Request{ID: "b", Tokens: tokens(2, 16)}); !errors.Is(err, ErrShuttingDown) {
		t.Errorf("a request after Run ended: %v, want ErrShuttingDown", err)
	}
	if err := e.Shutdown(context.Background()); err != nil {
		t.Errorf("Shutdown after Run ended: %v", err)
	}
}

// failingStores is the reference executor whose stores copy nothing and
// fail once released: a GPU copy that met an error after it was submitted.
type failingStores struct {
	Executor
	started, release chan struct{}
}

type failedCopy struct{ release chan struct{} }

func (c failedCopy) Done() (bool, error) {
	select {
	case <-c.release:
		return true, errors.New("the copy failed")
	default:
		return false, nil
	}
}
func (c failedCopy) Wait() error    { <-c.release; return errors.New("the copy failed") }
func (c failedCopy) Sums() []uint32 { return nil }

func (f *failingStores) Store([]Pair) (Copy, error) {
	close(f.started)
	return failedCopy{f.release}, nil
}

// S7.2: a store whose request was aborted while its copy was in flight,
// and whose copy then failed, does not become readable (found in review:
// the aborted job's store completed as if it succeeded, so its slots —
// no block in them, no checksum kept — were served to peers with a
// checksum computed from whatever bytes they held, and a scrub kept it).
func TestAbortedStoreThatFailedStaysUnreadable(t *testing.T) {
	f := &failingStores{started: make(chan struct{}), release: make(chan struct{})}
	e, m := newEngineWith(t, 16, 8, func(m *offload.Manager) Executor {
		x, err := NewReference(m, 8, "host", nil)
		if err != nil {
			t.Fatal(err)
		}
		f.Executor = x
		return f
	})
	toks := tokens(5, 16*2)
	submitted := make(chan error, 1)
	go func() {
		_, err := e.Submit(context.Background(), Request{ID: "a", Tokens: toks})
		submitted <- err
	}()
	<-f.started
	paused := make(chan error, 1)
	go func() { paused <- e.Pause(PauseAbort, false, 10*time.Second) }()
	if err := <-submitted; err == nil { // the pause aborted it, its copy in flight
		t.Fatal("the request finished although its store never completed")
	}
	close(f.release) // now the copy fails
	if err := <-paused; err != nil {
		t.Fatal(err)
	}
	keys := offload.BlockKeys(m.Config().HashSeed, m.Config().Geometry.BlockTokens, toks)
	m.Do(func(s *offload.Step) {
		req := &offload.Request{ID: "check"}
		s.OnNewRequest(req)
		defer s.OnRequestFinished(req)
		for i, k := range keys {
			if r := s.Lookup(k, req); r != offload.Miss {
				t.Errorf("block %d of the failed store answers %v, want miss", i, r)
			}
		}
	})
}

// syncBuffer is a bytes.Buffer for a logger that goroutines share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// noSums is a Copy whose backend computed no checksums.
type noSums struct{ Copy }

func (noSums) Sums() []uint32 { return nil }

// sumlessExecutor is the reference executor whose copies compute no
// checksums (a backend that cannot).
type sumlessExecutor struct{ storeSums }

func (x sumlessExecutor) Load(p []Pair, sums bool) (Copy, error) {
	c, err := x.countingExecutor.Load(p, sums)
	return noSums{c}, err
}

// storeSums is the reference executor whose stores' checksums are
// dropped (none: nil) or miss their last block (an executor's bug).
type storeSums struct {
	*countingExecutor
	short bool
}

type shortSums struct{ Copy }

func (c shortSums) Sums() []uint32 { s := c.Copy.Sums(); return s[:len(s)-1] }

func (x storeSums) Store(p []Pair) (Copy, error) {
	c, err := x.countingExecutor.Store(p)
	if x.short {
		return shortSums{c}, err
	}
	return noSums{c}, err
}

// Issue 12: the default crc32c digest takes each block's CRC32C from the
// copy that moved it — the store of a computed block, the load of a
// loaded one — and reads no block again; it reads the blocks no copy
// summed (a backend that sums neither, one whose stores do not sum, one
// whose store sums are of the wrong length: not trusted). Either way it
// is the digest's definition over the blocks' bytes: for a prompt
// computed, the same prompt loaded, and one that loads its first half and
// computes the rest.
func TestDigestOffTheCopies(t *testing.T) {
	for _, mode := range []struct {
		name   string
		wrap   func(*countingExecutor) Executor
		visits [3]int // after each case, in all
		warned int    // warnings of checksums not trusted
	}{
		{"sums", func(x *countingExecutor) Executor { return x }, [3]int{0, 0, 0}, 0},
		{"none", func(x *countingExecutor) Executor { return sumlessExecutor{storeSums{x, false}} }, [3]int{4, 8, 12}, 0},
		{"loads-only", func(x *countingExecutor) Executor { return storeSums{x, false} }, [3]int{4, 4, 6}, 0},
		{"short-store-sums", func(x *countingExecutor) Executor { return storeSums{x, true} }, [3]int{4, 4, 6}, 1},
	} {
		t.Run(mode.name, func(t *testing.T) {
			var logs syncBuffer
			e, x := newCountingEngine(t, mode.wrap, slog.New(slog.NewTextHandler(&logs, nil)))
			digest := func(toks []uint32) string {
				leaves := sha256.New()
				buf := make([]byte, e.geo.BlockBytes())
				for _, k := range offload.NewChain(e.keys, e.geo.BlockTokens, toks).Keys {
					Fill(buf, k)
					leaves.Write(binary.BigEndian.AppendUint32(nil, crc32.Checksum(buf, crc32c.Table)))
				}
				return "crc32c:" + hex.EncodeToString(leaves.Sum(nil))
			}
			toks := tokens(5, 16*4)
			mixed := append(slices.Clone(toks[:16*2]), tokens(6, 16*2)...)
			for i, c := range []struct {
				id   string
				toks []uint32
			}{{"computed", toks}, {"loaded", toks}, {"mixed", mixed}} {
				r, err := e.Submit(context.Background(), Request{ID: c.id, Tokens: c.toks})
				if err != nil {
					t.Fatal(err)
				}
				if want := digest(c.toks); r.KVDigest != want {
					t.Errorf("%s: digest %s, want %s", c.id, r.KVDigest, want)
				}
				wantVisits, wantLoads := mode.visits[i], min(i, 2)
				if x.visits != wantVisits || x.loads != wantLoads {
					t.Errorf("after %s: %d visits, %d loads; want %d, %d", c.id, x.visits, x.loads, wantVisits, wantLoads)
				}
			}
			// Two stores returned too few: one warning names the executor's bug.
			if n := strings.Count(logs.String(), "checksums of another number of blocks"); n != mode.warned {
				t.Errorf("%d warnings of untrusted checksums, want %d:\n%s", n, mode.warned, logs.String())
			}
		})
	}
}
