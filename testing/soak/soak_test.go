// Package soak drives the tiering manager through long runs of distinct
// requests and checks that what it keeps is bounded by live work (S8.5).
package soak

import (
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
)

const (
	requests  = 20000
	measureAt = 2000
	cpuSlots  = 8
	diskCap   = 32 // blocks
	// heapBound is the HeapAlloc growth allowed between request 2,000 and
	// 20,000. Keeping every event, as the manager once did, grows the heap
	// by 6.5 MB over this run (measured).
	heapBound = 1 << 20
)

// S8.5, S2.8: 20,000 distinct requests through a CPU tier of 8 slots and
// a disk tier of 32 blocks, so every store evicts from both, leave the heap
// where it was after the first 2,000: with no subscriber no event is kept,
// and a subscriber that never reads holds only its buffer.
func TestHeapFlat(t *testing.T) {
	for _, tc := range []struct {
		name   string
		buffer int // a subscription that is never read; 0: none
	}{
		{"no subscriber", 0},
		{"stalled subscriber", 256},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newManager(t)
			if tc.buffer > 0 {
				sub := m.Subscribe(tc.buffer)
				defer func() {
					ev := sub.Take()
					if n := len(ev); n != tc.buffer+1 || ev[n-1].Kind != offload.EventLost {
						t.Errorf("the stalled subscriber holds %d events, want its buffer of %d and a lost marker", n, tc.buffer)
					}
					sub.Close()
				}()
			}
			var base uint64
			for i := range requests {
				if i == measureAt {
					base = heapAfterGC(t, m)
				}
				serve(t, m, i)
			}
			end := heapAfterGC(t, m)
			t.Logf("heap after %d requests %d B, after %d %d B", measureAt, base, requests, end)
			if end > base+heapBound {
				t.Errorf("heap grew by %d B from request %d to %d, want at most %d B", end-base, measureAt, requests, heapBound)
			}
			mt := m.Metrics()
			if mt.CPU.Evictions < requests-cpuSlots || mt.Requests != 0 {
				t.Errorf("after the run: %d CPU evictions, %d live requests; want ≥ %d evictions, none live", mt.CPU.Evictions, mt.Requests, requests-cpuSlots)
			}
		})
	}
}

func newManager(t *testing.T) *offload.Manager {
	t.Helper()
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(cpuSlots * cfg.Geometry.BlockBytes())
	cfg.DiskDir = scratchDir(t)
	cfg.DiskBytes = diskCap * int64(64+cfg.Geometry.BlockBytes()) // a file is a 64-byte header and a block
	cfg.DiskWorkers = 2
	m, err := offload.New(cfg, offload.DiskTier(cfg.DiskConfig))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Error(err)
		}
	})
	return m
}

// scratchDir is a directory removed after the test, in /dev/shm where
// that is a directory (tmpfs keeps 40,000 file writes and removals cheap),
// else in the test's temporary directory.
func scratchDir(t *testing.T) string {
	t.Helper()
	if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
		if dir, err := os.MkdirTemp("/dev/shm", "kvtier-soak-"); err == nil {
			t.Cleanup(func() {
				if err := os.RemoveAll(dir); err != nil {
					t.Error(err)
				}
			})
			return dir
		}
	}
	return t.TempDir()
}

// key returns the one block key of request i.
func key(i int) offload.Key {
	tokens := make([]uint32, 16)
	for j := range tokens {
		tokens[j] = uint32(i*16 + j)
	}
	return offload.BlockKeys(offload.DefaultHashSeed, 16, tokens)[0]
}

// serve runs request i as an engine would: a lookup of its block (and,
// every 16th request, of an older block the disk may still hold, which
// promotes it), a store of its block, and the end of the request.
func serve(t *testing.T, m *offload.Manager, i int) {
	t.Helper()
	req := &offload.Request{ID: fmt.Sprintf("r%d", i)}
	k := key(i)
	m.Do(func(s *offload.Step) {
		if _, err := s.OnNewRequest(req); err != nil {
			t.Fatal(err)
		}
		s.Lookup(k, req)
		if i%16 == 0 && i >= 4 {
			s.Lookup(key(i-4), req)
		}
	})
	// Wait at most 10 s for a slot: all of them may be held by cascades to
	// disk or by promotions, which the poll goroutine completes.
	deadline := time.After(10 * time.Second)
	for {
		var plan *offload.StorePlan
		m.Do(func(s *offload.Step) {
			var err error
			if plan, err = s.PrepareStore([]offload.Key{k}, req); err != nil {
				t.Fatal(err)
			}
			if plan != nil {
				if err := s.CompleteStore(plan.Keys, req, true); err != nil {
					t.Fatal(err)
				}
			}
		})
		if plan != nil {
			break
		}
		select {
		case <-m.Progress():
		case <-deadline:
			t.Fatalf("request %d found no CPU slot in 10 s", i)
		}
	}
	m.Do(func(s *offload.Step) {
		if err := s.OnRequestFinished(req); err != nil {
			t.Fatal(err)
		}
	})
}

// heapAfterGC waits at most 10 s until no transfer is in flight, then
// returns the live heap.
func heapAfterGC(t *testing.T, m *offload.Manager) uint64 {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for busy(m) {
		select {
		case <-m.Progress():
		case <-deadline:
			t.Fatal("transfers still in flight after 10 s")
		}
	}
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

func busy(m *offload.Manager) bool {
	d := m.Metrics().Tiers[1]
	return d.ActiveCascades > 0 || d.ActivePromotions > 0
}
