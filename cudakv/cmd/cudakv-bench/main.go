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

// ints parses a comma-separated list of positive integers, or exits.
func ints(name, s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			fmt.Fprintf(os.Stderr, "cudakv-bench: -%s: bad list element %q\n", name, f)
			os.Exit(2)
		}
		out = append(out, n)
	}
	return out
}

func main() {
	backend := flag.String("backend", "cuda", "cuda (B6) or host (B7)")
	segs := flag.String("segments-kib", "4,8,16,32,64,128", "segment sizes in KiB")
	layers := flag.String("layers", "28,80", "layer counts")
	ctas := flag.String("ctas", "4,8,16,32", "CTA caps (cuda)")
	threads := flag.String("threads", "256", "CTA sizes (cuda), multiples of 32")
	blocks := flag.Int("blocks", 256, "blocks per batch")
	reps := flag.Int("reps", 10, "timed repetitions per point (after 3 warm-ups)")
	baselines := flag.String("baselines", "per-segment,batched", "baselines beside the ceiling (cuda): per-segment, batched; none for neither")
	jsonOut := flag.String("json", "cudakv-bench.json", "where to write every point")
	checksums := flag.Bool("checksums", false, "host backend (B7): stores compute each block's CRC32C as they copy, as the engine's do (the CUDA bench times its kernel with and without them either way)")
	flag.Parse()
	cfg := cudakv.BenchConfig{
		Backend:   *backend,
		Layers:    ints("layers", *layers),
		CTAs:      ints("ctas", *ctas),
		Threads:   ints("threads", *threads),
		Blocks:    *blocks,
		Reps:      *reps,
		Checksums: *checksums,
	}
	for _, k := range ints("segments-kib", *segs) {
		cfg.Segments = append(cfg.Segments, k<<10)
	}
	for _, b := range strings.Split(*baselines, ",") {
		switch b = strings.TrimSpace(b); b {
		case "per-segment", "batched":
			cfg.Baselines = append(cfg.Baselines, b)
		case "none", "":
		default:
			fmt.Fprintf(os.Stderr, "cudakv-bench: unknown baseline %q (want per-segment, batched or none)\n", b)
			os.Exit(2)
		}
	}
	pts, err := cudakv.RunBench(cfg, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cudakv-bench:", err)
		os.Exit(1)
	}
	if b, err := json.MarshalIndent(pts, "", "  "); err == nil {
		os.WriteFile(*jsonOut, b, 0o644)
	}
	fmt.Printf("\n%-6s %8s %4s %-12s %5s %7s %9s %8s\n", "dir", "seg KiB", "L", "engine", "CTAs", "threads", "GB/s", "ratio")
	for _, p := range pts {
		if p.GBps == 0 {
			fmt.Printf("%-6s %8d %4d %-12s %5s %7s %9s %8s  %s\n", p.Direction, p.Segment>>10, p.Layers, p.Engine, "", "", "-", "-", p.Note)
			continue
		}
		fmt.Printf("%-6s %8d %4d %-12s %5d %7d %9.2f %8.3f\n", p.Direction, p.Segment>>10, p.Layers, p.Engine, p.CTAs, p.Threads, p.GBps, p.Ratio)
	}
}
