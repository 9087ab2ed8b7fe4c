package offload

import (
	"context"
	"hash/crc32"
	"testing"

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
