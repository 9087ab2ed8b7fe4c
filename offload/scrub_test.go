package offload

import (
	"context"
	"errors"
	"hash/crc32"
	"runtime"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload/crc32c"
)

// S7.2: a scrub verifies every ready block against the checksum kept with
// its slot: a block whose bytes changed is removed (a removal event, the
// counter) and never served again; a block with no checksum kept gets one.
func TestScrub(t *testing.T) {
	m := testManager(t, 8)
	sub := m.Subscribe(64)
	defer sub.Close()
	keys := BlockKeys(DefaultHashSeed, 16, make([]uint32, 16*3))
	req := &Request{ID: "w"}
	var slots []int32
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		p, err := s.PrepareStore(keys, req)
		if err != nil || p == nil {
			t.Fatalf("PrepareStore: %v %v", p, err)
		}
		for i, k := range p.Keys {
			fill(m.Arena().Slot(int(p.Slots[i])), k)
			if i < 2 { // the writer records two checksums, not the third
				m.Arena().SetSum(int(p.Slots[i]), crc32.Checksum(m.Arena().Slot(int(p.Slots[i])), crc32c.Table))
			}
		}
		slots = p.Slots
		s.CompleteStore(p.Keys, req, true)
		s.OnRequestFinished(req)
	})
	sub.Take()
	m.Arena().Slot(int(slots[1]))[5] ^= 0xff // memory corruption
	res, err := m.Scrub(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res != (ScrubResult{Checked: 3, Mismatched: 1, Unrecorded: 1}) {
		t.Errorf("scrub %+v, want 3 checked, 1 mismatched, 1 unrecorded", res)
	}
	r := &Request{ID: "r"}
	m.Do(func(s *Step) {
		s.OnNewRequest(r)
		for i, want := range []Result{Hit, Miss, Hit} {
			if got := s.Lookup(keys[i], r); got != want {
				t.Errorf("key %d after the scrub: %v, want %v", i, got, want)
			}
		}
		s.OnRequestFinished(r)
	})
	if crc, ok := m.Arena().Sum(int(slots[2])); !ok || crc != crc32.Checksum(m.Arena().Slot(int(slots[2])), crc32c.Table) {
		t.Error("the unrecorded block's checksum was not kept")
	}
	if n := m.Metrics().CPU.ScrubMismatches; n != 1 {
		t.Errorf("scrub mismatches %d, want 1", n)
	}
	evs := sub.Take()
	if len(evs) != 1 || evs[0].Kind != EventRemoved || len(evs[0].Keys) != 1 || evs[0].Keys[0] != keys[1] {
		t.Errorf("events %+v, want the corrupt block's removal", evs)
	}
}

// S7.2: the disk tier writes the checksum kept with the slot, computing
// nothing again: a block whose bytes and recorded checksum disagree fails
// its read from disk (a corruption) rather than being served.
func TestDiskWritesRecordedSum(t *testing.T) {
	dir := t.TempDir()
	m := diskManager(t, dir, 4, 16)
	keys := BlockKeys(DefaultHashSeed, 16, make([]uint32, 16*2))
	req := &Request{ID: "w"}
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		p, _ := s.PrepareStore(keys, req)
		for i, k := range p.Keys {
			slot := m.Arena().Slot(int(p.Slots[i]))
			fill(slot, k)
			crc := crc32.Checksum(slot, crc32c.Table)
			if i == 1 {
				crc ^= 1 // disagrees with the bytes
			}
			m.Arena().SetSum(int(p.Slots[i]), crc)
		}
		s.CompleteStore(p.Keys, req, true)
		s.OnRequestFinished(req)
	})
	waitUntil(t, m, "the cascade to disk", func() bool { return m.Metrics().Tiers[1].ActiveCascades == 0 })
	if err := m.ResetCache(context.Background()); err != nil {
		t.Fatal(err)
	}
	got := promote(t, m, keys)
	if got[0] != Hit || got[1] != Miss {
		t.Errorf("after reading back: %v, want hit then miss", got)
	}
	if v := diskStat(m, "kv_offload_disk_corruptions_total"); v != 1 {
		t.Errorf("corruptions %v, want 1", v)
	}
	// The promoted block's checksum came from the file, verified.
	req2 := &Request{ID: "r2"}
	m.Do(func(s *Step) {
		s.OnNewRequest(req2)
		if s.Lookup(keys[0], req2) == Hit {
			slots, _ := s.PrepareLoad(keys[:1], req2)
			if crc, ok := m.Arena().Sum(int(slots[0])); !ok || crc != crc32.Checksum(m.Arena().Slot(int(slots[0])), crc32c.Table) {
				t.Error("a block read from disk has no verified checksum kept")
			}
			s.CompleteLoad(keys[:1], req2)
		}
		s.OnRequestFinished(req2)
	})
}

