// Package workload drives an engine-like workload through the tiering
// manager in one process: requests that share prefixes, blocks "computed"
// deterministically from their keys in a host buffer standing in for GPU
// memory, stores and loads through the manager's CPU tier, and a byte-for-
// byte check of every block loaded back.
package workload

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/engine"
)

// Spec describes the workload.
type Spec struct {
	Requests      int    // number of requests
	Prefixes      int    // distinct shared prefixes
	PrefixBlocks  int    // blocks in each shared prefix
	PrivateBlocks int    // blocks of each request after its prefix
	Seed          uint64 // picks which prefix each request uses
}

// Report says what happened.
type Report struct {
	Requests     int
	Blocks       int // blocks looked up
	Hits         int // loaded from the CPU tier (whatever tier they came from)
	HitsBySource map[string]int
	Waits        int // steps that waited on HitPending or Retry
	Computed     int // missed and computed
	Unstored     int // computed but not stored (no evictable slot)
	Refused      int // computed again: the prefix stopped at a block seen before that no store kept, or that no CPU slot could be freed to promote (S2.4)
	Verified     int // loaded blocks that matched their computed bytes
	Mismatched   int // loaded blocks that did not
	WorkingSet   int // distinct blocks
	BytesLoaded  uint64
	BytesStored  uint64
	Elapsed      time.Duration
	ManagerStats offload.Metrics
}

// Fill writes the deterministic contents of block k into b: what
// "computing" the block produces on every node (the reference engine's).
func Fill(b []byte, k offload.Key) { engine.Fill(b, k) }

// Run runs spec through m, one request at a time, each in engine steps:
// look up the prefix, load the hits, compute the rest, store it.
func Run(m *offload.Manager, spec Spec) (Report, error) {
	rng := rand.New(rand.NewPCG(spec.Seed, 1))
	bs := m.BlockBytes()
	seed := m.Config().HashSeed
	blockTokens := m.Config().Geometry.BlockTokens
	perReq := spec.PrefixBlocks + spec.PrivateBlocks
	gpu := make([]byte, perReq*bs) // the request's KV "on the GPU"
	want := make([]byte, bs)
	seen := map[offload.Key]bool{}
	kept := map[offload.Key]bool{} // keys a store kept in the CPU tier once
	rep := Report{HitsBySource: map[string]int{}}
	start := time.Now()
	for r := range spec.Requests {
		p := rng.IntN(spec.Prefixes)
		tokens := make([]uint32, perReq*blockTokens)
		for i := range tokens {
			if i < spec.PrefixBlocks*blockTokens {
				tokens[i] = uint32(p*1_000_003 + i)
			} else {
				tokens[i] = uint32(r*7_919 + i + 1<<30)
			}
		}
		keys := offload.BlockKeys(seed, blockTokens, tokens)
		req := &offload.Request{ID: fmt.Sprintf("req-%d", r)}
		var err error
		var hits int
		// Register, look up the prefix, load the hits. A block being
		// promoted from a secondary tier answers HitPending: wait for
		// progress and look again.
		m.Do(func(s *offload.Step) { _, err = s.OnNewRequest(req) })
		if err != nil {
			return rep, err
		}
		var slots []int32
		unpromoted := m.Metrics().PromotionAllocFailures
		for {
			s := m.Begin()
			hits = 0
			wait := false
			for _, k := range keys {
				r := s.Lookup(k, req)
				if r != offload.Hit {
					wait = r == offload.HitPending || r == offload.Retry
					break
				}
				hits++
			}
			if !wait {
				slots, err = s.PrepareLoad(keys[:hits], req)
				for _, k := range keys[:hits] {
					rep.HitsBySource[s.LoadSource(k, req)]++
				}
			}
			s.OnScheduleEnd()
			if !wait {
				break
			}
			rep.Waits++
			select {
			case <-m.Progress():
			case <-time.After(time.Minute):
				return rep, fmt.Errorf("request %s: no progress for a minute while blocks were pending", req.ID)
			}
		}
		if err != nil {
			return rep, err
		}
		// The "CPU → GPU" copy runs outside the lock, as a real engine's would.
		for i, slot := range slots {
			dst := gpu[i*bs : (i+1)*bs]
			copy(dst, m.Arena().Slot(int(slot)))
			Fill(want, keys[i])
			if bytes.Equal(dst, want) {
				rep.Verified++
			} else {
				rep.Mismatched++
			}
		}
		rep.BytesLoaded += uint64(len(slots) * bs)
		// Compute the missing blocks.
		for i := hits; i < len(keys); i++ {
			Fill(gpu[i*bs:(i+1)*bs], keys[i])
		}
		// Step 2: finish the load, reserve slots for the computed blocks.
		var plan *offload.StorePlan
		m.Do(func(s *offload.Step) {
			if err = s.CompleteLoad(keys[:hits], req); err != nil {
				return
			}
			plan, err = s.PrepareStore(keys[hits:], req)
		})
		if err != nil {
			return rep, err
		}
		stored := 0
		if plan != nil {
			for i, k := range plan.Keys {
				j := hits + indexOf(keys[hits:], k)
				copy(m.Arena().Slot(int(plan.Slots[i])), gpu[j*bs:(j+1)*bs])
			}
			stored = len(plan.Keys)
		}
		rep.BytesStored += uint64(stored * bs)
		m.Do(func(s *offload.Step) {
			if plan != nil && len(plan.Keys) > 0 {
				err = s.CompleteStore(plan.Keys, req, true)
			}
			if err == nil {
				err = s.OnRequestFinished(req)
			}
		})
		if err != nil {
			return rep, err
		}
		rep.Requests++
		rep.Blocks += len(keys)
		rep.Hits += hits
		rep.Computed += len(keys) - hits
		unpromoted = m.Metrics().PromotionAllocFailures - unpromoted
		if hits < len(keys) && seen[keys[hits]] && (!kept[keys[hits]] || unpromoted > 0) {
			// The prefix stops at a block no store kept, or at one a
			// secondary tier holds but no CPU slot could be freed for
			// (every slot pinned): what follows is computed again, seen
			// before or not.
			for _, k := range keys[hits:] {
				if seen[k] {
					rep.Refused++
				}
			}
		}
		for _, k := range keys {
			seen[k] = true
		}
		if plan != nil {
			for _, k := range plan.Keys {
				kept[k] = true
			}
		}
		if plan == nil {
			rep.Unstored += len(keys) - hits
		}
	}
	rep.Elapsed = time.Since(start)
	rep.WorkingSet = len(seen)
	rep.ManagerStats = m.Metrics()
	return rep, nil
}

func indexOf(keys []offload.Key, k offload.Key) int {
	for i, x := range keys {
		if x == k {
			return i
		}
	}
	return -1
}
