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
// byte order, and whether more follow. The manager calls Blocks without
// its lock: the tier guards what it reads itself.
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
// cursor after, in byte order. The manager lock is held only to copy the
// CPU tier's keys (O(n)); sorting, and a Lister's own listing, run outside
// it, so that paging a large tier does not stall engine steps.
func (m *Manager) Blocks(tier string, after *Key, limit int) (BlockPage, error) {
	if limit < 1 || limit > MaxBlockPage {
		return BlockPage{}, fmt.Errorf("%w: limit %d, want 1 … %d", ErrConfig, limit, MaxBlockPage)
	}
	page := BlockPage{Tier: tier, Seq: m.eventSeq()}
	var keys []Key
	var more bool
	if tier == "cpu" {
		m.lock()
		keys = m.mu.cpu.readyKeys(after)
		m.unlock()
		keys, more = pageOf(keys, nil, limit)
	} else {
		i := slices.IndexFunc(m.specs, func(s TierSpec) bool { return s.Name == tier })
		var l Lister
		m.lock()
		if i >= 0 && i < len(m.mu.tiers) {
			l, _ = m.mu.tiers[i].(Lister)
		}
		m.unlock()
		switch {
		case i < 0:
			return BlockPage{}, fmt.Errorf("%w: no tier %q", ErrConfig, tier)
		case l == nil:
			return BlockPage{}, fmt.Errorf("%w: tier %q holds no blocks of its own", ErrConfig, tier)
		}
		var err error
		if keys, more, err = m.list(i, l, after, limit); err != nil {
			return BlockPage{}, err
		}
	}
	page.Keys = keys
	if page.Keys == nil {
		page.Keys = []Key{}
	}
	if more && len(page.Keys) > 0 {
		next := page.Keys[len(page.Keys)-1]
		page.Next = &next
	}
	return page, nil
}

// list calls tier i's Lister without the manager lock; a panic is the
// tier's error, counted as any other (S2.11).
func (m *Manager) list(i int, l Lister, after *Key, limit int) (keys []Key, more bool, err error) {
	defer func() {
		if v := recover(); v != nil {
			m.lock()
			err = m.tierPanickedLocked(i, "blocks", v)
			m.unlock()
		}
	}()
	keys, more = l.Blocks(after, limit)
	return keys, more, nil
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

// readyKeys lists the CPU tier's readable blocks after the cursor.
func (c *CPUTier) readyKeys(after *Key) []Key {
	keys := make([]Key, 0, len(c.entries))
	for k, e := range c.entries {
		if !e.writing && (after == nil || bytes.Compare(k[:], after[:]) > 0) {
			keys = append(keys, k)
		}
	}
	return keys
}

// Blocks implements Lister: its lock is held to copy the index's keys
// after the cursor, not to sort them.
func (d *Disk) Blocks(after *Key, limit int) ([]Key, bool) {
	d.mu.Lock()
	keys := make([]Key, 0, len(d.mu.index))
	for k := range d.mu.index {
		if after == nil || bytes.Compare(k[:], after[:]) > 0 {
			keys = append(keys, k)
		}
	}
	d.mu.Unlock()
	return pageOf(keys, nil, limit)
}
