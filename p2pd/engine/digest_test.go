package engine

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
)

// gatedVisits is an executor whose Visit counts its callers and holds
// each until gate is closed; block fail fails at once.
type gatedVisits struct {
	Executor
	gate         chan struct{}
	fail         int32
	inside, most atomic.Int32
	visited      sync.Map // gpu block -> true
}

var errVisit = errors.New("visit failed")

func (g *gatedVisits) Visit(gpu int32, fn func([]byte)) error {
	g.visited.Store(gpu, true)
	if gpu == g.fail {
		return errVisit // at once, gate or not
	}
	n := g.inside.Add(1)
	defer g.inside.Add(-1)
	for m := g.most.Load(); n > m && !g.most.CompareAndSwap(m, n); m = g.most.Load() {
	}
	<-g.gate
	fn([]byte{byte(gpu)})
	return nil
}

// Issue 12: concurrent digests share the engine's hashing tokens — never
// more blocks hashed at once than there are tokens (digestWorkers in New),
// however many requests' digests run — and each still gets its own
// blocks' digest.
func TestDigestsShareWorkers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := &gatedVisits{gate: make(chan struct{}), fail: -1}
		e := &Engine{x: g, hashing: make(chan struct{}, 2)}
		got := make([]string, 3)
		var wg sync.WaitGroup
		for i := range got {
			wg.Go(func() {
				d, err := e.digestOf(DigestCRC32C, []int32{int32(4 * i), int32(4*i + 1), int32(4*i + 2), int32(4*i + 3)}, nil, nil)
				if err != nil {
					t.Error(err)
				}
				got[i] = d
			})
		}
		synctest.Wait() // every hasher is in Visit or waits for a token
		if n := g.inside.Load(); n != 2 {
			t.Errorf("%d blocks hashed at once by 3 digests, want the 2 the tokens allow", n)
		}
		close(g.gate)
		wg.Wait()
		if m := g.most.Load(); m > 2 {
			t.Errorf("at most %d blocks hashed at once, want ≤ 2", m)
		}
		for i, d := range got {
			for j := range i {
				if d == got[j] {
					t.Errorf("digests %d and %d of different blocks are both %s", j, i, d)
				}
			}
		}
	})
}

// One digest hashes as many blocks at once as there are tokens.
func TestDigestInParallel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := &gatedVisits{gate: make(chan struct{}), fail: -1}
		e := &Engine{x: g, hashing: make(chan struct{}, 4)}
		done := make(chan error)
		go func() {
			_, err := e.digestOf(DigestSHA256, []int32{0, 1, 2, 3, 4, 5, 6, 7}, nil, nil)
			done <- err
		}()
		synctest.Wait()
		if n := g.inside.Load(); n != 4 {
			t.Errorf("one digest of 8 blocks hashes %d at once, want the 4 the tokens allow", n)
		}
		close(g.gate)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	})
}

// A block that cannot be read fails the digest with its error, and the
// digest's goroutines end with it (synctest.Test fails on a goroutine
// left blocked): the hashers that were reading a block when it failed
// finish it, and none reads another.
func TestDigestVisitError(t *testing.T) {
	for _, tokens := range []int{1, 3} {
		t.Run(fmt.Sprint(tokens, " tokens"), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				g := &gatedVisits{gate: make(chan struct{}), fail: 0}
				e := &Engine{x: g, hashing: make(chan struct{}, tokens)}
				gpu := make([]int32, 100)
				for i := range gpu {
					gpu[i] = int32(i)
				}
				done := make(chan error)
				go func() {
					_, err := e.digestOf(DigestSHA256, gpu, nil, nil)
					done <- err
				}()
				synctest.Wait() // block 0 failed; the other hashers wait in their first block
				close(g.gate)
				if err := <-done; !errors.Is(err, errVisit) {
					t.Fatalf("digest over a failing block: %v, want %v", err, errVisit)
				}
				n := 0
				g.visited.Range(func(any, any) bool { n++; return true })
				if n < 1 || n > tokens {
					t.Errorf("%d blocks read, want 1 – %d: the failing one and those in progress beside it", n, tokens)
				}
			})
		})
	}
}

// BenchmarkDigest times the exact digest (sha256) of 64 qwen3-0.6b blocks
// (112 MiB) on the host backend, hashed one block at a time beside as many
// at once as there are cores, alternately in one run; x-one is the ratio.
// The engine's default is every core but one (digestWorkers).
func BenchmarkDigest(b *testing.B) {
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["qwen3-0.6b"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(8 * cfg.Geometry.BlockBytes())
	m, err := offload.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	const blocks = 64
	x, err := NewReference(m, blocks, "host", nil)
	if err != nil {
		b.Fatal(err)
	}
	defer x.Close()
	gpu := make([]int32, blocks)
	for i := range gpu {
		gpu[i] = int32(i)
		if err := x.Compute(int32(i), offload.Key{byte(i)}); err != nil {
			b.Fatal(err)
		}
	}
	one := &Engine{x: x, hashing: make(chan struct{}, 1)}
	all := &Engine{x: x, hashing: make(chan struct{}, runtime.GOMAXPROCS(0))}
	var t1, tn time.Duration
	for b.Loop() {
		for _, r := range []struct {
			e *Engine
			t *time.Duration
		}{{one, &t1}, {all, &tn}} {
			t0 := time.Now()
			if _, err := r.e.digestOf(DigestSHA256, gpu, nil, nil); err != nil {
				b.Fatal(err)
			}
			*r.t += time.Since(t0)
		}
	}
	bytes := float64(b.N) * blocks * float64(cfg.Geometry.BlockBytes())
	b.ReportMetric(bytes/t1.Seconds()/1e9, "GB/s-one")
	b.ReportMetric(bytes/tn.Seconds()/1e9, "GB/s-all")
	b.ReportMetric(t1.Seconds()/tn.Seconds(), "x-one")
}
