package offload

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// diskManager opens a manager with a tiny-geometry CPU tier of slots slots
// and a disk tier in dir capped at capBlocks blocks.
func diskManager(t *testing.T, dir string, slots, capBlocks int) *Manager {
	t.Helper()
	m, err := diskManagerGeom(t, dir, Geometries["tiny"], slots, capBlocks)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// waitUntil waits, on the manager's progress signal, until cond holds.
func waitUntil(t *testing.T, m *Manager, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for !cond() {
		select {
		case <-m.Progress():
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func fill(b []byte, k Key) {
	for i := range b {
		b[i] = k[i%KeySize] + byte(i/KeySize)
	}
}

// storeBlocks stores keys through m (so they cascade to disk) and waits
// until the disk holds them.
func storeBlocks(t *testing.T, m *Manager, keys []Key) {
	t.Helper()
	req := &Request{ID: "writer-" + keys[0].String()}
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		p, err := s.PrepareStore(keys, req)
		if err != nil || p == nil {
			t.Fatalf("PrepareStore: %v %v", p, err)
		}
		for i, k := range p.Keys {
			fill(m.Arena().Slot(int(p.Slots[i])), k)
		}
		s.CompleteStore(p.Keys, req, true)
		s.OnRequestFinished(req)
	})
	waitUntil(t, m, "the cascade to disk", func() bool { return m.Metrics().Tiers[1].ActiveCascades == 0 })
}

// promote looks keys up until each is a hit or a miss and returns the
// answers, checking the bytes of the hits.
func promote(t *testing.T, m *Manager, keys []Key) []Result {
	t.Helper()
	req := &Request{ID: "reader"}
	m.Do(func(s *Step) { s.OnNewRequest(req) })
	defer m.Do(func(s *Step) { s.OnRequestFinished(req) })
	out := make([]Result, len(keys))
	waitUntil(t, m, "promotions", func() bool {
		done := true
		m.Do(func(s *Step) {
			for i, k := range keys {
				out[i] = s.Lookup(k, req)
				done = done && (out[i] == Hit || out[i] == Miss)
			}
		})
		return done
	})
	want := make([]byte, m.BlockBytes())
	for i, k := range keys {
		if out[i] != Hit {
			continue
		}
		fill(want, k)
		m.Do(func(s *Step) {
			slots, err := s.PrepareLoad([]Key{k}, req)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(m.Arena().Slot(int(slots[0])), want) {
				t.Errorf("block %v promoted from disk holds the wrong bytes", k)
			}
			s.CompleteLoad([]Key{k}, req)
		})
	}
	return out
}

func diskStat(m *Manager, name string) float64 {
	for _, s := range m.Metrics().Tiers[1].Stats {
		if s.Name == name {
			return s.Value
		}
	}
	return -1
}

// Blocks cascade to sharded files and promote back byte for byte; a
// restarted tier rebuilds its index and removes partial files.
func TestDiskRoundTrip(t *testing.T) {
	dir := t.TempDir()
	keys := testKeys(4)
	m := diskManager(t, dir, 8, 16)
	storeBlocks(t, m, keys)
	p := filepath.Join(dir, strings.ToLower(keys[0].String()[:2]))
	if ents, _ := os.ReadDir(p); len(ents) == 0 {
		t.Errorf("no block file in shard %s", p)
	}
	if err := m.ResetCache(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := promote(t, m, keys); !equalResults(got, Hit) {
		t.Errorf("after a CPU reset: %v, want hits from disk", got)
	}
	m.Close()

	partial := filepath.Join(dir, "00", tmpPrefix+"abc-1")
	os.WriteFile(partial, []byte("half a block"), 0o644)
	m2 := diskManager(t, dir, 8, 16)
	if _, err := os.Stat(partial); !os.IsNotExist(err) {
		t.Error("a partial file survived the restart")
	}
	if n := diskStat(m2, "kv_offload_disk_blocks"); n != 4 {
		t.Errorf("restarted tier indexed %v blocks, want 4", n)
	}
	if got := promote(t, m2, keys); !equalResults(got, Hit) {
		t.Errorf("after a restart: %v, want hits", got)
	}
}

func equalResults(rs []Result, want Result) bool {
	for _, r := range rs {
		if r != want {
			return false
		}
	}
	return true
}

// S8.4: a corrupt, truncated or missing file is a miss, is removed and is
// counted; the tier keeps serving the other blocks.
func TestDiskCorruption(t *testing.T) {
	dir := t.TempDir()
	keys := testKeys(4)
	m := diskManager(t, dir, 8, 16)
	storeBlocks(t, m, keys)
	m.ResetCache(context.Background())
	path := func(k Key) string { return m.mu.tiers[0].(*Disk).path(k) }
	b, _ := os.ReadFile(path(keys[0]))
	b[diskHeaderLen+5] ^= 0xff // a flipped bit
	os.WriteFile(path(keys[0]), b, 0o644)
	os.Truncate(path(keys[1]), diskHeaderLen+10)
	os.Remove(path(keys[2]))
	got := promote(t, m, keys)
	if want := []Result{Miss, Miss, Miss, Hit}; !slicesEqual(got, want) {
		t.Errorf("promotions %v, want %v", got, want)
	}
	if n := diskStat(m, "kv_offload_disk_corruptions_total"); n != 3 {
		t.Errorf("corruptions counted %v, want 3", n)
	}
	for _, k := range keys[:2] {
		if _, err := os.Stat(path(k)); !os.IsNotExist(err) {
			t.Errorf("corrupt file %v not removed", k)
		}
	}
	if n := diskStat(m, "kv_offload_disk_blocks"); n != 1 {
		t.Errorf("index holds %v blocks, want 1", n)
	}
}

func slicesEqual(a, b []Result) bool { return string(resultBytes(a)) == string(resultBytes(b)) }

func resultBytes(rs []Result) []byte {
	out := make([]byte, len(rs))
	for i, r := range rs {
		out[i] = byte(r)
	}
	return out
}

// The byte cap evicts least recently used blocks and reports them.
func TestDiskEviction(t *testing.T) {
	dir := t.TempDir()
	keys := testKeys(5)
	m := diskManager(t, dir, 8, 3)
	sub := m.Subscribe(0)
	defer sub.Close()
	for _, k := range keys {
		storeBlocks(t, m, []Key{k})
	}
	if n := diskStat(m, "kv_offload_disk_evictions_total"); n != 2 {
		t.Errorf("evictions %v, want 2", n)
	}
	var removed []Key
	for _, e := range sub.Take() {
		if e.Tier == "disk" && e.Removed {
			removed = append(removed, e.Keys...)
		}
	}
	if len(removed) != 2 || removed[0] != keys[0] || removed[1] != keys[1] {
		t.Errorf("removed %v, want the two oldest", removed)
	}
	m.ResetCache(context.Background())
	if got := promote(t, m, keys); !slicesEqual(got, []Result{Miss, Miss, Hit, Hit, Hit}) {
		t.Errorf("after eviction: %v", got)
	}
}

// S8.4: an unwritable shard drops the store, counts it and never fails
// the daemon; stores to other shards still work.
func TestDiskUnwritable(t *testing.T) {
	dir := t.TempDir()
	keys := testKeys(16)
	m := diskManager(t, dir, 32, 64)
	bad := filepath.Join(dir, keys[0].String()[:2])
	os.RemoveAll(bad)
	os.WriteFile(bad, nil, 0o644) // the shard is now a file: every write fails
	storeBlocks(t, m, keys)
	dropped := diskStat(m, "kv_offload_disk_dropped_stores_total")
	if dropped < 1 {
		t.Errorf("dropped stores %v, want at least 1", dropped)
	}
	if n := diskStat(m, "kv_offload_disk_blocks"); n != 16-dropped {
		t.Errorf("blocks stored %v, want %v", n, 16-dropped)
	}
	if m.Metrics().Tiers[1].CascadeFailures != 1 {
		t.Errorf("cascade failures %d, want 1", m.Metrics().Tiers[1].CascadeFailures)
	}
}

// The cap in force is at most 90 % of the free space found at start.
func TestDiskCapacity(t *testing.T) {
	for _, c := range []struct{ conf, free, existing, want int64 }{
		{16 << 30, 100 << 30, 0, 16 << 30},
		{16 << 30, 10 << 30, 0, 9 << 30},
		{16 << 30, 10 << 30, 10 << 30, 16 << 30},
		{32 << 30, 10 << 30, 10 << 30, 18 << 30},
		{16 << 30, 0, 0, 0},
	} {
		if got := diskCapacity(c.conf, c.free, c.existing); got != c.want {
			t.Errorf("diskCapacity(%d, %d, %d) = %d, want %d", c.conf, c.free, c.existing, got, c.want)
		}
	}
	cfg := DefaultDiskConfig()
	cfg.DiskDir = t.TempDir()
	cfg.DiskWorkers = 0
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "disk_workers") {
		t.Errorf("disk_workers 0: %v", err)
	}
}

// Closing the manager stops the disk workers: no goroutine is left.
func TestDiskNoLeak(t *testing.T) {
	before := runtime.NumGoroutine()
	cfg := DefaultConfig()
	cfg.Geometry = Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = 8 * int64(cfg.slotStride())
	cfg.DiskDir = t.TempDir()
	m, err := New(cfg, DiskTier(cfg.DiskConfig))
	if err != nil {
		t.Fatal(err)
	}
	storeBlocks(t, m, testKeys(2))
	m.Close()
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines after Close, %d before", runtime.NumGoroutine(), before)
		}
		runtime.Gosched()
	}
}

