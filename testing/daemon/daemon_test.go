package daemon

import (
	"os"
	"testing"
	"time"
)

// statCPU adds utime and stime (USER_HZ ticks) whatever the command name
// holds.
func TestStatCPU(t *testing.T) {
	for _, c := range []struct {
		line string
		want float64
		ok   bool
	}{
		{"42 (p2pd) S 1 42 42 0 -1 4194560 100 0 0 0 250 130 0 0 20 0 9 0 77 0 0\n", 3.80, true},
		{"42 (a) b) (c) R 1 42 42 0 -1 0 0 0 0 0 7 3 0 0 20 0 1 0 77 0 0\n", 0.10, true},
		{"42 (p2pd) S 1 42\n", 0, false},
		{"42 (p2pd) S 1 42 42 0 -1 0 0 0 0 0 x 3 0\n", 0, false},
		{"", 0, false},
	} {
		got, err := statCPU(c.line)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("statCPU(%q) = %v, %v; want %v (ok %v)", c.line, got, err, c.want, c.ok)
		}
	}
}

// CPUSeconds of this process grows while it spins.
func TestCPUSecondsGrows(t *testing.T) {
	s0, err := CPUSeconds(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for x := 0; time.Now().Before(deadline); x++ {
		if x%1_000_000 != 0 {
			continue
		}
		s1, err := CPUSeconds(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		if s1 >= s0+0.05 {
			return
		}
	}
	t.Fatalf("CPUSeconds stayed at %v while the test spun for 10 s", s0)
}
