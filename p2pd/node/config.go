// Package node wires a p2pd node together: the tiering manager with its
// disk and P2P tiers, the engine, and the admin and request API (HTTP and
// JSON on a unix socket, optionally loopback TCP; never on the P2P port).
package node

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/p2p"
)

// The embedded parts of Config.
type (
	Offload = offload.Config
	P2P     = p2p.Config
)

// Config is a node's whole configuration; its JSON keys are the snake_case
// keys of docs/configuration.md.
type Config struct {
	Offload
	P2P
	// Admin is the admin socket's path (mode 0600).
	Admin string `json:"admin"`
	// AdminTCP optionally also serves the admin API on a loopback address.
	AdminTCP string `json:"admin_tcp"`
	// GPUBlocks is the engine's GPU KV cache in blocks.
	GPUBlocks int `json:"gpu_blocks"`
	// LoadWindow bounds the blocks of a prompt's prefix the engine has
	// the tiers find out about at once, loading the ready ones meanwhile
	// (engine.Config.LoadWindow); 0: the whole prefix at once.
	LoadWindow int `json:"load_window"`
	// CPUSlots, when set, sizes cpu_bytes to that many slots.
	CPUSlots int `json:"cpu_slots"`
	// CopyBackend is cudakv's backend: auto, cuda or host.
	CopyBackend string `json:"copy_backend"`
	// ShutdownGrace is how long running requests may finish on shutdown.
	ShutdownGrace offload.Duration `json:"shutdown_grace"`
	// ClusterTokenFile holds the cluster token (not the token itself, so
	// it stays out of process listings and config files).
	ClusterTokenFile string `json:"cluster_token_file"`
	// KVEventsEndpoint, when set, publishes the node's events in vLLM's
	// KV-events format on a ZMQ PUB socket bound there (host:port; needs
	// hash_algo vllm-sha256-cbor), topic KVEventsTopic; block hashes as
	// vLLM's default 64-bit integers unless KVEventsByteHashes.
	KVEventsEndpoint   string `json:"kv_events_endpoint"`
	KVEventsTopic      string `json:"kv_events_topic"`
	KVEventsByteHashes bool   `json:"kv_events_byte_hashes"`
	// EventHistory is how many of the newest events GET /v0/events keeps
	// for readers that resume (since=) or fall behind.
	EventHistory int    `json:"event_history"`
	LogFormat    string `json:"log_format"`
	LogLevel     string `json:"log_level"`
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	c := Config{Offload: offload.DefaultConfig(), P2P: p2p.DefaultConfig(), Admin: "./p2pd.sock", GPUBlocks: 1024,
		CopyBackend: "auto", ShutdownGrace: offload.Duration(30 * time.Second), EventHistory: 8192, LogFormat: "text", LogLevel: "info"}
	return c
}

// OffloadConfig returns the manager's part, with cpu_slots applied.
func (c *Config) OffloadConfig() offload.Config {
	o := c.Offload
	if c.CPUSlots > 0 {
		o.CPUBytes = int64(c.CPUSlots) * int64(offload.SlotStride(o.Geometry.BlockBytes()))
	}
	return o
}

// Validate reports the first bad value, naming its key.
func (c *Config) Validate() error {
	o := c.OffloadConfig()
	if err := o.Validate(); err != nil {
		return err
	}
	if err := c.P2P.Validate(); err != nil {
		return err
	}
	switch {
	case c.Admin == "":
		return fmt.Errorf("%w: admin: empty", offload.ErrConfig)
	case c.GPUBlocks <= 0 || c.GPUBlocks > 1<<24:
		return fmt.Errorf("%w: gpu_blocks: %d is not in [1, 16777216]", offload.ErrConfig, c.GPUBlocks)
	case c.LoadWindow < 0 || c.LoadWindow > 1<<24:
		return fmt.Errorf("%w: load_window: %d is not in [0, 16777216]", offload.ErrConfig, c.LoadWindow)
	case c.CPUSlots < 0:
		return fmt.Errorf("%w: cpu_slots: %d is negative", offload.ErrConfig, c.CPUSlots)
	case c.CopyBackend != "auto" && c.CopyBackend != "cuda" && c.CopyBackend != "host":
		return fmt.Errorf("%w: copy_backend: %q (want auto, cuda or host)", offload.ErrConfig, c.CopyBackend)
	case c.KVEventsEndpoint != "" && c.HashAlgo != offload.HashVLLMSHA256CBOR:
		return fmt.Errorf("%w: kv_events_endpoint: vLLM's KV events carry vLLM's block hashes: set hash_algo %s", offload.ErrConfig, offload.HashVLLMSHA256CBOR)
	case c.Dialect == p2p.DialectVLLM && c.HashAlgo != offload.HashVLLMSHA256CBOR:
		return fmt.Errorf("%w: p2p_dialect: vllm: vLLM's peers look blocks up by vLLM's keys: set hash_algo %s (and vLLM's --prefix-caching-hash-algo sha256_cbor)", offload.ErrConfig, offload.HashVLLMSHA256CBOR)
	case c.Dialect == p2p.DialectVLLM && c.ClusterTokenFile != "":
		return fmt.Errorf("%w: cluster_token_file: vLLM's P2P wire has no authentication; p2p_dialect vllm cannot require a token", offload.ErrConfig)
	case c.HashAlgo == offload.HashVLLMSHA256CBOR && c.HashSeed == offload.DefaultHashSeed:
		return fmt.Errorf("%w: hash_seed: %q is kvtier's default, which no vLLM uses: give vLLM's (%s, unless its PYTHONHASHSEED is set: then that value)", offload.ErrConfig, c.HashSeed, offload.VLLMDefaultSeed)
	case c.EventHistory < 1 || c.EventHistory > 1<<20:
		return fmt.Errorf("%w: event_history: %d is not in [1, 1048576]", offload.ErrConfig, c.EventHistory)
	case c.ShutdownGrace < 0:
		return fmt.Errorf("%w: shutdown_grace: negative", offload.ErrConfig)
	case c.LogFormat != "text" && c.LogFormat != "json":
		return fmt.Errorf("%w: log_format: %q (want text or json)", offload.ErrConfig, c.LogFormat)
	}
	if c.AdminTCP != "" {
		host, _, err := net.SplitHostPort(c.AdminTCP)
		ip := net.ParseIP(host)
		if err != nil || (host != "localhost" && (ip == nil || !ip.IsLoopback())) {
			return fmt.Errorf("%w: admin_tcp: %q is not a loopback host:port", offload.ErrConfig, c.AdminTCP)
		}
		if c.AdminTCP == c.Listen {
			return fmt.Errorf("%w: admin_tcp: the admin API never shares the P2P port", offload.ErrConfig)
		}
	}
	return nil
}

// LoadConfig reads a JSON config over the defaults. Unknown keys,
// anything after the object and a value of the wrong type (a bad
// duration, say) are errors naming the key where there is one.
func LoadConfig(r io.Reader) (Config, error) {
	c := DefaultConfig()
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := decodeOne(dec, &c); err != nil {
		return c, fmt.Errorf("%w: %w", offload.ErrConfig, offload.DecodeError(err))
	}
	return c, nil
}
