package offload

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

// S1.2: one mapping of equal page-aligned slots outside the Go heap; mlock
// and huge pages optional and their outcome reported.
func TestArena(t *testing.T) {
	page := os.Getpagesize()
	a, err := NewArena(3, page+1, ArenaOptions{Lock: true, HugePages: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if a.Stride() != 2*page || a.Len() != 6*page || a.SlotBytes() != page+1 {
		t.Errorf("stride %d, len %d, slot bytes %d; want %d, %d, %d", a.Stride(), a.Len(), a.SlotBytes(), 2*page, 6*page, page+1)
	}
	if a.Base()%uintptr(page) != 0 {
		t.Errorf("base %#x is not page aligned", a.Base())
	}
	if a.RequestedLockBytes() != int64(a.Len()) {
		t.Errorf("requested lock bytes %d, want %d", a.RequestedLockBytes(), a.Len())
	}
	// Either the lock worked or its failure is reported; never both.
	if (a.LockedBytes == int64(a.Len())) == (a.LockErr != nil) {
		t.Errorf("locked %d bytes with error %v: want all bytes xor an error", a.LockedBytes, a.LockErr)
	}
	s1 := a.Slot(1)
	for i := range s1 {
		s1[i] = 0xAB
	}
	if a.Slot(0)[len(a.Slot(0))-1] != 0 || a.Slot(2)[0] != 0 {
		t.Error("writing slot 1 touched a neighbour")
	}
	if len(s1) != page+1 || cap(s1) != page+1 {
		t.Errorf("slot len %d cap %d, want %d", len(s1), cap(s1), page+1)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := NewArena(0, 10, ArenaOptions{}); err == nil {
		t.Error("zero slots accepted")
	}
}

// TestArenaHugePages: an arena that asks for huge pages gets them where
// the kernel offers transparent huge pages on request. They must be asked
// for before the pages are faulted in: the arena once madvised after
// MAP_POPULATE and held none (and a 1 GiB arena took ~30 ms to unmap at
// exit instead of about one).
func TestArenaHugePages(t *testing.T) {
	mode, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil || !strings.Contains(string(mode), "[always]") && !strings.Contains(string(mode), "[madvise]") {
		t.Skipf("no transparent huge pages on request here (%q, %v)", mode, err)
	}
	a, err := NewArena(8, 1<<20, ArenaOptions{HugePages: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if a.HugePagesErr != nil {
		t.Skipf("madvise refused: %v", a.HugePagesErr)
	}
	if got := anonHugeKB(t, a.Base()); got < 2048 {
		t.Fatalf("an 8 MiB arena that asked for huge pages holds %d KiB of them, want at least one 2 MiB page", got)
	}
}

// anonHugeKB is AnonHugePages of the mapping that contains addr, from
// /proc/self/smaps.
func anonHugeKB(t *testing.T, addr uintptr) int {
	b, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Skip(err)
	}
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if lo, hi, ok := strings.Cut(f[0], "-"); ok && len(f) >= 5 {
			l, err1 := strconv.ParseUint(lo, 16, 64)
			h, err2 := strconv.ParseUint(hi, 16, 64)
			in = err1 == nil && err2 == nil && uint64(addr) >= l && uint64(addr) < h
			continue
		}
		if in && f[0] == "AnonHugePages:" && len(f) >= 2 {
			kb, _ := strconv.Atoi(f[1])
			return kb
		}
	}
	t.Fatalf("no mapping in /proc/self/smaps holds %#x", addr)
	return 0
}