// S7.2: a corrupt block that a reader holds pinned is removed too: lookups
// miss it at once and its slot is freed on the reader's last unpin.
func TestScrubPinned(t *testing.T) {
	m := testManager(t, 4)
	keys := BlockKeys(DefaultHashSeed, 16, make([]uint32, 16))
	w, r := &Request{ID: "w"}, &Request{ID: "r"}
	var slot int32
	m.Do(func(s *Step) {
		s.OnNewRequest(w)
		p, _ := s.PrepareStore(keys, w)
		fill(m.Arena().Slot(int(p.Slots[0])), keys[0])
		m.Arena().SetSum(int(p.Slots[0]), crc32.Checksum(m.Arena().Slot(int(p.Slots[0])), crc32c.Table))
		s.CompleteStore(p.Keys, w, true)
		s.OnRequestFinished(w)
		s.OnNewRequest(r)
		if s.Lookup(keys[0], r) != Hit {
			t.Fatal("not stored")
		}
		slots, err := s.PrepareLoad(keys, r) // the reader's pin
		if err != nil {
			t.Fatal(err)
		}
		slot = slots[0]
	})
	m.Arena().Slot(int(slot))[0] ^= 1
	res, err := m.Scrub(context.Background())
	if err != nil || res.Mismatched != 1 {
		t.Fatalf("scrub %+v, %v: want the pinned corrupt block removed", res, err)
	}
	m.Do(func(s *Step) {
		if got := s.Lookup(keys[0], r); got == Hit {
			t.Error("the corrupt block still answers Hit")
		}
		s.CompleteLoad(keys, r)
		s.OnRequestFinished(r)
	})
	if c := m.Metrics().CPU; c.Used != 0 || c.Detached != 0 {
		t.Errorf("%d slots used, %d detached after the reader let go, want none", c.Used, c.Detached)
	}
}

// scrubReplay replays, on a 2-slot CPU tier, what two overlapping scrubs
// (POST /v0/scrub twice) do around a cache reset, with the CPUTier calls
// Scrub makes (found in review):
//
//	A pins k (record e1) | a reset detaches e1 | k is stored again (e2) |
//	B pins k at e2 | A unpins k
//
// It returns the tier, k, and the generation B scrubs.
func scrubReplay(t *testing.T) (*CPUTier, Key, uint64) {
	c := newTestCPU(t, 2, "lru")
	k := testKeys(2)[0]
	store := func(key Key) {
		t.Helper()
		w := RequestOwner("w")
		if _, _, _, ok := c.Reserve([]Key{key}, w); !ok {
			t.Fatalf("reserve %v failed", key)
		}
		c.Commit([]Key{key}, w, true, nil)
		c.endHold()
	}
	store(k)
	if _, err := c.Pin([]Key{k}, scrubOwner(1), false); err != nil { // A
		t.Fatal(err)
	}
	c.Reset()
	store(k)
	gen := c.entries[k].gen
	if _, err := c.Pin([]Key{k}, scrubOwner(2), false); err != nil { // B
		t.Fatal(err)
	}
	if _, err := c.Unpin([]Key{k}, scrubOwner(1)); err != nil { // A's second hold
		t.Fatal(err)
	}
	c.endHold()
	return c, k, gen
}