// The disk tier's metrics pass promtool's lint.
func TestDiskMetricsLint(t *testing.T) {
	m := diskManager(t, t.TempDir(), 4, 8)
	var buf bytes.Buffer
	if err := m.Metrics().WritePrometheus(&buf); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), `kv_offload_disk_capacity_bytes{tier="disk"}`) {
		t.Fatal("no disk metrics in the text")
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = &buf
	if out, err := cmd.CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("promtool: %v\n%s", err, out)
	}
}

// S8.4: with disk_fsync, a store whose directory sync fails is dropped
// and leaves no file: the file was renamed into place but not indexed, so
// it stayed on disk, uncounted against disk_bytes, until a restart.
func TestDiskDirSyncFailureLeavesNoFile(t *testing.T) {
	syncDir = func(string) error { return errors.New("injected: directory fsync failed") }
	t.Cleanup(func() { syncDir = syncDirDefault })
	dir := t.TempDir()
	cfg := DefaultConfig()
	cfg.Geometry = Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(32 * cfg.slotStride())
	cfg.DiskDir, cfg.DiskFsync, cfg.DiskWorkers = dir, true, 2
	cfg.DiskBytes = 64 * int64(diskHeaderLen+cfg.Geometry.BlockBytes())
	m, err := New(cfg, DiskTier(cfg.DiskConfig))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	keys := testKeys(4)
	storeBlocks(t, m, keys)
	if v := diskStat(m, "kv_offload_disk_dropped_stores_total"); v != 4 {
		t.Errorf("dropped stores %v, want 4", v)
	}
	var files []string
	filepath.WalkDir(dir, func(path string, e os.DirEntry, err error) error {
		if err == nil && e.Type().IsRegular() && path != filepath.Join(dir, ".lock") {
			files = append(files, path)
		}
		return nil
	})
	if len(files) != 0 {
		t.Errorf("files left after every store failed: %v", files)
	}
}

