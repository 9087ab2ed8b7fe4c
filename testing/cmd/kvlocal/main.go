// Command kvlocal runs an engine-like workload through the tiering manager
// in one process and prints what happened: hits, misses, evictions, bytes.
// It exits non-zero if a block loaded back differs from the one stored.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/workload"
)

func main() {
	geometry := flag.String("geometry", "qwen3-0.6b", "block geometry preset")
	slots := flag.Int("cpu-slots", 96, "CPU tier slots")
	policy := flag.String("cpu-policy", "lru", "CPU eviction policy: lru or arc")
	mlock := flag.Bool("cpu-mlock", false, "lock the CPU arena in RAM")
	diskDir := flag.String("disk-dir", "", "disk tier directory (default: a temporary directory, removed at exit; \"none\": no disk tier)")
	diskBytes := flag.Int64("disk-bytes", 1<<30, "disk tier cap in bytes")
	spec := workload.Spec{}
	flag.IntVar(&spec.Requests, "requests", 200, "requests to run")
	flag.IntVar(&spec.Prefixes, "prefixes", 8, "distinct shared prefixes")
	flag.IntVar(&spec.PrefixBlocks, "prefix-blocks", 12, "blocks per shared prefix")
	flag.IntVar(&spec.PrivateBlocks, "private-blocks", 4, "blocks of each request after its prefix")
	flag.Uint64Var(&spec.Seed, "seed", 1, "workload seed")
	flag.Parse()
	if err := run(*geometry, *slots, *policy, *mlock, *diskDir, *diskBytes, spec); err != nil {
		fmt.Fprintln(os.Stderr, "kvlocal:", err)
		os.Exit(1)
	}
}

func run(geometry string, slots int, policy string, mlock bool, diskDir string, diskBytes int64, spec workload.Spec) error {
	g, err := offload.GeometryByName(geometry)
	if err != nil {
		return err
	}
	if spec.Requests <= 0 || spec.Prefixes <= 0 || spec.PrefixBlocks < 0 || spec.PrivateBlocks < 0 || spec.PrefixBlocks+spec.PrivateBlocks == 0 {
		return fmt.Errorf("the workload needs requests, prefixes and blocks > 0")
	}
	cfg := offload.DefaultConfig()
	cfg.Geometry = g
	cfg.CPUPolicy = policy
	cfg.CPUMlock = mlock
	cfg.CPUBytes = int64(slots) * int64(offload.SlotStride(g.BlockBytes()))
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var tiers []offload.TierSpec
	if diskDir != "none" {
		if diskDir == "" {
			tmp, err := os.MkdirTemp("", "kvlocal-disk-")
			if err != nil {
				return err
			}
			defer os.RemoveAll(tmp)
			diskDir = tmp
		}
		cfg.DiskDir, cfg.DiskBytes = diskDir, diskBytes
		tiers = append(tiers, offload.DiskTier(cfg.DiskConfig))
	}
	m, err := offload.New(cfg, tiers...)
	if err != nil {
		return err
	}
	defer m.Close()
	a := m.Arena()
	fmt.Printf("kvlocal: %d requests, %d shared prefixes of %d blocks, %d own blocks each; geometry %s (%s blocks)\n",
		spec.Requests, spec.Prefixes, spec.PrefixBlocks, spec.PrivateBlocks, geometry, size(uint64(g.BlockBytes())))
	lock := "not asked"
	if mlock {
		lock = fmt.Sprintf("%s of %s locked", size(uint64(a.LockedBytes)), size(uint64(a.RequestedLockBytes())))
		if a.LockErr != nil {
			lock += " (" + a.LockErr.Error() + ")"
		}
	}
	fmt.Printf("CPU tier: %d slots, %s arena at %#x, policy %s, mlock: %s\n", a.Slots(), size(uint64(a.Len())), a.Base(), policy, lock)
	if cfg.DiskDir != "" {
		fmt.Printf("disk tier: %s, cap %s\n", cfg.DiskDir, size(uint64(cfg.DiskBytes)))
	} else {
		fmt.Println("disk tier: none")
	}
	rep, err := workload.Run(m, spec)
	if err != nil {
		return err
	}
	st := rep.ManagerStats
	fmt.Printf("working set: %d distinct blocks (%s), %.1f× the CPU tier\n",
		rep.WorkingSet, size(uint64(rep.WorkingSet*g.BlockBytes())), float64(rep.WorkingSet)/float64(a.Slots()))
	fmt.Printf("blocks looked up: %d · hits %d (%.1f%%: %d in the CPU tier, %d promoted from disk) · misses computed %d · not stored (no room) %d\n",
		rep.Blocks, rep.Hits, 100*float64(rep.Hits)/float64(rep.Blocks), rep.HitsBySource["cpu"], rep.HitsBySource["disk"], rep.Computed, rep.Unstored)
	fmt.Printf("evictions: %d · CPU tier now %d/%d slots used · %d steps waited for promotions\n", st.CPU.Evictions, st.CPU.Used, st.CPU.Slots, rep.Waits)
	if len(st.Tiers) > 1 {
		d := st.Tiers[1]
		fmt.Printf("disk: wrote %s in cascades, read %s in promotions, %d cascade and %d promotion failures\n",
			size(d.WriteBytes), size(d.ReadBytes), d.CascadeFailures, d.PromotionFailures)
	}
	cpu := st.Tiers[0]
	fmt.Printf("bytes: loaded CPU→GPU %s · stored GPU→CPU %s (manager counters: read %s, write %s)\n",
		size(rep.BytesLoaded), size(rep.BytesStored), size(cpu.ReadBytes), size(cpu.WriteBytes))
	fmt.Printf("verified: %d loaded blocks equal their computed bytes, %d differ · elapsed %v\n",
		rep.Verified, rep.Mismatched, rep.Elapsed.Round(1e6))
	if rep.Mismatched > 0 {
		return fmt.Errorf("%d blocks loaded back differ from what was stored", rep.Mismatched)
	}
	return nil
}

func size(b uint64) string {
	switch {
	case b >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30))
	case b >= 1<<20:
		return fmt.Sprintf("%.2f MiB", float64(b)/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
	}
	return fmt.Sprintf("%d B", b)
}
