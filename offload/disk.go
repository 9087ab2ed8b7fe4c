package offload

import (
	"bytes"
	"container/list"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvtier/kvtier/offload/crc32c"
)

// DiskConfig configures the disk tier; it is part of Config, so its keys
// sit at the top level of the JSON config.
type DiskConfig struct {
	// DiskDir is the directory of block files; empty means no disk tier.
	DiskDir string `json:"disk_dir"`
	// DiskBytes caps the bytes of block files. The cap in force is never
	// more than 90 % of the free space found at start (plus what the tier
	// already holds).
	DiskBytes int64 `json:"disk_bytes"`
	// DiskWorkers is the number of I/O goroutines.
	DiskWorkers int `json:"disk_workers"`
	// DiskFsync syncs each block file and its directory before the block
	// counts as stored.
	DiskFsync bool `json:"disk_fsync"`
}

// DefaultDiskConfig returns the disk defaults: no directory, 16 GiB, 4
// workers, no fsync.
func DefaultDiskConfig() DiskConfig {
	return DiskConfig{DiskBytes: 16 << 30, DiskWorkers: 4}
}

// Validate reports the first bad disk value, naming its key.
func (c *DiskConfig) Validate() error {
	if c.DiskDir == "" {
		return nil
	}
	if c.DiskBytes <= 0 {
		return fmt.Errorf("%w: disk_bytes: %d is not positive", ErrConfig, c.DiskBytes)
	}
	if c.DiskWorkers < 1 || c.DiskWorkers > 256 {
		return fmt.Errorf("%w: disk_workers: %d is not in [1, 256]", ErrConfig, c.DiskWorkers)
	}
	return nil
}

// DiskTier returns the spec of a disk tier over cfg.DiskDir: a local,
// polled tier named "disk".
func DiskTier(cfg DiskConfig) TierSpec {
	return TierSpec{Name: "disk", Medium: MediumStorage, Locality: Local, Polled: true,
		New: func(env TierEnv) (Tier, error) { return OpenDisk(cfg, env) }}
}

// Block files: a 64-byte header, then the block. The header: magic,
// version, block length, key, CRC32C, and the first 8 bytes of the node's
// config fingerprint (S1.1), so that a node restarted on the same
// directory with another KV layout or key scheme of the same block size
// never serves the old blocks as its own (version 1 files had none).
const (
	diskHeaderLen = 64
	diskVersion   = 2
	diskShards    = 256
	tmpPrefix     = ".tmp-"
)

var (
	diskMagic  = [4]byte{'K', 'V', 'T', 'B'}
	errCorrupt = errors.New("offload: corrupt block file")
)

// Disk is the disk tier: a directory of block files in 256 sharded
// subdirectories, LRU-evicted under a byte cap. Files are written to a
// temporary name and renamed; each carries a CRC32C verified on read. A
// corrupt, truncated, missing or unreadable file is a miss and is
// removed; a failed write drops that block's store (S8.4). I/O runs on a
// bounded pool of worker goroutines, which wake the poll goroutine when
// jobs finish.
type Disk struct {
	dir        string
	fsync      bool
	blockBytes int
	fileBytes  int64
	capacity   int64
	layout     [8]byte  // the config fingerprint's first bytes, in every header
	lock       *os.File // disk_dir/.lock, held (flock) while the tier is open
	arena      *Arena
	wake       func()
	emit       func(Event) // nil until start-up is done
	log        *slog.Logger
	tmpSeq     atomic.Uint64
	workers    sync.WaitGroup

	mu struct {
		sync.Mutex
		work    *sync.Cond
		closed  bool
		closeBy time.Time // Close's grace: queued I/O taken after it fails, not done
		undone  int       // the queued reads and writes failed so
		index   map[Key]*diskEntry
		lru     *list.List // of Key, least recent first
		writing map[Key]bool
		queue   []diskTask
		jobs    map[uint64]*diskJob
		done    []JobResult
		used    int64
		st      diskStats
	}
}

type diskEntry struct {
	elem    *list.Element
	readers int
	// retryAt: the process was out of file descriptors when it was last
	// read; until then the block answers Miss (fdRetry).
	retryAt time.Time
}