// diskManagerGeom is diskManager with a geometry of the caller's; the
// error is New's.
func diskManagerGeom(t *testing.T, dir string, g Geometry, slots, capBlocks int) (*Manager, error) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Geometry = g
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(slots * cfg.slotStride())
	cfg.DiskDir = dir
	cfg.DiskBytes = int64(capBlocks) * int64(diskHeaderLen+cfg.Geometry.BlockBytes())
	cfg.DiskWorkers = 2
	m, err := New(cfg, DiskTier(cfg.DiskConfig))
	if err == nil {
		t.Cleanup(func() { m.Close() })
	}
	return m, err
}

// S8.4 (found in review): a file whose name starts with a key's 64 hex
// digits and goes on is one the tier did not write: ignored. Its decoding
// ran past the key and failed the start.
func TestDiskIgnoresLongHexName(t *testing.T) {
	dir := t.TempDir()
	k := testKeys(1)[0]
	shard := filepath.Join(dir, hex.EncodeToString(k[:1]))
	os.MkdirAll(shard, 0o755)
	os.WriteFile(filepath.Join(shard, hex.EncodeToString(k[:])+"00"), []byte("not ours"), 0o644)
	if _, err := diskManagerGeom(t, dir, Geometries["tiny"], 8, 16); err != nil {
		t.Fatalf("a foreign file with a long hex name failed the start: %v", err)
	}
}