// While scrub B reads k's slot without the lock it still holds its pin:
// A's unpin releases A's own, detached, record (when every scrub pinned
// as one owner, A's unpin took B's pin off the live record).
func TestScrubPinsAreEachScrubs(t *testing.T) {
	c, k, _ := scrubReplay(t)
	if e := c.entries[k]; len(e.pins) != 1 || e.pins[0].owner != scrubOwner(2) {
		t.Fatalf("scrub B's block %v holds pins %v while B reads it, want B's one", k, e.pins)
	}
	if c.ndetached != 0 {
		t.Fatalf("A's detached record was not released: %d detached", c.ndetached)
	}
}

// A slot's record is reused: after k was evicted and stored again into
// the same slot while scrub B read it, B's drop must not remove the new,
// good block.
func TestScrubDropsOnlyTheWriteItRead(t *testing.T) {
	c, k, gen := scrubReplay(t)
	ks := testKeys(3)
	y, x := ks[1], ks[2]
	slot := c.Slot(k)
	store := func(key Key) {
		t.Helper()
		w := RequestOwner("w2")
		if _, _, _, ok := c.Reserve([]Key{key}, w); !ok {
			t.Fatalf("reserve %v failed", key)
		}
		c.Commit([]Key{key}, w, true, nil)
		c.endHold()
	}
	store(x) // the other slot
	// As if B were done with k: k may be evicted now.
	if _, err := c.Unpin([]Key{k}, scrubOwner(2)); err != nil {
		t.Fatal(err)
	}
	c.Touch([]Key{x})
	store(y) // evicts k, the least recent
	c.Touch([]Key{x})
	store(k) // evicts y: k is back in its slot, a new write in the same record
	if c.Slot(k) != slot {
		t.Fatalf("k went to slot %d, not back to %d: the replay does not reuse the record", c.Slot(k), slot)
	}
	if c.evictions != 2 {
		t.Fatalf("%d evictions, want 2: the replay does not evict k", c.evictions)
	}
	if c.drop(k, gen) {
		t.Errorf("drop removed %v, stored again after the scrub read its slot", k)
	}
	if r := c.Lookup(k); r != Hit {
		t.Errorf("the block stored again: %v, want hit", r)
	}
	if !c.drop(k, c.entries[k].gen) {
		t.Error("drop refused the write it names")
	}
}

// Close while a scrub reads a pinned batch without the lock (the node's
// Shutdown gives POST /v0/scrub 5 s, then closes the manager): Close
// waits for the batch before it unmaps the arena, and the scrub ends with
// ErrClosed (found in review: the scrub read a slot after the munmap and
// faulted).
func TestScrubEndsAtClose(t *testing.T) {
	m := testManager(t, 8)
	keys := BlockKeys(DefaultHashSeed, 16, make([]uint32, 16*3))
	req := &Request{ID: "w"}
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		p, err := s.PrepareStore(keys, req)
		if err != nil || p == nil {
			t.Fatalf("PrepareStore: %v %v", p, err)
		}
		s.CompleteStore(p.Keys, req, true)
		s.OnRequestFinished(req)
	})
	reading, proceed := make(chan struct{}), make(chan struct{})
	testHookScrubRead = func() {
		close(reading)
		<-proceed
	}
	defer func() { testHookScrubRead = nil }()
	scrubbed := make(chan error, 1)
	go func() {
		_, err := m.Scrub(context.Background())
		scrubbed <- err
	}()
	<-reading
	closed := make(chan error, 1)
	go func() { closed <- m.Close() }()
	for deadline := time.Now().Add(10 * time.Second); ; {
		m.lock()
		done := m.mu.closed
		m.mu.Unlock()
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Close did not start within 10 s")
		}
		runtime.Gosched()
	}
	select {
	case <-closed:
		t.Error("Close returned while a scrub was reading the arena")
	case <-time.After(100 * time.Millisecond): // Close must wait: nothing to wait for
	}
	close(proceed)
	if err := <-scrubbed; !errors.Is(err, ErrClosed) {
		t.Errorf("the scrub ended with %v, want ErrClosed", err)
	}
	if err := <-closed; err != nil {
		t.Errorf("Close: %v", err)
	}
}