// fdRetry is how long a block that could not be opened for want of file
// descriptors answers Miss: each lookup would otherwise promote it and
// fail at once, as fast as the engine steps.
const fdRetry = time.Second

type diskJob struct {
	job       *Job
	remaining int
	ok        bool
	succeeded []Key
	bytes     int64
	start     time.Time
}

type diskTask struct {
	dj *diskJob
	i  int // index into the job's keys
}

type diskStats struct {
	readBytes, writeBytes     uint64
	readSeconds, writeSeconds float64
	evictions, corruptions    uint64
	droppedStores             uint64
}

// OpenDisk opens (creating if needed) the disk tier in cfg.DiskDir and
// rebuilds its index from the files there, removing partial ones.
func OpenDisk(cfg DiskConfig, env TierEnv) (*Disk, error) {
	if cfg.DiskDir == "" {
		return nil, fmt.Errorf("%w: disk_dir: empty", ErrConfig)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := env.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &Disk{dir: cfg.DiskDir, fsync: cfg.DiskFsync, blockBytes: env.Arena.SlotBytes(), arena: env.Arena, wake: env.Wake, log: log}
	if fp, err := hex.DecodeString(env.Fingerprint); err == nil && len(fp) >= len(d.layout) {
		copy(d.layout[:], fp)
	}
	d.fileBytes = int64(diskHeaderLen + d.blockBytes)
	d.mu.work = sync.NewCond(&d.mu.Mutex)
	d.mu.index = make(map[Key]*diskEntry)
	d.mu.lru = list.New()
	d.mu.writing = make(map[Key]bool)
	d.mu.jobs = make(map[uint64]*diskJob)
	if err := os.MkdirAll(d.dir, 0o700); err != nil {
		return nil, fmt.Errorf("offload: disk_dir: %w", err)
	}
	if err := d.lockDir(); err != nil {
		return nil, err
	}
	opened := false
	defer func() {
		if !opened && d.lock != nil {
			d.lock.Close()
		}
	}()
	for i := range diskShards {
		if err := os.MkdirAll(d.shard(i), 0o700); err != nil {
			return nil, fmt.Errorf("offload: disk_dir: %w", err)
		}
	}
	existing, err := d.rebuild()
	if err != nil {
		return nil, err
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(d.dir, &sfs); err != nil {
		return nil, fmt.Errorf("offload: disk_dir: statfs: %w", err)
	}
	d.capacity = diskCapacity(cfg.DiskBytes, int64(sfs.Bavail)*int64(sfs.Bsize), existing)
	if d.capacity < d.fileBytes {
		return nil, fmt.Errorf("%w: disk_bytes: the cap in force, %d bytes, holds no block of %d bytes (free space in %s is too low?)",
			ErrConfig, d.capacity, d.fileBytes, d.dir)
	}
	opened = true
	d.mu.Lock()
	d.evictLocked() // reports nothing: what start-up evicts was never reported stored
	d.emit = env.Emit
	d.mu.Unlock()
	log.Info("disk tier open", "dir", d.dir, "blocks", len(d.mu.index), "capacity_bytes", d.capacity)
	for range cfg.DiskWorkers {
		d.workers.Go(d.worker)
	}
	return d, nil
}

// lockDir takes disk_dir's lock file for the tier's life: two daemons on
// one directory would evict and delete each other's blocks and fill it
// twice over. Only a lock another tier holds refuses the start: where
// the lock cannot be taken at all (a read-only mount, a file system
// without flock, a .lock of another user) the tier runs without it, as
// it did before it had one, and says so.
func (d *Disk) lockDir() error {
	p := filepath.Join(d.dir, ".lock")
	f, err := os.Open(p) // flock needs no write access
	if errors.Is(err, fs.ErrNotExist) {
		f, err = os.OpenFile(p, os.O_RDONLY|os.O_CREATE, 0o644)
	}
	if err == nil {
		if err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
		}
	}
	switch {
	case err == nil:
		d.lock = f
	case errors.Is(err, unix.EWOULDBLOCK):
		return fmt.Errorf("offload: disk_dir %s is in use by another disk tier (its .lock is held): give each node its own", d.dir)
	default:
		d.log.Warn("disk tier: running without disk_dir's lock; a second daemon on the directory would not be refused", "path", p, "err", err)
	}
	return nil
}

// diskCapacity is the configured cap, but never more than 90 % of the
// free space plus what the tier already holds.
func diskCapacity(configured, free, existing int64) int64 {
	return min(configured, (free+existing)/10*9)
}

func (d *Disk) shard(i int) string { return filepath.Join(d.dir, fmt.Sprintf("%02x", i)) }

func (d *Disk) path(k Key) string {
	return filepath.Join(d.shard(int(k[0])), hex.EncodeToString(k[:]))
}

// rebuild indexes the block files in the directory, oldest first, and
// removes temporary and malformed files. It returns the bytes indexed.
func (d *Disk) rebuild() (int64, error) {
	type found struct {
		key   Key
		mtime time.Time
	}
	var files []found
	for i := range diskShards {
		ents, err := os.ReadDir(d.shard(i))
		if err != nil {
			return 0, fmt.Errorf("offload: disk_dir: %w", err)
		}
		for _, e := range ents {
			p := filepath.Join(d.shard(i), e.Name())
			if !e.Type().IsRegular() {
				continue
			}
			var k Key
			info, err := e.Info()
			name := e.Name()
			if len(name) == 2*KeySize {
				if _, derr := hex.Decode(k[:], []byte(name)); derr != nil {
					err = derr
				}
			}
			switch {
			case strings.HasPrefix(name, tmpPrefix):
				d.log.Info("disk tier: removing a partial file", "path", p)
				os.Remove(p)
			case err != nil || len(name) != 2*KeySize || name != hex.EncodeToString(k[:]) || int(k[0]) != i:
				// Only the name write gives k counts: another spelling of
				// it (upper case) would be a second file of one key.
				d.log.Warn("disk tier: ignoring a file it did not write", "path", p)
			case info.Size() != d.fileBytes:
				d.log.Warn("disk tier: removing a block file of the wrong size", "path", p, "size", info.Size(), "want", d.fileBytes)
				os.Remove(p)
			default:
				files = append(files, found{k, info.ModTime()})
			}
		}
	}
	slices.SortFunc(files, func(a, b found) int { return a.mtime.Compare(b.mtime) })
	for _, f := range files {
		d.mu.index[f.key] = &diskEntry{elem: d.mu.lru.PushBack(f.key)}
	}
	d.mu.used = int64(len(files)) * d.fileBytes
	return d.mu.used, nil
}

// Lookup implements Tier: Hit for an indexed block, else Miss. The index
// lives in memory, so the tier never needs to answer Retry.
func (d *Disk) Lookup(k Key, _ *Request) Result {
	d.mu.Lock()
	defer d.mu.Unlock()
	if e, ok := d.mu.index[k]; ok && (e.retryAt.IsZero() || !time.Now().Before(e.retryAt)) {
		return Hit
	}
	return Miss
}

// SubmitStore implements Tier: blocks not yet on disk are queued for
// writing.
func (d *Disk) SubmitStore(job *Job) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dj := &diskJob{job: job, ok: true, start: time.Now()}
	for i, k := range job.Keys {
		if _, ok := d.mu.index[k]; ok || d.mu.writing[k] {
			continue
		}
		d.mu.writing[k] = true
		d.mu.queue = append(d.mu.queue, diskTask{dj, i})
		dj.remaining++
	}
	d.startLocked(dj)
}

