package offload

import (
	"os"
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
