package node

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/offload"
)

// Every bad value is rejected with an error naming its key; the JSON
// config covers the manager's, the P2P tier's and the node's keys.
func TestConfig(t *testing.T) {
	c, err := LoadConfig(strings.NewReader(`{"geometry": "tiny", "cpu_slots": 64, "gpu_blocks": 32, "p2p_listen": "127.0.0.1:0",
		"pin_hold": "10s", "disk_dir": "/tmp/x", "admin": "/tmp/a.sock", "admin_tcp": "127.0.0.1:9000", "log_format": "json"}`))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("valid config rejected: %v", err)
	}
	oc := c.OffloadConfig()
	if oc.CPUSlots() != 64 || c.GPUBlocks != 32 || c.PinHold != offload.Duration(10e9) || c.DiskDir != "/tmp/x" {
		t.Errorf("loaded %+v", c)
	}
	for key, edit := range map[string]func(*Config){
		"admin":              func(c *Config) { c.Admin = "" },
		"admin_tcp":          func(c *Config) { c.AdminTCP = "0.0.0.0:9000" },
		"gpu_blocks":         func(c *Config) { c.GPUBlocks = 0 },
		"load_window":        func(c *Config) { c.LoadWindow = -1 },
		"cpu_slots":          func(c *Config) { c.CPUSlots = -1 },
		"copy_backend":       func(c *Config) { c.CopyBackend = "tpu" },
		"log_format":         func(c *Config) { c.LogFormat = "xml" },
		"data_conns":         func(c *Config) { c.DataConns = 0 },
		"bulk_concurrency":   func(c *Config) { c.BulkConcurrency = -1 },
		"cpu_policy":         func(c *Config) { c.CPUPolicy = "fifo" },
		"shutdown_grace":     func(c *Config) { c.ShutdownGrace = -1 },
		"event_history":      func(c *Config) { c.EventHistory = 0 },
		"kv_events_endpoint": func(c *Config) { c.KVEventsEndpoint = "127.0.0.1:5557" }, // with kvtier keys
		"node_id":            func(c *Config) { c.NodeID = "bad\nid" },
		"p2p_dialect":        func(c *Config) { c.Dialect = "vllm"; c.DataPlane = "none" }, // with kvtier keys
		"cluster_token_file": func(c *Config) {
			c.Dialect, c.DataPlane, c.HashAlgo, c.ClusterTokenFile = "vllm", "none", offload.HashVLLMSHA256CBOR, "/tmp/tok"
		},
		"data_plane": func(c *Config) { c.Dialect, c.HashAlgo = "vllm", offload.HashVLLMSHA256CBOR }, // tcp: vLLM has none
		"p2p_tls_cert": func(c *Config) {
			c.Dialect, c.DataPlane, c.HashAlgo, c.TLSCert = "vllm", "none", offload.HashVLLMSHA256CBOR, "/tmp/c"
		},
		"hash_seed":     func(c *Config) { c.HashAlgo = offload.HashVLLMSHA256CBOR }, // kvtier's default seed with vLLM's keys
		"p2p_listen":    func(c *Config) { c.Dialect, c.DataPlane, c.Listen = "vllm", "none", "0.0.0.0:5710" },
		"p2p_advertise": func(c *Config) { c.Dialect, c.DataPlane, c.Advertise = "vllm", "none", "[::]:5710" },
	} {
		c := DefaultConfig()
		edit(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), key) {
			t.Errorf("%s: Validate() = %v, want an error naming it", key, err)
		}
	}
	if _, err := LoadConfig(strings.NewReader(`{"gpu_blokcs": 1}`)); !errors.Is(err, offload.ErrConfig) || !strings.Contains(err.Error(), "gpu_blokcs") {
		t.Errorf("unknown key: %v", err)
	}
	c = DefaultConfig()
	c.AdminTCP = c.Listen
	if err := c.Validate(); err == nil {
		t.Error("the admin API was allowed on the P2P port")
	}
}

func TestSeededTokens(t *testing.T) {
	a, b, c := SeededTokens(1, 50), SeededTokens(1, 50), SeededTokens(2, 50)
	if len(a) != 50 || string(rune(a[0])) != string(rune(b[0])) || a[49] != b[49] || a[0] == c[0] && a[1] == c[1] {
		t.Error("seeded prompts must be a function of the seed alone")
	}
}
