package offload

import (
	"cmp"
	"fmt"
	"slices"
	"time"
)

type pin struct {
	owner Owner
	since time.Time
}

// cpuEntry is a slot's record while a key (or a detached holder) owns the
// slot. Every slot has one record, kept in CPUTier.recs from the start, so
// reserving, pinning and releasing blocks allocate nothing per key (issue
// 12); a record is reused only once its slot is free, when nothing refers
// to it any more.
type cpuEntry struct {
	gen     uint64 // which reservation of the tier this is (CPUTier.gens): a record outlives it
	slot    int32
	hitAt   uint64 // stamp of the lock hold that last answered Hit
	writing bool
	writer  Owner     // while writing
	since   time.Time // when the write was reserved
	pins    []pin
}

// CPUTier is the primary tier: which key lives in which arena slot and in
// which state (S1.2). A slot is writing (not readable), ready (readable and
// evictable when unpinned) or pinned (ready, with readers). It is not safe
// for concurrent use: the manager calls it with its lock held.
type CPUTier struct {
	arena   *Arena
	policy  Policy
	entries map[Key]*cpuEntry
	recs    []cpuEntry // by slot: entries and detached point into it
	gens    uint64     // reservations made: the last record's gen
	fresh   int32      // slots [fresh, N) have never been used
	stamp   uint64     // current lock hold; see lookupProtect
	// detached holds entries that Reset removed while a writer or a reader
	// still held them, and promotions a store superseded (reserveStore):
	// their slots are not reused until released. Each shrinks when its
	// holder commits, unpins or is released.
	detached  map[Key][]*cpuEntry
	ndetached int
	free      []int32 // freed slots, reused last in first out
	// emit reports stored and removed keys (S2.8); nil reports nothing.
	emit func(Event)
	// now is the time pins and writes are stamped with: the manager's
	// (nowLocked, read once per hold of its lock); time.Now alone.
	now func() time.Time

	writing, pinned int
	evictions       uint64
	forcedReleases  uint64
	scrubMismatches uint64
	storedBytes     uint64
}

// NewCPUTier returns an empty CPU tier over arena using policy.
func NewCPUTier(arena *Arena, policy Policy) *CPUTier {
	return &CPUTier{arena: arena, policy: policy, entries: make(map[Key]*cpuEntry), recs: make([]cpuEntry, arena.Slots()), stamp: 1, now: time.Now}
}

// lookupProtect is Lookup that also keeps a Hit from being evicted until
// endHold: a Hit answered in a step stays valid until PrepareLoad in the
// same step (S2.0).
func (c *CPUTier) lookupProtect(k Key) Result {
	r, e := c.lookup(k)
	if r == Hit && e.hitAt != c.stamp {
		e.hitAt = c.stamp
	}
	return r
}

// endHold ends the protection of every Hit answered since the last call;
// the manager calls it when it releases its lock.
func (c *CPUTier) endHold() { c.stamp++ }

// Arena returns the tier's memory.
func (c *CPUTier) Arena() *Arena { return c.arena }

// Lookup answers Hit for a ready key, HitPending for a key being written
// and Miss otherwise. It never answers Retry.
func (c *CPUTier) Lookup(k Key) Result {
	r, _ := c.lookup(k)
	return r
}

func (c *CPUTier) lookup(k Key) (Result, *cpuEntry) {
	e, ok := c.entries[k]
	switch {
	case !ok:
		return Miss, nil
	case e.writing:
		return HitPending, e
	}
	return Hit, e
}

// Slot returns the slot holding k, or -1.
func (c *CPUTier) Slot(k Key) int {
	if e, ok := c.entries[k]; ok {
		return int(e.slot)
	}
	return -1
}

func (c *CPUTier) freeSlots() int { return c.arena.Slots() - len(c.entries) - c.ndetached }

// Reserve allocates slots in the writing state, owned by writer, for the
// keys of keys that are not resident, evicting ready unpinned blocks when
// the free slots do not suffice. No key of keys, and no Hit answered since
// the manager took its lock, is evicted. It returns the
// new keys with their slots in input order and the evicted keys, or
// ok=false and changes nothing when not enough blocks can be evicted.
func (c *CPUTier) Reserve(keys []Key, writer Owner) (added []Key, slots []int32, evicted []Key, ok bool) {
	return c.reserve(nil, nil, keys, writer, false)
}

