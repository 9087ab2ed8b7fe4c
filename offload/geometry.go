package offload

import (
	"fmt"
	"maps"
	"slices"
)

// Geometry describes the KV bytes of one block: for each of Layers layers a
// K and a V segment (or one fused segment, as in MLA) of BlockTokens tokens ×
// KVHeads heads × HeadDim elements of DType.
type Geometry struct {
	Layers      int    `json:"layers"`
	BlockTokens int    `json:"block_tokens"`
	KVHeads     int    `json:"kv_heads"`
	HeadDim     int    `json:"head_dim"`
	DType       string `json:"dtype"`
	Fused       bool   `json:"fused,omitempty"`
}

var dtypeSizes = map[string]int{"fp8": 1, "fp16": 2, "bf16": 2, "fp32": 4}

// Geometries are the named presets. "tiny" keeps tests fast; "qwen3-0.6b"
// (1.75 MiB blocks) is the geometry of the demo and the benchmarks.
var Geometries = map[string]Geometry{
	"tiny":       {Layers: 2, BlockTokens: 16, KVHeads: 2, HeadDim: 32, DType: "fp16"},
	"qwen3-0.6b": {Layers: 28, BlockTokens: 16, KVHeads: 8, HeadDim: 128, DType: "bf16"},
}

// GeometryNames lists the presets of Geometries, sorted.
func GeometryNames() []string {
	return slices.Sorted(maps.Keys(Geometries))
}

// GeometryByName returns a preset from Geometries.
func GeometryByName(name string) (Geometry, error) {
	g, ok := Geometries[name]
	if !ok {
		return Geometry{}, fmt.Errorf("offload: unknown geometry %q (known: %v)", name, GeometryNames())
	}
	return g, nil
}

// DTypeBytes is the size of one element (0 for an unknown dtype).
func (g Geometry) DTypeBytes() int { return dtypeSizes[g.DType] }

// SegmentBytes is the size of one layer's K (or V, or fused) segment.
func (g Geometry) SegmentBytes() int {
	return g.BlockTokens * g.KVHeads * g.HeadDim * dtypeSizes[g.DType]
}

// Segments is the number of segments in a block: 2 per layer, 1 if fused.
func (g Geometry) Segments() int {
	if g.Fused {
		return g.Layers
	}
	return 2 * g.Layers
}

// BlockBytes is the size of one block across all layers.
func (g Geometry) BlockBytes() int { return g.Segments() * g.SegmentBytes() }

func (g Geometry) validate(prefix string) error {
	for _, f := range []struct {
		name string
		v    int
	}{{"layers", g.Layers}, {"block_tokens", g.BlockTokens}, {"kv_heads", g.KVHeads}, {"head_dim", g.HeadDim}} {
		if f.v <= 0 || f.v > 1<<16 {
			return fmt.Errorf("%w: %s.%s: %d is not in [1, 65536]", ErrConfig, prefix, f.name, f.v)
		}
	}
	if _, ok := dtypeSizes[g.DType]; !ok {
		return fmt.Errorf("%w: %s.dtype: unknown dtype %q (want fp8, fp16, bf16 or fp32)", ErrConfig, prefix, g.DType)
	}
	// Multiply step by step so that huge factors cannot overflow.
	b := int64(1)
	for _, f := range []int{g.Segments(), g.BlockTokens, g.KVHeads, g.HeadDim, dtypeSizes[g.DType]} {
		if b *= int64(f); b > 1<<30 {
			return fmt.Errorf("%w: %s: a block is larger than 1 GiB", ErrConfig, prefix)
		}
	}
	return nil
}
