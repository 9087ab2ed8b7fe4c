package offload

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkDisk is B8: the disk tier writes, then reads back, 1 GiB of
// 1.75 MiB blocks (qwen3-0.6b) with its default 4 workers, beside plain
// sequential os.File I/O of the same bytes to one file in the same
// directory, in the same iteration. A write counts until the file system
// has the bytes on the device (syncfs after each side), so the page cache's
// dirty-page throttling does not decide the ratio. Before each read both
// sides' files are dropped from the page cache (fadvise DONTNEED), so reads
// come from the device. It reports GB/s for both and the ratio (x-plain, target
// ≥ 0.8).
func BenchmarkDisk(b *testing.B) {
	g := Geometries["qwen3-0.6b"]
	n := (1 << 30) / g.BlockBytes()
	arena, err := NewArena(n, g.BlockBytes(), ArenaOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer arena.Close()
	keys := testKeys(n)
	slots := make([]int32, n)
	for i := range slots {
		slots[i] = int32(i)
		fill(arena.Slot(i), keys[i])
	}
	total := float64(n * g.BlockBytes())
	root := b.TempDir()
	wake := make(chan struct{}, 1)
	open := func(dir string) *Disk {
		d, err := OpenDisk(DiskConfig{DiskDir: dir, DiskBytes: 4 << 30, DiskWorkers: 4},
			TierEnv{Arena: arena, Wake: func() { signal(wake) }})
		if err != nil {
			b.Fatal(err)
		}
		return d
	}
	run := func(d *Disk, promotion bool, id uint64) {
		j := &Job{ID: id, Promotion: promotion, Keys: keys, Slots: slots}
		if promotion {
			d.SubmitLoad(j)
		} else {
			d.SubmitStore(j)
		}
		for {
			<-wake
			if r := d.Finished(); len(r) > 0 {
				if !r[0].OK {
					b.Fatalf("disk job failed: %+v", r[0])
				}
				return
			}
		}
	}
	plain := func(path string, write bool) {
		flag := os.O_RDONLY
		if write {
			flag = os.O_WRONLY | os.O_CREATE | os.O_TRUNC
		}
		f, err := os.OpenFile(path, flag, 0o644)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		for i := range n {
			if write {
				_, err = f.Write(arena.Slot(i))
			} else {
				_, err = f.Read(arena.Slot(i))
			}
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	report := func(b *testing.B, tier, base time.Duration) {
		b.ReportMetric(total*float64(b.N)/tier.Seconds()/1e9, "GB/s")
		b.ReportMetric(total*float64(b.N)/base.Seconds()/1e9, "GB/s-plain")
		b.ReportMetric(base.Seconds()/tier.Seconds(), "x-plain")
	}

	b.Run("write", func(b *testing.B) {
		var tier, base time.Duration
		i := 0
		for b.Loop() {
			dir := filepath.Join(root, fmt.Sprintf("w%d", i))
			i++
			d := open(dir)
			syncfs(b, dir) // start with no dirty pages
			t0 := time.Now()
			run(d, false, 1)
			syncfs(b, dir)
			tier += time.Since(t0)
			d.Close()
			t1 := time.Now()
			plain(filepath.Join(dir, "plain"), true)
			syncfs(b, dir)
			base += time.Since(t1)
			os.RemoveAll(dir)
		}
		report(b, tier, base)
	})

	b.Run("read", func(b *testing.B) {
		dir := filepath.Join(root, "r")
		d := open(dir)
		defer d.Close()
		run(d, false, 1)
		plainPath := filepath.Join(dir, "plain")
		plain(plainPath, true)
		var tier, base time.Duration
		for b.Loop() {
			b.StopTimer()
			for _, k := range keys {
				dropCache(b, d.path(k))
			}
			dropCache(b, plainPath)
			b.StartTimer()
			t0 := time.Now()
			run(d, true, 2)
			tier += time.Since(t0)
			t1 := time.Now()
			plain(plainPath, false)
			base += time.Since(t1)
		}
		report(b, tier, base)
	})
}

// syncfs writes back every dirty page of the file system holding dir.
func syncfs(b *testing.B, dir string) {
	f, err := os.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		b.Fatal(err)
	}
}

// dropCache writes a file's dirty pages back and drops it from the page
// cache.
func dropCache(b *testing.B, path string) {
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	unix.Fdatasync(int(f.Fd()))
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		b.Fatal(err)
	}
}