// S8.4, S2.11 (found in review): a copy of a block file under the
// upper-case spelling of its key's name is ignored. It was indexed as a
// second file of the same key (used counted both, the LRU held two
// elements for one entry), and the evictions that followed dereferenced
// a missing entry in a disk worker: the process died.
func TestDiskIgnoresOtherSpellingOfAKey(t *testing.T) {
	dir := t.TempDir()
	keys := testKeys(8)
	m, err := diskManagerGeom(t, dir, Geometries["tiny"], 16, 16)
	if err != nil {
		t.Fatal(err)
	}
	storeBlocks(t, m, keys[:4])
	m.Close()
	lower := (&Disk{dir: dir}).path(keys[0])
	upper := filepath.Join(filepath.Dir(lower), strings.ToUpper(filepath.Base(lower)))
	b, err := os.ReadFile(lower)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(upper, b, 0o644); err != nil {
		t.Fatal(err)
	}
	m2, err := diskManagerGeom(t, dir, Geometries["tiny"], 16, 5)
	if err != nil {
		t.Fatal(err)
	}
	file := float64(m2.mu.tiers[0].(*Disk).fileBytes)
	if n, used := diskStat(m2, "kv_offload_disk_blocks"), diskStat(m2, "kv_offload_disk_used_bytes"); n != 4 || used != 4*file {
		t.Fatalf("%v blocks in %v bytes, want 4 blocks in 4 files' bytes", n, used)
	}
	for _, k := range keys[4:] { // each store evicts one
		storeBlocks(t, m2, []Key{k})
	}
	if _, err := os.Stat(upper); err != nil {
		t.Errorf("the file the tier did not write: %v, want it left alone", err)
	}
}

// S7.2, S1.1 (found in review): a node restarted on the same disk_dir
// with another KV layout of the same block size (layers × kv_heads 2 × 2
// become 4 × 1) does not serve the old blocks as its own: the header
// carries the config fingerprint, and a block of another one misses (and
// goes). Every CRC matched, so they were promoted.
func TestDiskOtherLayoutMisses(t *testing.T) {
	dir := t.TempDir()
	keys := testKeys(3)
	g1 := Geometries["tiny"]
	m, err := diskManagerGeom(t, dir, g1, 8, 16)
	if err != nil {
		t.Fatal(err)
	}
	storeBlocks(t, m, keys)
	m.Close()
	g2 := g1
	g2.Layers, g2.KVHeads = 2*g1.Layers, g1.KVHeads/2
	if g2.BlockBytes() != g1.BlockBytes() || Fingerprint(g1, DefaultHashSeed, "") == Fingerprint(g2, DefaultHashSeed, "") {
		t.Fatal("test setup: want the same block size and another fingerprint")
	}
	m2, err := diskManagerGeom(t, dir, g2, 8, 16)
	if err != nil {
		t.Fatal(err)
	}
	if got := promote(t, m2, keys); !equalResults(got, Miss) {
		t.Errorf("a node of layout %+v promoted %v from blocks written under layout %+v, want misses", g2, got, g1)
	}
	if n := diskStat(m2, "kv_offload_disk_blocks"); n != 0 {
		t.Errorf("%v blocks of the other layout still indexed, want none", n)
	}
}