// SubmitLoad implements Tier: indexed blocks are queued for reading into
// the job's slots; the others fail at once.
func (d *Disk) SubmitLoad(job *Job) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dj := &diskJob{job: job, ok: true, start: time.Now()}
	for i, k := range job.Keys {
		e, ok := d.mu.index[k]
		if !ok {
			dj.ok = false
			continue
		}
		e.readers++
		d.mu.queue = append(d.mu.queue, diskTask{dj, i})
		dj.remaining++
	}
	d.startLocked(dj)
}

func (d *Disk) startLocked(dj *diskJob) {
	if dj.remaining == 0 {
		d.finishLocked(dj)
		return
	}
	d.mu.jobs[dj.job.ID] = dj
	d.mu.work.Broadcast()
}

func (d *Disk) finishLocked(dj *diskJob) {
	delete(d.mu.jobs, dj.job.ID)
	r := JobResult{ID: dj.job.ID, OK: dj.ok, Bytes: dj.bytes, Duration: time.Since(dj.start)}
	if !dj.ok && dj.job.Promotion {
		r.Succeeded = dj.succeeded
	}
	d.mu.done = append(d.mu.done, r)
	if d.wake != nil {
		d.wake()
	}
}

// Finished implements Tier.
func (d *Disk) Finished() []JobResult {
	d.mu.Lock()
	defer d.mu.Unlock()
	r := d.mu.done
	d.mu.done = nil
	return r
}