// reserveStore is Reserve for a store of blocks the engine computed: a key
// that a job (a promotion) is still writing is reserved anew as well. The
// promotion's slot is detached from the key — invisible, never made
// readable, freed only when the job commits — so a stalled promotion
// neither keeps the computed block out nor overwrites it later.
func (c *CPUTier) reserveStore(keys []Key, writer Owner) (added []Key, slots []int32, evicted []Key, ok bool) {
	return c.reserve(nil, nil, keys, writer, true)
}

// reserve is Reserve and reserveStore, appending the new keys and their
// slots to added and slots: a caller that passes buffers of its own (a
// promotion, one key a lookup) allocates nothing.
func (c *CPUTier) reserve(added []Key, slots []int32, keys []Key, writer Owner, supersede bool) ([]Key, []int32, []Key, bool) {
	base := len(added)
	for i, k := range keys {
		e, ok := c.entries[k]
		if (!ok || supersede && e.writing && e.writer.Req == "") && !slices.Contains(keys[:i], k) {
			added = append(added, k)
		}
	}
	if len(added) == base {
		return added, slots, nil, true
	}
	var evicted []Key
	if short := len(added) - base - c.freeSlots(); short > 0 {
		evicted = c.policy.Evict(short, func(k Key) bool {
			return c.entries[k].hitAt == c.stamp || slices.Contains(keys, k)
		})
		if evicted == nil {
			return added[:base], slots, nil, false
		}
		for _, k := range evicted {
			c.release(k)
		}
		c.evictions += uint64(len(evicted))
		c.report(EventRemoved, evicted)
	}
	for _, k := range added[base:] {
		if e, ok := c.entries[k]; ok { // a promotion's write, superseded
			c.policy.Remove(k)
			delete(c.entries, k)
			c.writing--
			c.detach(k, e)
		}
	}
	now := c.now()
	for _, k := range added[base:] {
		var s int32
		if n := len(c.free); n > 0 {
			s, c.free = c.free[n-1], c.free[:n-1]
		} else {
			s = c.fresh
			c.fresh++
		}
		slots = append(slots, s)
		c.arena.ClearSum(int(s)) // its writer records the new block's (S7.2)
		e := &c.recs[s]
		c.gens++
		*e = cpuEntry{gen: c.gens, slot: s, writing: true, writer: writer, since: now, pins: e.pins[:0]}
		c.entries[k] = e
		c.policy.Insert(k)
		c.writing++
	}
	return added, slots, evicted, true
}

// drop removes the ready block of k written by reservation gen, whose
// bytes disagree with its checksum (Scrub), reporting its removal; false
// when k's block is another write now (its slot's record may be the same,
// reused: gen tells them apart) or is being written. A pinned block
// leaves lookups at once and its slot is freed on its last unpin, as a
// reset does (S7.2: never served).
func (c *CPUTier) drop(k Key, gen uint64) bool {
	e := c.entries[k]
	if e == nil || e.gen != gen || e.writing {
		return false
	}
	c.policy.Remove(k)
	if len(e.pins) > 0 {
		delete(c.entries, k)
		c.pinned--
		c.detach(k, e)
	} else {
		c.release(k)
	}
	c.scrubMismatches++
	c.report(EventRemoved, []Key{k})
	return true
}

// release frees k's slot; the policy must already have forgotten k.
func (c *CPUTier) release(k Key) {
	e := c.entries[k]
	delete(c.entries, k)
	c.free = append(c.free, e.slot)
}

// Commit ends writes owned by writer: with ok the keys become ready (a
// stored event, described by chain when not nil), otherwise their slots
// are freed. Keys not being written
// by writer are left alone. It returns the keys it changed and the longest
// time one of them was being written.
func (c *CPUTier) Commit(keys []Key, writer Owner, ok bool, chain *Chain) (done []Key, took time.Duration) {
	now := c.now()
	for _, k := range keys {
		e, found := c.entries[k]
		if !found || !e.writing || e.writer != writer {
			c.releaseDetached(k, func(d *cpuEntry) bool {
				if d.writing && d.writer == writer {
					d.writing = false
					return true
				}
				return false
			})
			continue
		}
		done = append(done, k)
		took = max(took, now.Sub(e.since))
		c.writing--
		if ok {
			e.writing, e.writer = false, Owner{}
			c.policy.SetEvictable(k, true)
			c.storedBytes += uint64(c.arena.SlotBytes())
		} else {
			c.policy.Remove(k)
			c.release(k)
		}
	}
	if ok && len(done) > 0 {
		c.reportStored(done, chain)
	}
	return done, took
}

