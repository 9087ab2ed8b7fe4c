package offload

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
)

// Config configures a Manager. Keys are snake_case in JSON; docs/
// configuration.md lists every key with its default and validation.
type Config struct {
	// Geometry is the KV layout of one block. In JSON either a preset name
	// ("tiny", "qwen3-0.6b") or an object.
	Geometry Geometry `json:"geometry"`
	// CPUBytes is the size of the CPU tier; it holds CPUBytes / stride
	// slots, the stride being the block size rounded up to a page.
	CPUBytes int64 `json:"cpu_bytes"`
	// CPUPolicy is the eviction policy: "lru" or "arc".
	CPUPolicy string `json:"cpu_policy"`
	// CPUMlock locks the arena in RAM; failure is reported, not fatal.
	CPUMlock bool `json:"cpu_mlock"`
	// CPUHugePages asks for transparent huge pages for the arena.
	CPUHugePages bool `json:"cpu_huge_pages"`
	// HashSeed seeds block keys; every node sharing blocks must agree.
	HashSeed string `json:"hash_seed"`
	// Admission is "always" or "backpressure" (S2.7).
	Admission string `json:"admission"`
	// Logger receives the manager's logs; nil discards them.
	Logger *slog.Logger `json:"-"`
}

// DefaultConfig returns the defaults: the qwen3-0.6b geometry, a 1 GiB LRU
// CPU tier with huge pages and without mlock, the default hash seed and
// admission "always".
func DefaultConfig() Config {
	return Config{
		Geometry:     Geometries["qwen3-0.6b"],
		CPUBytes:     1 << 30,
		CPUPolicy:    "lru",
		CPUHugePages: true,
		HashSeed:     DefaultHashSeed,
		Admission:    "always",
	}
}

// MaxHashSeedLen bounds hash_seed (it travels in the peer handshake).
const MaxHashSeedLen = 4096

// Validate reports the first bad value, naming its key.
func (c *Config) Validate() error {
	if err := c.Geometry.validate("geometry"); err != nil {
		return err
	}
	if stride := int64(c.slotStride()); c.CPUBytes < stride {
		return fmt.Errorf("%w: cpu_bytes: %d is less than one slot (%d bytes)", ErrConfig, c.CPUBytes, stride)
	}
	if !slices.Contains([]string{"lru", "arc"}, c.CPUPolicy) {
		return fmt.Errorf("%w: cpu_policy: unknown policy %q (want lru or arc)", ErrConfig, c.CPUPolicy)
	}
	if c.HashSeed == "" || len(c.HashSeed) > MaxHashSeedLen {
		return fmt.Errorf("%w: hash_seed: must be 1 to %d bytes, have %d", ErrConfig, MaxHashSeedLen, len(c.HashSeed))
	}
	if !slices.Contains([]string{"always", "backpressure"}, c.Admission) {
		return fmt.Errorf("%w: admission: unknown policy %q (want always or backpressure)", ErrConfig, c.Admission)
	}
	return nil
}

func (c *Config) slotStride() int {
	page := os.Getpagesize()
	return (c.Geometry.BlockBytes() + page - 1) / page * page
}

// CPUSlots is the number of CPU slots the config gives.
func (c *Config) CPUSlots() int { return int(c.CPUBytes / int64(c.slotStride())) }

// Fingerprint is the config fingerprint peers compare (S1.1).
func (c *Config) Fingerprint() string { return Fingerprint(c.Geometry, c.HashSeed) }

// LoadConfig reads a JSON config over the defaults and validates it.
// Unknown keys are errors.
func LoadConfig(r io.Reader) (Config, error) {
	c := DefaultConfig()
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return c, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return c, c.Validate()
}

// UnmarshalJSON accepts a preset name or an object.
func (g *Geometry) UnmarshalJSON(b []byte) error {
	if bytes.HasPrefix(bytes.TrimSpace(b), []byte(`"`)) {
		var name string
		if err := json.Unmarshal(b, &name); err != nil {
			return err
		}
		p, err := GeometryByName(name)
		if err != nil {
			return fmt.Errorf("geometry: %w", err)
		}
		*g = p
		return nil
	}
	type plain Geometry
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var p plain
	if err := dec.Decode(&p); err != nil {
		return fmt.Errorf("geometry: %w", err)
	}
	*g = Geometry(p)
	return nil
}