// Pending implements Pender: jobs in flight or results not collected.
func (d *Disk) Pending() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.mu.jobs) > 0 || len(d.mu.done) > 0
}

// reportLocked reports that k was stored on or removed from disk (S2.8).
func (d *Disk) reportLocked(kind EventKind, k Key) {
	if d.emit != nil {
		d.emit(Event{Kind: kind, Keys: []Key{k}})
	}
}

// diskCloseGrace bounds how long Close goes on with the queued I/O
// (S5.5: the drain is bounded); what is still queued then fails undone
// (stores dropped, promotions failed), and Close waits only for the reads
// and writes under way, one a worker. A variable so a test can shorten it.
var diskCloseGrace = 5 * time.Second

// Close lets the workers finish the queued I/O for diskCloseGrace at most
// and stops them.
func (d *Disk) Close() error {
	d.mu.Lock()
	again := d.mu.closed
	if !again {
		d.mu.closed = true
		d.mu.closeBy = time.Now().Add(diskCloseGrace)
		d.mu.work.Broadcast()
	}
	d.mu.Unlock()
	d.workers.Wait()
	if again || d.lock == nil {
		return nil
	}
	if d.mu.undone > 0 {
		d.log.Warn("disk tier: closed with queued I/O undone", "reads_and_writes", d.mu.undone, "grace", diskCloseGrace)
	}
	return d.lock.Close() // and its lock with it
}

func (d *Disk) worker() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for {
		for len(d.mu.queue) == 0 && !d.mu.closed {
			d.mu.work.Wait()
		}
		if len(d.mu.queue) == 0 {
			return
		}
		t := d.mu.queue[0]
		d.mu.queue = d.mu.queue[1:]
		j := t.dj.job
		k, si := j.Keys[t.i], int(j.Slots[t.i])
		slot := d.arena.Slot(si)
		if d.mu.closed && !time.Now().Before(d.mu.closeBy) {
			d.mu.undone++
			t.dj.ok = false
			if j.Promotion {
				if e := d.mu.index[k]; e != nil {
					e.readers--
				}
			} else {
				delete(d.mu.writing, k)
				d.mu.st.droppedStores++
			}
			if t.dj.remaining--; t.dj.remaining == 0 {
				d.finishLocked(t.dj)
			}
			continue
		}
		d.mu.Unlock()
		start := time.Now()
		var err error
		if j.Promotion {
			var crc uint32
			if crc, err = d.read(k, slot); err == nil {
				d.arena.SetSum(si, crc) // verified against the file's (S7.2)
			}
		} else {
			err = d.write(k, slot, d.arena.SumOf(si))
		}
		took := time.Since(start)
		d.mu.Lock()
		if j.Promotion {
			d.readDoneLocked(t.dj, k, err, took)
		} else {
			d.writeDoneLocked(t.dj, k, err, took)
		}
		if t.dj.remaining--; t.dj.remaining == 0 {
			d.finishLocked(t.dj)
		}
	}
}