// S8.4, S4.1 (found in review): a block file that cannot be opened for a
// reason other than "not there" (a symlink loop here; a permission or an
// I/O error alike) is dropped like a corrupt one. It stayed indexed, so
// each lookup answered Hit and its promotion failed, again and again
// until hit_pending_timeout, for every request (100,517 failed
// promotions for two requests in a second).
func TestDiskUnopenableFileMisses(t *testing.T) {
	m, keys := onDiskOnly(t, 2)
	p := m.mu.tiers[0].(*Disk).path(keys[0])
	os.Remove(p)
	if err := os.Symlink(filepath.Base(p), p); err != nil { // a loop: ELOOP
		t.Fatal(err)
	}
	for i := range 2 {
		req := &Request{ID: fmt.Sprint("reader-", i)}
		m.Do(func(s *Step) { s.OnNewRequest(req) })
		var r Result
		waitUntil(t, m, "the lookup to settle", func() bool {
			m.Do(func(s *Step) { r = s.Lookup(keys[0], req) })
			return r == Hit || r == Miss
		})
		m.Do(func(s *Step) { s.OnRequestFinished(req) })
		if r != Miss {
			t.Errorf("request %d: %v, want a miss", i, r)
		}
	}
	if n := m.Metrics().Tiers[1].PromotionFailures; n != 1 {
		t.Errorf("%d failed promotions of one unreadable block, want 1", n)
	}
	if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the unreadable file: %v, want it removed", err)
	}
}

// S8.4 (found in review): a FIFO put in place of a block file does not
// hang the worker that reads it (it blocked in open(2), and Close waited
// for it for ever): the block misses and goes.
func TestDiskFIFOInPlaceMisses(t *testing.T) {
	m, keys := onDiskOnly(t, 1)
	p := m.mu.tiers[0].(*Disk).path(keys[0])
	os.Remove(p)
	if err := unix.Mkfifo(p, 0o644); err != nil {
		t.Skip("mkfifo:", err)
	}
	defer func() { // were the worker blocked in open, a writer lets it go
		if f, err := os.OpenFile(p, os.O_WRONLY|unix.O_NONBLOCK, 0); err == nil {
			f.Close()
		}
	}()
	if got := promote(t, m, keys); !equalResults(got, Miss) {
		t.Errorf("a FIFO in place of a block file: %v, want a miss", got)
	}
	// The read failed (rather than the manager's bound running out on a
	// worker stuck in open): the block is gone from the index.
	if n, c := diskStat(m, "kv_offload_disk_blocks"), diskStat(m, "kv_offload_disk_corruptions_total"); n != 0 || c != 1 {
		t.Errorf("%v blocks indexed, %v found unreadable; want 0 and 1", n, c)
	}
}

// S8.4 (found in review): a block the process could not open for want of
// file descriptors stays (it is fine) but answers Miss for fdRetry. It
// answered Hit at once again, and each lookup promoted it and failed, as
// fast as the engine stepped (35,466 failed promotions in 300 ms).
func TestDiskOutOfFDsBacksOff(t *testing.T) {
	m, keys := onDiskOnly(t, 1)
	defer func(f func(string) (*os.File, error)) { openBlock = f }(openBlock)
	openBlock = func(path string) (*os.File, error) {
		return nil, &fs.PathError{Op: "open", Path: path, Err: unix.EMFILE}
	}
	req := &Request{ID: "reader"}
	m.Do(func(s *Step) { s.OnNewRequest(req) })
	defer m.Do(func(s *Step) { s.OnRequestFinished(req) })
	var r Result
	waitUntil(t, m, "the lookup to settle", func() bool {
		m.Do(func(s *Step) { r = s.Lookup(keys[0], req) })
		return r == Hit || r == Miss
	})
	for range 100 { // as an engine stepping on its progress signal
		m.Do(func(s *Step) { r = s.Lookup(keys[0], req) })
	}
	if n := m.Metrics().Tiers[1].PromotionFailures; r != Miss || n != 1 {
		t.Errorf("out of fds: the block answers %v after %d failed promotions, want miss after 1", r, n)
	}
	if n := diskStat(m, "kv_offload_disk_blocks"); n != 1 {
		t.Errorf("%v blocks indexed, want the block kept", n)
	}
	d := m.mu.tiers[0].(*Disk)
	d.mu.Lock()
	d.mu.index[keys[0]].retryAt = time.Now().Add(-time.Second) // fdRetry passed
	d.mu.Unlock()
	if got := d.Lookup(keys[0], req); got != Hit {
		t.Errorf("after fdRetry the block answers %v, want hit", got)
	}
}

// onDiskOnly is a manager whose n blocks are on disk only: stored, then
// the CPU tier reset.
func onDiskOnly(t *testing.T, n int) (*Manager, []Key) {
	t.Helper()
	m := diskManager(t, t.TempDir(), 8, 64)
	keys := testKeys(n)
	storeBlocks(t, m, keys)
	if err := m.ResetCache(context.Background()); err != nil {
		t.Fatal(err)
	}
	return m, keys
}