// Pin adds a pin owned by owner to every key and returns their slots. Every
// key must be ready; otherwise nothing is pinned and the error names the
// first key that is not (S2.3). access records a use with the policy (a
// load); a cascade's read pin does not.
func (c *CPUTier) Pin(keys []Key, owner Owner, access bool) ([]int32, error) {
	for _, k := range keys {
		if e, ok := c.entries[k]; !ok || e.writing {
			return nil, fmt.Errorf("%w: key %v is %v in the CPU tier", ErrNotReady, k, c.Lookup(k))
		}
	}
	now := c.now()
	slots := make([]int32, len(keys))
	for i, k := range keys {
		e := c.entries[k]
		if len(e.pins) == 0 {
			c.pinned++
			c.policy.SetEvictable(k, false)
		}
		e.pins = append(e.pins, pin{owner: owner, since: now})
		slots[i] = e.slot
		if access {
			c.policy.Access(k)
		}
	}
	return slots, nil
}

// Unpin removes one pin owned by owner from every key. Keys that hold no
// such pin are skipped and reported in the error. It returns the longest
// time one of the removed pins was held.
func (c *CPUTier) Unpin(keys []Key, owner Owner) (time.Duration, error) {
	var missing []Key
	var held time.Duration
	now := c.now()
	for _, k := range keys {
		e, ok := c.entries[k]
		i := -1
		if ok {
			i = slices.IndexFunc(e.pins, func(p pin) bool { return p.owner == owner })
		}
		if i < 0 {
			if !c.releaseDetached(k, func(d *cpuEntry) bool { return dropPin(d, owner) }) {
				missing = append(missing, k)
			}
			continue
		}
		held = max(held, now.Sub(e.pins[i].since))
		c.unpinAt(k, e, i)
	}
	if len(missing) > 0 {
		return held, fmt.Errorf("%w: %v holds no pin on %d key(s), first %v", ErrNotPinned, owner, len(missing), missing[0])
	}
	return held, nil
}

func (c *CPUTier) unpinAt(k Key, e *cpuEntry, i int) {
	e.pins = slices.Delete(e.pins, i, i+1)
	if len(e.pins) == 0 {
		c.pinned--
		c.policy.SetEvictable(k, true)
	}
}

// ReleaseOwner removes every pin owner holds and counts them as forced
// releases (S1.3). It returns how many pins it removed.
func (c *CPUTier) ReleaseOwner(owner Owner) int {
	n := 0
	for k, e := range c.entries {
		for i := len(e.pins) - 1; i >= 0; i-- {
			if e.pins[i].owner == owner {
				c.unpinAt(k, e, i)
				n++
			}
		}
	}
	for k, list := range c.detached {
		for _, d := range slices.Clone(list) {
			for dropPin(d, owner) {
				n++
			}
			c.freeDetached(k, d)
		}
	}
	c.forcedReleases += uint64(n)
	return n
}

// dropPin removes one pin of owner from d.
func dropPin(d *cpuEntry, owner Owner) bool {
	i := slices.IndexFunc(d.pins, func(p pin) bool { return p.owner == owner })
	if i < 0 {
		return false
	}
	d.pins = slices.Delete(d.pins, i, i+1)
	return true
}

// releaseDetached applies release to the first detached entry of k it
// accepts, frees that entry's slot once nobody holds it, and reports
// whether any entry accepted.
func (c *CPUTier) releaseDetached(k Key, release func(*cpuEntry) bool) bool {
	for _, d := range c.detached[k] {
		if release(d) {
			c.freeDetached(k, d)
			return true
		}
	}
	return false
}

// freeDetached frees d's slot if no writer or reader holds it any more.
func (c *CPUTier) freeDetached(k Key, d *cpuEntry) {
	if d.writing || len(d.pins) > 0 {
		return
	}
	c.detached[k] = slices.DeleteFunc(c.detached[k], func(x *cpuEntry) bool { return x == d })
	if len(c.detached[k]) == 0 {
		delete(c.detached, k)
	}
	c.ndetached--
	c.free = append(c.free, d.slot)
}

// detach keeps e, removed from entries, from reuse until its writer or
// readers release it.
func (c *CPUTier) detach(k Key, e *cpuEntry) {
	if c.detached == nil {
		c.detached = make(map[Key][]*cpuEntry)
	}
	c.detached[k] = append(c.detached[k], e)
	c.ndetached++
}

// Reset empties the tier (a cache reset, S5.1): every block is removed,
// with no removal event (the manager reports the reset as EventCleared).
// Blocks that a writer or a reader still holds become detached: invisible
// to lookups, their slots kept from reuse until the holder completes,
// unpins or is released.
func (c *CPUTier) Reset() {
	for k, e := range c.entries {
		c.policy.Remove(k)
		if e.writing || len(e.pins) > 0 {
			c.detach(k, e)
			continue
		}
		c.free = append(c.free, e.slot)
	}
	clear(c.entries)
	c.writing, c.pinned = 0, 0
}