// write stores one block with its CRC32C (the slot's, recorded when the
// block entered the CPU tier, S7.2): a temporary file, then a rename.
func (d *Disk) write(k Key, block []byte, crc uint32) error {
	var hdr [diskHeaderLen]byte
	copy(hdr[0:4], diskMagic[:])
	binary.LittleEndian.PutUint32(hdr[4:8], diskVersion)
	binary.LittleEndian.PutUint64(hdr[8:16], uint64(len(block)))
	copy(hdr[16:48], k[:])
	binary.LittleEndian.PutUint32(hdr[48:52], crc)
	copy(hdr[52:60], d.layout[:])
	final := d.path(k)
	tmp := filepath.Join(filepath.Dir(final), fmt.Sprintf("%s%x-%d", tmpPrefix, k[:8], d.tmpSeq.Add(1)))
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600) // prompt-derived: the node's own
	if err != nil {
		return err
	}
	_, err = f.Write(hdr[:])
	if err == nil {
		_, err = f.Write(block)
	}
	if err == nil && d.fsync {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, final)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	if d.fsync {
		if err := syncDir(filepath.Dir(final)); err != nil {
			os.Remove(final) // not indexed: it must not stay, uncounted, until a restart finds it
			return err
		}
	}
	return nil
}

// syncDir makes a rename in dir durable (disk_fsync). A variable so a
// test can make it fail.
var syncDir = syncDirDefault

// openBlock opens a block file to read. A variable so a test can make it
// fail.
var openBlock = func(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
}

func syncDirDefault(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// read loads one block into slot and verifies it. It opens without
// following a link and without blocking (a FIFO put in the file's place
// would hang the worker), and reads only a regular file.
func (d *Disk) read(k Key, slot []byte) (uint32, error) {
	f, err := openBlock(d.path(k))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		return 0, err
	} else if !fi.Mode().IsRegular() {
		return 0, fmt.Errorf("%w: not a regular file (%v)", errCorrupt, fi.Mode().Type())
	}
	// Ask for the whole file at once rather than letting readahead ramp up
	// from a small window on every file.
	unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_WILLNEED)
	var hdr [diskHeaderLen]byte
	if _, err := io.ReadFull(f, hdr[:]); err != nil {
		return 0, fmt.Errorf("%w: header: %w", errCorrupt, err)
	}
	switch {
	case !bytes.Equal(hdr[0:4], diskMagic[:]) || binary.LittleEndian.Uint32(hdr[4:8]) != diskVersion:
		return 0, fmt.Errorf("%w: bad magic or version", errCorrupt)
	case binary.LittleEndian.Uint64(hdr[8:16]) != uint64(len(slot)):
		return 0, fmt.Errorf("%w: block length %d, want %d", errCorrupt, binary.LittleEndian.Uint64(hdr[8:16]), len(slot))
	case !bytes.Equal(hdr[16:48], k[:]):
		return 0, fmt.Errorf("%w: the file holds another key", errCorrupt)
	case !bytes.Equal(hdr[52:60], d.layout[:]):
		return 0, fmt.Errorf("%w: written under another config fingerprint (KV layout or key scheme)", errCorrupt)
	}
	if _, err := io.ReadFull(f, slot); err != nil {
		return 0, fmt.Errorf("%w: body: %w", errCorrupt, err)
	}
	got, want := crc32c.Checksum(slot), binary.LittleEndian.Uint32(hdr[48:52])
	if got != want {
		return 0, fmt.Errorf("%w: crc32c %08x, want %08x", errCorrupt, got, want)
	}
	return got, nil
}

func (d *Disk) writeDoneLocked(dj *diskJob, k Key, err error, took time.Duration) {
	delete(d.mu.writing, k)
	if err != nil {
		dj.ok = false
		d.mu.st.droppedStores++
		d.log.Warn("disk tier: store dropped", "key", k, "err", err)
		return
	}
	d.mu.st.writeBytes += uint64(d.blockBytes)
	d.mu.st.writeSeconds += took.Seconds()
	dj.bytes += int64(d.blockBytes)
	if _, ok := d.mu.index[k]; !ok {
		d.mu.index[k] = &diskEntry{elem: d.mu.lru.PushBack(k)}
		d.mu.used += d.fileBytes
		d.reportLocked(EventStored, k)
	}
	d.evictLocked()
}

