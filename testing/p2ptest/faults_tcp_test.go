//go:build !nixl

package p2ptest

import (
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/p2p"
)

// Faults in the TCP data plane (S7.1, S7.2, S6.8), injected into its
// connections: whatever goes wrong on the wire, the consumer's request
// recomputes (answers Miss), no block loads wrong bytes, and neither node
// keeps a pin or a reserved slot.
func TestDataPlaneFaults(t *testing.T) {
	block := int64(tiny.BlockBytes())
	cases := []struct {
		name  string
		fault Fault
		edit  func(*p2p.Config)
		stat  string // a consumer metric that must count the fault
	}{
		{name: "corrupt", fault: Fault{Corrupt: true, After: 16 + block/2}, stat: "kv_offload_p2p_crc_errors_total"},
		{name: "cut", fault: Fault{Cut: true, After: 16 + block + 4 + 100}},
		{name: "drop", fault: Fault{Drop: true, After: 0}, edit: func(c *p2p.Config) {
			c.LoadTimeout = offload.Duration(300 * time.Millisecond)
			c.AbortAckTimeout = offload.Duration(300 * time.Millisecond)
		}, stat: "kv_offload_p2p_load_timeouts_total"},
		{name: "delay", fault: Fault{Delay: 5 * time.Millisecond}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fn := &FaultNet{Inner: p2p.TCP{}}
			fn.Set(tc.fault)
			prod := NewNode(t, tiny, 64, fn, func(c *p2p.Config) { c.DataConns = 1 })
			cons := NewNode(t, tiny, 64, nil, tc.edit)
			keys := Keys(2, 8, tiny.BlockTokens)
			prod.Store(t, keys)
			hits, bad := cons.Fetch(t, "kv-"+tc.name, prod.Tier.Addr(), keys)
			if bad != 0 {
				t.Errorf("%d blocks loaded with wrong bytes", bad)
			}
			if tc.name == "delay" {
				if hits != 8 {
					t.Errorf("a slow link fetched %d of 8 blocks", hits)
				}
			} else if hits != 0 {
				t.Errorf("fetched %d blocks through a broken link, want 0 (recompute)", hits)
			}
			if tc.stat != "" {
				if v := cons.Stat(tc.stat); v < 1 {
					t.Errorf("%s = %v, want ≥ 1", tc.stat, v)
				}
			}
			prod.WaitClean(t)
			cons.WaitClean(t)
		})
	}
}