// Touch marks keys as recently used, the first key most recently.
func (c *CPUTier) Touch(keys []Key) {
	for i := len(keys) - 1; i >= 0; i-- {
		if _, ok := c.entries[keys[i]]; ok {
			c.policy.Access(keys[i])
		}
	}
}

// oldestPin is the age at now of the oldest pin, zero without one.
func (c *CPUTier) oldestPin(now time.Time) time.Duration {
	var oldest time.Duration
	for _, e := range c.entries {
		for _, p := range e.pins {
			oldest = max(oldest, now.Sub(p.since))
		}
	}
	for _, list := range c.detached {
		for _, d := range list {
			for _, p := range d.pins {
				oldest = max(oldest, now.Sub(p.since))
			}
		}
	}
	return oldest
}

// Audit lists the pins held longer than olderThan, oldest first (S1.3).
func (c *CPUTier) Audit(olderThan time.Duration) []PinInfo {
	now := c.now()
	var out []PinInfo
	for k, e := range c.entries {
		for _, p := range e.pins {
			if age := now.Sub(p.since); age >= olderThan {
				out = append(out, PinInfo{Key: k, Slot: int(e.slot), Owner: p.owner, Age: age})
			}
		}
	}
	for k, list := range c.detached {
		for _, d := range list {
			for _, p := range d.pins {
				if age := now.Sub(p.since); age >= olderThan {
					out = append(out, PinInfo{Key: k, Slot: int(d.slot), Owner: p.owner, Age: age, Detached: true})
				}
			}
		}
	}
	slices.SortFunc(out, func(a, b PinInfo) int {
		return cmp.Or(cmp.Compare(b.Age, a.Age), cmp.Compare(a.Slot, b.Slot))
	})
	return out
}

func (c *CPUTier) report(kind EventKind, keys []Key) {
	if c.emit != nil {
		c.emit(Event{Kind: kind, Keys: keys})
	}
}

// reportStored reports keys stored; with the request's chain, one event
// per run of consecutive blocks, with their parent and token ids.
func (c *CPUTier) reportStored(keys []Key, chain *Chain) {
	if c.emit == nil {
		return
	}
	if chain == nil {
		c.report(EventStored, keys)
		return
	}
	for len(keys) > 0 {
		first, ok := chain.Index(keys[0])
		if !ok {
			n := 1
			for n < len(keys) {
				if _, in := chain.Index(keys[n]); in {
					break
				}
				n++
			}
			c.report(EventStored, keys[:n])
			keys = keys[n:]
			continue
		}
		n := 1
		for n < len(keys) && first+n < len(chain.Keys) && chain.Keys[first+n] == keys[n] {
			n++
		}
		parent := chain.Parent(first)
		bt := chain.BlockTokens
		c.emit(Event{Kind: EventStored, Keys: keys[:n], Parent: &parent, Tokens: chain.Tokens[first*bt : (first+n)*bt]})
		keys = keys[n:]
	}
}

// CPUStats is a snapshot of the CPU tier's occupancy.
type CPUStats struct {
	Slots          int    `json:"slots"`
	Used           int    `json:"used"`    // resident: writing or ready
	Writing        int    `json:"writing"` // reserved, data not readable yet
	Pinned         int    `json:"pinned"`  // ready with at least one pin
	Evictions      uint64 `json:"evictions"`
	ForcedReleases uint64 `json:"forced_releases"`
	// ScrubMismatches counts blocks a scrub found disagreeing with their
	// checksum and removed (S7.2).
	ScrubMismatches uint64 `json:"scrub_mismatches"`
	StoredBytes     uint64 `json:"stored_bytes"`
	Policy          string `json:"policy"`
	// Detached counts slots a cache reset removed while a transfer still
	// held them, and slots of promotions a store superseded; they are
	// reused once released.
	Detached int `json:"detached"`
}

// Stats returns the tier's occupancy and counters.
func (c *CPUTier) Stats() CPUStats {
	return CPUStats{
		Slots: c.arena.Slots(), Used: len(c.entries), Writing: c.writing, Pinned: c.pinned,
		Evictions: c.evictions, ForcedReleases: c.forcedReleases, ScrubMismatches: c.scrubMismatches, StoredBytes: c.storedBytes,
		Policy: c.policy.Name(), Detached: c.ndetached,
	}
}
