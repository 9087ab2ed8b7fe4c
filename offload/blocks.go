package offload

import (
	"bytes"
	"fmt"
	"slices"
)

// Listing what the tiers hold (GET /v0/blocks): the snapshot a subscriber
// of the event stream (S2.8) starts from, or resynchronises from after a
// lost marker.

// Lister is implemented by secondary tiers that can list the blocks they
// hold: up to limit keys after the cursor after (nil: from the first), in
// byte order, and whether more follow.
type Lister interface {
	Blocks(after *Key, limit int) (keys []Key, more bool)
}

// BlockPage is one page of a tier's blocks. Seq is the last event the
// manager had numbered before the page was read: a subscriber that
// follows the events after the first page's Seq and applies them over the
// pages ends with what the tier holds.
type BlockPage struct {
	Tier string `json:"tier"`
	Seq  uint64 `json:"seq"`
	Keys []Key  `json:"keys"`
	// Next is the cursor of the next page; nil on the last.
	Next *Key `json:"next,omitempty"`
}

// MaxBlockPage bounds a page of Blocks.
const MaxBlockPage = 10000

// Blocks lists up to limit (1 … MaxBlockPage) of the ready blocks of the
// tier named tier ("cpu" or a secondary tier that is a Lister) after the
// cursor after, in byte order.
func (m *Manager) Blocks(tier string, after *Key, limit int) (BlockPage, error) {
	if limit < 1 || limit > MaxBlockPage {
		return BlockPage{}, fmt.Errorf("%w: limit %d, want 1 … %d", ErrConfig, limit, MaxBlockPage)
	}
	page := BlockPage{Tier: tier, Seq: m.eventSeq()}
	var more bool
	m.lock()
	defer m.unlock()
	if tier == "cpu" {
		page.Keys, more = pageOf(m.mu.cpu.readyKeys(), after, limit)
	} else {
		i := slices.IndexFunc(m.specs, func(s TierSpec) bool { return s.Name == tier })
		if i < 0 || i >= len(m.mu.tiers) {
			return BlockPage{}, fmt.Errorf("%w: no tier %q", ErrConfig, tier)
		}
		l, ok := m.mu.tiers[i].(Lister)
		if !ok {
			return BlockPage{}, fmt.Errorf("%w: tier %q holds no blocks of its own", ErrConfig, tier)
		}
		if perr := m.tierCall(i, "blocks", func() { page.Keys, more = l.Blocks(after, limit) }); perr != nil {
			return BlockPage{}, perr
		}
	}
	if page.Keys == nil {
		page.Keys = []Key{}
	}
	if more && len(page.Keys) > 0 {
		next := page.Keys[len(page.Keys)-1]
		page.Next = &next
	}
	return page, nil
}

// pageOf sorts keys and returns up to limit of those after the cursor,
// and whether more follow. keys is the caller's to reorder.
func pageOf(keys []Key, after *Key, limit int) ([]Key, bool) {
	if after != nil {
		keys = slices.DeleteFunc(keys, func(k Key) bool { return bytes.Compare(k[:], after[:]) <= 0 })
	}
	slices.SortFunc(keys, func(a, b Key) int { return bytes.Compare(a[:], b[:]) })
	if len(keys) > limit {
		return keys[:limit], true
	}
	return keys, false
}

// readyKeys lists the CPU tier's readable blocks.
func (c *CPUTier) readyKeys() []Key {
	keys := make([]Key, 0, len(c.entries))
	for k, e := range c.entries {
		if !e.writing {
			keys = append(keys, k)
		}
	}
	return keys
}

// Blocks implements Lister.
func (d *Disk) Blocks(after *Key, limit int) ([]Key, bool) {
	d.mu.Lock()
	keys := make([]Key, 0, len(d.mu.index))
	for k := range d.mu.index {
		keys = append(keys, k)
	}
	d.mu.Unlock()
	return pageOf(keys, after, limit)
}