// Found in review: two disk tiers on one disk_dir (two daemons) would
// evict and delete each other's blocks; the second is refused while the
// first holds the directory's lock, and gets it once the first closed.
// Block files are the node's own (0600).
func TestDiskDirLocked(t *testing.T) {
	dir := t.TempDir()
	m, err := diskManagerGeom(t, dir, Geometries["tiny"], 8, 16)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := diskManagerGeom(t, dir, Geometries["tiny"], 8, 16); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("a second disk tier on the directory: %v, want refused", err)
	}
	keys := testKeys(1)
	storeBlocks(t, m, keys)
	if fi, err := os.Stat(m.mu.tiers[0].(*Disk).path(keys[0])); err != nil {
		t.Error(err)
	} else if fi.Mode().Perm() != 0o600 {
		t.Errorf("a block file's mode %v, want 0600", fi.Mode().Perm())
	}
	m.Close()
	if _, err := diskManagerGeom(t, dir, Geometries["tiny"], 8, 16); err != nil {
		t.Errorf("a disk tier on the directory after the first closed: %v", err)
	}
}

// S5.5, the drain is bounded (found in review): Close goes on with the
// queued I/O for diskCloseGrace only, then fails what is still queued
// (stores dropped) and waits just for the write under way. It did every
// queued read and write first, however long the disk took.
func TestDiskCloseBounded(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	syncDir = func(string) error { // the first write stalls, the others do not
		first := false
		once.Do(func() { first = true })
		if first {
			close(entered)
			<-release
		}
		return nil
	}
	defer func() { syncDir = syncDirDefault }()
	defer func(g time.Duration) { diskCloseGrace = g }(diskCloseGrace)
	diskCloseGrace = 0
	cfg := DefaultConfig()
	cfg.Geometry = Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(16 * cfg.slotStride())
	cfg.DiskDir, cfg.DiskFsync, cfg.DiskWorkers = t.TempDir(), true, 1
	cfg.DiskBytes = 64 * int64(diskHeaderLen+cfg.Geometry.BlockBytes())
	m, err := New(cfg, DiskTier(cfg.DiskConfig))
	if err != nil {
		t.Fatal(err)
	}
	d := m.mu.tiers[0].(*Disk)
	keys := testKeys(8)
	req := &Request{ID: "writer"}
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		p, err := s.PrepareStore(keys, req)
		if err != nil || p == nil {
			t.Fatalf("PrepareStore: %v %v", p, err)
		}
		s.CompleteStore(p.Keys, req, true) // eight writes queued for one worker
	})
	<-entered
	closed := make(chan error, 1)
	go func() { closed <- m.Close() }()
	for deadline := time.Now().Add(10 * time.Second); ; runtime.Gosched() {
		d.mu.Lock()
		closing := d.mu.closed
		d.mu.Unlock()
		if closing {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Close did not start")
		}
	}
	close(release) // the grace (0) has run out
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if d.mu.undone != 7 || d.mu.st.droppedStores != 7 || len(d.mu.index) != 1 {
		t.Errorf("Close left %d undone, %d stores dropped, %d blocks stored; want 7, 7 and the one under way", d.mu.undone, d.mu.st.droppedStores, len(d.mu.index))
	}
}

// Found in review: where disk_dir's lock cannot be taken at all (here a
// .lock that leads nowhere; a read-only mount, a file system without
// flock or another user's .lock alike) the tier runs without it, as it
// did before it had one; the start failed. Close twice is one Close.
func TestDiskRunsWithoutLockItCannotTake(t *testing.T) {
	dir := t.TempDir()
	if err := os.Symlink(filepath.Join(dir, "gone", "lock"), filepath.Join(dir, ".lock")); err != nil {
		t.Fatal(err)
	}
	m, err := diskManagerGeom(t, dir, Geometries["tiny"], 8, 16)
	if err != nil {
		t.Fatalf("a disk_dir whose lock cannot be taken: %v, want the tier running without it", err)
	}
	storeBlocks(t, m, testKeys(1))
	d := m.mu.tiers[0].(*Disk)
	if err := d.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Errorf("a second Close: %v", err)
	}
}
