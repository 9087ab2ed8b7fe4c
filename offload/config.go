package offload

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"strings"
	"time"
	"unicode"
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
	// HashAlgo is the key scheme: "kvtier" or "vllm-sha256-cbor" (vLLM's
	// sha256_cbor block hashes; with vLLM's seed, "vllm-none-hash" unless
	// its PYTHONHASHSEED is set).
	HashAlgo string `json:"hash_algo"`
	// Admission is "always" or "backpressure" (S2.7).
	Admission string `json:"admission"`
	// TierPollInterval is how often the poll goroutine services polled
	// tiers while they have work only polling reveals (S3.1); ≤ 0 means no
	// poll goroutine: every tier is serviced by engine steps only.
	TierPollInterval Duration `json:"tier_poll_interval"`
	// HitPendingTimeout bounds how long one (request, key) may answer
	// HitPending or Retry, from its first such answer; afterwards it
	// answers Miss for the rest of the request (S4.1, S4.7). Must be
	// positive.
	HitPendingTimeout Duration `json:"hit_pending_timeout"`
	// DiskConfig configures the disk tier (disk_dir, disk_bytes, …); the
	// manager does not build it: pass DiskTier(cfg.DiskConfig) to New.
	DiskConfig
	// Logger receives the manager's logs; nil discards them.
	Logger *slog.Logger `json:"-"`
	// EventSeqBase is the number before the first event (S2.8): p2pd sets
	// its start time in microseconds, so that a restarted node numbers
	// its events above any of its previous run's and a reader resuming
	// with an old number learns it lost them.
	EventSeqBase uint64 `json:"-"`
	// Now is the clock the manager reads: once per hold of its lock (a
	// step, a pass), and passed from there to the policy (deadlines,
	// admission, pin ages) and to the tiers (TierEnv.Now). nil means
	// time.Now; a test sets it to move time by hand.
	Now func() time.Time `json:"-"`
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
		HashAlgo:     HashKvtier,
		Admission:    "always",

		TierPollInterval:  Duration(time.Millisecond),
		HitPendingTimeout: Duration(5 * time.Second),
		DiskConfig:        DefaultDiskConfig(),
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
	if !slices.Contains(HashAlgos, c.HashAlgo) {
		return fmt.Errorf("%w: hash_algo: unknown scheme %q (want %s)", ErrConfig, c.HashAlgo, strings.Join(HashAlgos, " or "))
	}
	if !slices.Contains([]string{"always", "backpressure"}, c.Admission) {
		return fmt.Errorf("%w: admission: unknown policy %q (want always or backpressure)", ErrConfig, c.Admission)
	}
	if c.HitPendingTimeout <= 0 {
		return fmt.Errorf("%w: hit_pending_timeout: %v is not a positive duration", ErrConfig, time.Duration(c.HitPendingTimeout))
	}
	return c.DiskConfig.Validate()
}

func (c *Config) slotStride() int { return SlotStride(c.Geometry.BlockBytes()) }

// CPUSlots is the number of CPU slots the config gives.
func (c *Config) CPUSlots() int { return int(c.CPUBytes / int64(c.slotStride())) }

// Fingerprint is the config fingerprint peers compare (S1.1).
func (c *Config) Fingerprint() string { return Fingerprint(c.Geometry, c.HashSeed, c.HashAlgo) }

// KeyScheme is how this node computes block keys.
func (c *Config) KeyScheme() KeyScheme { return KeyScheme{Algo: c.HashAlgo, Seed: c.HashSeed} }

// LoadConfig reads a JSON config over the defaults and validates it.
// Unknown keys are errors; every error names the key concerned.
func LoadConfig(r io.Reader) (Config, error) {
	c := DefaultConfig()
	data, err := io.ReadAll(r)
	if err != nil {
		return c, fmt.Errorf("%w: reading: %w", ErrConfig, err)
	}
	if err := decodeStrict(data, &c); err != nil {
		return c, fmt.Errorf("%w: %s", ErrConfig, nameKey(data, err))
	}
	return c, c.Validate()
}

// decodeStrict decodes one JSON object with no unknown keys and nothing
// after it.
func decodeStrict(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("trailing data after the JSON object")
	}
	return nil
}

// nameKey finds the top-level key whose value alone fails to decode, so
// that an error like "time: invalid duration" says which key it concerns.
func nameKey(data []byte, err error) string {
	var raw map[string]json.RawMessage
	if json.Unmarshal(data, &raw) != nil {
		return err.Error()
	}
	for _, k := range slices.Sorted(maps.Keys(raw)) {
		one, _ := json.Marshal(map[string]json.RawMessage{k: raw[k]})
		probe := DefaultConfig()
		if e := decodeStrict(one, &probe); e != nil {
			if ke, ok := keyError(e); ok {
				return ke.Error()
			}
			return k + ": " + e.Error()
		}
	}
	return err.Error()
}

// Duration is a time.Duration written in JSON as a Go duration string
// ("1ms", "5s").
type Duration time.Duration

// MarshalJSON writes d as a duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// UnmarshalJSON reads a duration string. A bad value is a
// *json.UnmarshalTypeError, which encoding/json completes with the key
// it was found under; DecodeError turns that into an error naming the
// key.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if json.Unmarshal(b, &s) == nil {
		if v, err := time.ParseDuration(s); err == nil {
			*d = Duration(v)
			return nil
		}
	}
	v := string(b)
	if len(v) > 64 {
		v = v[:61] + "..."
	}
	return &json.UnmarshalTypeError{Value: v, Type: reflect.TypeFor[Duration]()}
}

// DecodeError rewrites an error from decoding a JSON config so that it
// names the key concerned, snake_case as in the file: a bad duration
// reads `hit_pending_timeout: "5x" is not a duration (want a string
// such as "5s")`. An error it cannot place is returned unchanged.
func DecodeError(err error) error {
	if ke, ok := keyError(err); ok {
		return ke
	}
	return err
}

func keyError(err error) (error, bool) {
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) || te.Field == "" {
		return nil, false
	}
	// The decoder's path names embedded structs by their Go field names
	// (Offload.hit_pending_timeout); keys are never capitalised.
	var path []string
	for _, p := range strings.Split(te.Field, ".") {
		if p != "" && !unicode.IsUpper(rune(p[0])) {
			path = append(path, p)
		}
	}
	if len(path) == 0 {
		return nil, false
	}
	key := strings.Join(path, ".")
	if te.Type == reflect.TypeFor[Duration]() {
		return fmt.Errorf("%s: %s is not a duration (want a string such as \"5s\")", key, te.Value), true
	}
	return fmt.Errorf("%s: want %v, have a JSON %s", key, te.Type, te.Value), true
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