func (d *Disk) readDoneLocked(dj *diskJob, k Key, err error, took time.Duration) {
	e := d.mu.index[k]
	if e != nil {
		e.readers--
	}
	if err != nil {
		dj.ok = false
		if errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) {
			if e != nil {
				e.retryAt = time.Now().Add(fdRetry) // the block is fine: read it later
			}
			d.log.Warn("disk tier: read failed; out of file descriptors", "key", k, "err", err, "miss_for", fdRetry)
			return
		}
		// Corrupt, missing, or unreadable (a permission, a link, an I/O
		// error): kept, it would answer Hit and fail every promotion again.
		d.mu.st.corruptions++
		d.log.Warn("disk tier: block unreadable; removed", "key", k, "err", err)
		if e != nil && e.readers == 0 {
			d.removeLocked(k)
		}
		return
	}
	d.mu.st.readBytes += uint64(d.blockBytes)
	d.mu.st.readSeconds += took.Seconds()
	dj.bytes += int64(d.blockBytes)
	dj.succeeded = append(dj.succeeded, k)
	if e != nil {
		d.mu.lru.MoveToBack(e.elem)
	}
}

// removeLocked forgets k and deletes its file (under the lock, so a new
// write of the same key cannot race the unlink).
func (d *Disk) removeLocked(k Key) {
	e := d.mu.index[k]
	d.mu.lru.Remove(e.elem)
	delete(d.mu.index, k)
	d.mu.used -= d.fileBytes
	if err := os.Remove(d.path(k)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		d.log.Warn("disk tier: removing a block file", "key", k, "err", err)
	}
	d.reportLocked(EventRemoved, k)
}

// evictLocked removes least recently used blocks not being read until the
// tier fits its cap.
func (d *Disk) evictLocked() {
	for el := d.mu.lru.Front(); el != nil && d.mu.used > d.capacity; {
		next := el.Next()
		k := el.Value.(Key)
		if d.mu.index[k].readers == 0 {
			d.removeLocked(k)
			d.mu.st.evictions++
		}
		el = next
	}
}

// Stats implements StatsReporter.
func (d *Disk) Stats() []Stat {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.mu.st
	return []Stat{
		{"kv_offload_disk_blocks", "gauge", "Blocks stored in the disk tier.", float64(len(d.mu.index)), nil, nil},
		{"kv_offload_disk_used_bytes", "gauge", "Bytes of block files in the disk tier.", float64(d.mu.used), nil, nil},
		{"kv_offload_disk_capacity_bytes", "gauge", "The disk tier's cap in force.", float64(d.capacity), nil, nil},
		{"kv_offload_disk_queue_depth", "gauge", "Block reads and writes waiting for a disk worker.", float64(len(d.mu.queue)), nil, nil},
		{"kv_offload_disk_read_bytes_total", "counter", "Block bytes read from disk and verified.", float64(s.readBytes), nil, nil},
		{"kv_offload_disk_read_seconds_total", "counter", "Time disk workers spent reading blocks.", s.readSeconds, nil, nil},
		{"kv_offload_disk_write_bytes_total", "counter", "Block bytes written to disk.", float64(s.writeBytes), nil, nil},
		{"kv_offload_disk_write_seconds_total", "counter", "Time disk workers spent writing blocks.", s.writeSeconds, nil, nil},
		{"kv_offload_disk_evictions_total", "counter", "Blocks evicted from the disk tier to fit its cap.", float64(s.evictions), nil, nil},
		{"kv_offload_disk_corruptions_total", "counter", "Block files found corrupt, truncated, missing, unreadable or of another config fingerprint on read, and removed.", float64(s.corruptions), nil, nil},
		{"kv_offload_disk_dropped_stores_total", "counter", "Block writes dropped because the disk failed (full, unwritable).", float64(s.droppedStores), nil, nil},
	}
}

var (
	_ Tier          = (*Disk)(nil)
	_ Pender        = (*Disk)(nil)
	_ StatsReporter = (*Disk)(nil)
	_ io.Closer     = (*Disk)(nil)
)
