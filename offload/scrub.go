package offload

import (
	"context"
	"maps"
	"slices"

	"github.com/kvtier/kvtier/offload/crc32c"
)

// ScrubResult is what one Scrub found.
type ScrubResult struct {
	// Checked is how many ready blocks had their bytes verified.
	Checked int `json:"checked"`
	// Mismatched blocks' bytes disagreed with the CRC32C kept with their
	// slot; they were removed, so they are never served again (S7.2).
	Mismatched int `json:"mismatched"`
	// Unrecorded blocks had no checksum kept (a writer that records none);
	// theirs was computed and kept.
	Unrecorded int `json:"unrecorded"`
}

// testHookScrubRead, when set by a test, runs before a batch's reads.
var testHookScrubRead func()

// scrubBatch is how many blocks a scrub pins at once.
const scrubBatch = 64

// scrubOwner is the owner of the pins of scrub n (n from 1): job ids
// counted down from the top, which no job has (jobs count up from 0), so
// no request's abort can take them away; one of its own for every scrub,
// so that one scrub's unpin never takes another's pin (found in review:
// two scrubs around a cache reset).
func scrubOwner(n uint64) Owner { return JobOwner(^uint64(0) - n + 1) }

// Scrub verifies every ready block of the CPU tier against the CRC32C
// kept with its slot (S7.2). It pins a batch at a time and reads the
// bytes without the lock, so serving goes on beside it; a block whose
// bytes and checksum disagree is removed (a removal event, counted in
// kv_offload_cpu_scrub_mismatches_total). Blocks that arrive while it
// runs may be left for the next scrub. ctx bounds it; once the manager
// closes it ends with ErrClosed, and Close waits for the batch it reads
// (at most scrubBatch blocks).
func (m *Manager) Scrub(ctx context.Context) (ScrubResult, error) {
	var res ScrubResult
	m.lock()
	m.mu.scrubs++
	owner := scrubOwner(m.mu.scrubs)
	keys := slices.Collect(maps.Keys(m.mu.cpu.entries))
	m.unlock()
	arena := m.Arena()
	for len(keys) > 0 {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		batch := keys[:min(scrubBatch, len(keys))]
		keys = keys[len(batch):]
		m.lock()
		if m.mu.closed {
			m.unlock()
			return res, ErrClosed
		}
		var pinned []Key
		var slots []int32
		var gens []uint64 // the writes scrubbed: a slot's record is reused
		for _, k := range batch {
			if e, ok := m.mu.cpu.entries[k]; ok && !e.writing {
				s, _ := m.mu.cpu.Pin([]Key{k}, owner, false)
				pinned, slots, gens = append(pinned, k), append(slots, s[0]), append(gens, e.gen)
			}
		}
		// Close waits for this batch's reads before it unmaps the arena
		// (found in review: a scrub read a slot after the munmap).
		m.scrubbing.Add(1)
		m.unlock()
		if testHookScrubRead != nil {
			testHookScrubRead()
		}
		var bad []int
		for i := range pinned {
			got := crc32c.Checksum(arena.Slot(int(slots[i])))
			switch want, ok := arena.Sum(int(slots[i])); {
			case !ok:
				arena.SetSum(int(slots[i]), got)
				res.Unrecorded++
			case got != want:
				bad = append(bad, i)
			}
			res.Checked++
		}
		m.scrubbing.Done()
		m.lock()
		if m.mu.closed {
			m.unlock()
			return res, ErrClosed
		}
		m.mu.cpu.Unpin(pinned, owner)
		removed := 0
		for _, i := range bad { // the write scrubbed, not whatever holds its key now
			if m.mu.cpu.drop(pinned[i], gens[i]) {
				removed++
			}
		}
		m.unlock()
		res.Mismatched += removed
		if removed > 0 {
			m.log.Error("offload: blocks whose bytes disagree with their checksum were removed", "blocks", removed)
		}
	}
	return res, nil
}
