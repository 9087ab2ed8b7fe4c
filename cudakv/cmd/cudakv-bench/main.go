// Command cudakv-bench measures cudakv's gather/scatter (B6 on a GPU, B7
// with -backend host) beside its baselines in the same run, prints a table
// per direction last and writes every point as JSON.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/kvtier/kvtier/cudakv"
)

func ints(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("bad list element %q", f)
		}
		out = append(out, n)
	}
	return out, nil
}

func main() {
	backend := flag.String("backend", "cuda", "cuda (B6) or host (B7)")
	segs := flag.String("segments-kib", "4,8,16,32,64,128", "segment sizes in KiB")
	layers := flag.String("layers", "28,80", "layer counts")
	ctas := flag.String("ctas", "4,8,16,32", "CTA caps (cuda)")
	blocks := flag.Int("blocks", 256, "blocks per batch")
	reps := flag.Int("reps", 10, "timed repetitions per point (after 3 warm-ups)")
	jsonOut := flag.String("json", "cudakv-bench.json", "where to write every point")
	flag.Parse()
	cfg := cudakv.BenchConfig{Backend: *backend, Blocks: *blocks, Reps: *reps}
	var err error
	if cfg.Layers, err = ints(*layers); err == nil {
		if cfg.CTAs, err = ints(*ctas); err == nil {
			var kib []int
			if kib, err = ints(*segs); err == nil {
				for _, k := range kib {
					cfg.Segments = append(cfg.Segments, k<<10)
				}
			}
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "cudakv-bench:", err)
		os.Exit(2)
	}
	pts, err := cudakv.RunBench(cfg, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cudakv-bench:", err)
		os.Exit(1)
	}
	if b, err := json.MarshalIndent(pts, "", "  "); err == nil {
		os.WriteFile(*jsonOut, b, 0o644)
	}
	fmt.Printf("\n%-6s %8s %4s %-12s %5s %9s %8s\n", "dir", "seg KiB", "L", "engine", "CTAs", "GB/s", "ratio")
	for _, p := range pts {
		fmt.Printf("%-6s %8d %4d %-12s %5d %9.2f %8.3f\n", p.Direction, p.Segment>>10, p.Layers, p.Engine, p.CTAs, p.GBps, p.Ratio)
	}
}
