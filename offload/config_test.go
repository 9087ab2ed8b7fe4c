package offload

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
)

// Every bad value is rejected with an error that names its key.
func TestConfigValidate(t *testing.T) {
	if c := DefaultConfig(); c.Validate() != nil {
		t.Fatalf("default config invalid: %v", c.Validate())
	}
	tests := []struct {
		key  string
		edit func(c *Config)
	}{
		{"geometry.layers", func(c *Config) { c.Geometry.Layers = 0 }},
		{"geometry.block_tokens", func(c *Config) { c.Geometry.BlockTokens = -1 }},
		{"geometry.kv_heads", func(c *Config) { c.Geometry.KVHeads = 1 << 20 }},
		{"geometry.head_dim", func(c *Config) { c.Geometry.HeadDim = 0 }},
		{"geometry.dtype", func(c *Config) { c.Geometry.DType = "int4" }},
		{"geometry", func(c *Config) {
			c.Geometry = Geometry{Layers: 65536, BlockTokens: 65536, KVHeads: 65536, HeadDim: 65536, DType: "fp8"}
		}},
		{"cpu_bytes", func(c *Config) { c.CPUBytes = 100 }},
		{"cpu_policy", func(c *Config) { c.CPUPolicy = "fifo" }},
		{"hash_seed", func(c *Config) { c.HashSeed = "" }},
		{"hash_seed", func(c *Config) { c.HashSeed = strings.Repeat("x", MaxHashSeedLen+1) }},
		{"hash_algo", func(c *Config) { c.HashAlgo = "sha256" }},
		{"admission", func(c *Config) { c.Admission = "sometimes" }},
		{"hit_pending_timeout", func(c *Config) { c.HitPendingTimeout = 0 }},
		{"hit_pending_timeout", func(c *Config) { c.HitPendingTimeout = Duration(-time.Second) }},
	}
	for _, tt := range tests {
		t.Run(tt.key, func(t *testing.T) {
			c := DefaultConfig()
			tt.edit(&c)
			err := c.Validate()
			if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tt.key+":") {
				t.Errorf("Validate() = %v, want ErrConfig naming %q", err, tt.key)
			}
		})
	}
}

func TestLoadConfig(t *testing.T) {
	c, err := LoadConfig(strings.NewReader(`{"geometry": "tiny", "cpu_bytes": 1048576, "cpu_policy": "arc"}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Geometry != Geometries["tiny"] || c.CPUPolicy != "arc" || c.Admission != "always" {
		t.Errorf("loaded %+v", c)
	}
	if c.CPUSlots() != 1048576/c.slotStride() {
		t.Errorf("slots %d", c.CPUSlots())
	}
	c, err = LoadConfig(strings.NewReader(`{"geometry": {"layers": 4, "block_tokens": 32, "kv_heads": 1, "head_dim": 64, "dtype": "fp32"}}`))
	if err != nil || c.Geometry.Layers != 4 || c.Geometry.BlockBytes() != 4*2*32*64*4 {
		t.Errorf("object geometry: %+v, %v", c.Geometry, err)
	}
	c, err = LoadConfig(strings.NewReader(`{"tier_poll_interval": "0s", "hit_pending_timeout": "250ms"}`))
	if err != nil || c.TierPollInterval != 0 || time.Duration(c.HitPendingTimeout) != 250*time.Millisecond {
		t.Errorf("durations: %v %v, %v", c.TierPollInterval, c.HitPendingTimeout, err)
	}
	for bad, key := range map[string]string{
		`{"cpu_byts": 1}`:                 "cpu_byts",
		`{"geometry": "huge"}`:            "geometry",
		`{"geometry": {"layer": 1}}`:      "geometry",
		`{"cpu_policy": "lfu"}`:           "cpu_policy",
		`{"cpu_bytes": "lots"}`:           "cpu_bytes",
		`{"hit_pending_timeout": "soon"}`: "hit_pending_timeout", // S4.6
		`{"hit_pending_timeout": "-1s"}`:  "hit_pending_timeout",
		`{"hit_pending_timeout": "0s"}`:   "hit_pending_timeout",
		`{"tier_poll_interval": 5}`:       "tier_poll_interval",
		`{"admission": "always", "x": 1}`: "x",
		`{"admission": "always"} {}`:      "trailing data", // issue 11 item 12
		`{"admission": "always"}]`:        "trailing data",
	} {
		_, err := LoadConfig(strings.NewReader(bad))
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), key) {
			t.Errorf("LoadConfig(%s) = %v, want ErrConfig naming %s", bad, err, key)
		}
	}
}

// FuzzLoadConfig: any input gives a valid config or an ErrConfig, never a
// panic.
func FuzzLoadConfig(f *testing.F) {
	for _, seed := range []string{`{}`, `{"geometry": "tiny"}`, `{"geometry": {"layers": 1, "block_tokens": 1, "kv_heads": 1, "head_dim": 1, "dtype": "fp8"}}`,
		`{"cpu_bytes": -1}`, `{"cpu_policy": "arc", "admission": "backpressure", "hash_seed": "x"}`, `[`, `{"geometry": 7}`,
		`{"geometry": {"layers": 65536, "block_tokens": 65536, "kv_heads": 65536, "head_dim": 65536, "dtype": "fp8"}}`} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, in string) {
		c, err := LoadConfig(strings.NewReader(in))
		if err == nil {
			if verr := c.Validate(); verr != nil {
				t.Fatalf("LoadConfig accepted an invalid config: %v", verr)
			}
		} else if !errors.Is(err, ErrConfig) {
			t.Fatalf("error %v is not ErrConfig", err)
		}
	})
}

// S9: a bad duration names its key and the value, wherever the key sits
// (p2pd's config embeds this one; the decoder's path then carries the Go
// name of the embedded struct, which is not a key).
func TestDurationErrorNamesKey(t *testing.T) {
	_, err := LoadConfig(strings.NewReader(`{"hit_pending_timeout": "5x"}`))
	if want := `offload: bad config: hit_pending_timeout: "5x" is not a duration`; err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Errorf("LoadConfig = %v, want %s…", err, want)
	}
	var outer struct {
		Config
		Extra struct {
			Wait Duration `json:"wait"`
		} `json:"extra"`
	}
	for in, want := range map[string]string{
		`{"tier_poll_interval": 5}`:         `tier_poll_interval: 5 is not a duration`,
		`{"extra": {"wait": "forever"}}`:    `extra.wait: "forever" is not a duration`,
		`{"hit_pending_timeout": ["1s"]}`:   `hit_pending_timeout: ["1s"] is not a duration`,
		`{"cpu_bytes": "lots"}`:             `cpu_bytes: want int64, have a JSON string`,
		`{"hit_pending_timeout": "1s"} {}`:  ``,
		`{"tier_poll_interval": "1ms", "x"`: ``,
	} {
		err := DecodeError(json.Unmarshal([]byte(in), &outer))
		if want == "" {
			if err == nil || strings.Contains(err.Error(), "is not a") || strings.Contains(err.Error(), "want ") {
				t.Errorf("%s: %v, want the decoder's own error", in, err)
			}
			continue
		}
		if err == nil || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("%s: %v, want %s…", in, err, want)
		}
	}
}
