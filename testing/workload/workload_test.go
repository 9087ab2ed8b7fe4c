package workload

import (
	"testing"

	"github.com/kvtier/kvtier/offload"
)

// The demo's workload on the tiny geometry: shared prefixes hit, a CPU
// tier smaller than the working set evicts, and every block loaded back
// equals the block that was stored.
func TestRun(t *testing.T) {
	for _, policy := range []string{"lru", "arc"} {
		t.Run(policy, func(t *testing.T) {
			cfg := tinyConfig()
			cfg.CPUPolicy = policy
			m, err := offload.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			rep, err := Run(m, Spec{Requests: 60, Prefixes: 3, PrefixBlocks: 4, PrivateBlocks: 2, Seed: 5})
			if err != nil {
				t.Fatal(err)
			}
			st := rep.ManagerStats
			if rep.Hits == 0 || rep.Mismatched != 0 || rep.Verified != rep.Hits {
				t.Errorf("hits %d, verified %d, mismatched %d: want hits, all verified", rep.Hits, rep.Verified, rep.Mismatched)
			}
			if rep.WorkingSet <= st.CPU.Slots || st.CPU.Evictions == 0 {
				t.Errorf("working set %d over %d slots gave %d evictions; want a working set larger than the tier and evictions", rep.WorkingSet, st.CPU.Slots, st.CPU.Evictions)
			}
			if rep.Hits+rep.Computed != rep.Blocks || rep.Blocks != 60*6 {
				t.Errorf("blocks %d = hits %d + computed %d?", rep.Blocks, rep.Hits, rep.Computed)
			}
			if got := st.Tiers[0].ReadBytes; got != rep.BytesLoaded {
				t.Errorf("manager counted %d bytes loaded, workload %d", got, rep.BytesLoaded)
			}
			if st.CPU.Pinned != 0 || st.CPU.Writing != 0 || st.Requests != 0 {
				t.Errorf("left behind: %+v", st.CPU)
			}
		})
	}
}

// tinyConfig is a tiny-geometry CPU tier of 24 slots.
func tinyConfig() offload.Config {
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = 24 * int64(cfg.Geometry.BlockBytes())
	return cfg
}

func TestFillDeterministic(t *testing.T) {
	k := offload.BlockKeys("s", 1, []uint32{1, 2})
	a, b, c := make([]byte, 61), make([]byte, 61), make([]byte, 61)
	Fill(a, k[0])
	Fill(b, k[0])
	Fill(c, k[1])
	if string(a) != string(b) || string(a) == string(c) {
		t.Error("Fill must be a function of the key alone")
	}
}

// With a disk tier, blocks evicted from the CPU tier come back from disk:
// the workload waits on HitPending through the manager's progress signal,
// and every block promoted from disk is verified.
func TestRunWithDisk(t *testing.T) {
	cfg := tinyConfig()
	cfg.DiskDir = t.TempDir()
	m, err := offload.New(cfg, offload.DiskTier(cfg.DiskConfig))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	rep, err := Run(m, Spec{Requests: 60, Prefixes: 3, PrefixBlocks: 4, PrivateBlocks: 2, Seed: 5})
	if err != nil {
		t.Fatal(err)
	}
	if rep.HitsBySource["disk"] == 0 || rep.Mismatched != 0 || rep.Verified != rep.Hits {
		t.Errorf("disk hits %d, verified %d of %d, mismatched %d", rep.HitsBySource["disk"], rep.Verified, rep.Hits, rep.Mismatched)
	}
	// A store refused for want of a slot (every slot pinned by cascades
	// still writing to a slow disk) loses its blocks by design (S2.4), and
	// so does a disk hit no slot could be freed to promote (seen under the
	// race detector beside other tests: 3 promotions refused, 4 blocks
	// computed again); any other miss of a block stored once is a loss.
	if rep.Computed != rep.WorkingSet+rep.Refused {
		t.Errorf("computed %d blocks, want only the %d compulsory misses and the %d after refused stores or promotions (%d unstored, %d promotions refused)",
			rep.Computed, rep.WorkingSet, rep.Refused, rep.Unstored, rep.ManagerStats.PromotionAllocFailures)
	}
}
