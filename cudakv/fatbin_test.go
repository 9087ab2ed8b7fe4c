package cudakv

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"strings"
	"testing"
)

// The committed fatbin must be built from the committed kernel source:
// editing kernels/copy.cu without `make generate` fails here.
func TestFatbinCurrent(t *testing.T) {
	src, err := os.ReadFile("kernels/copy.cu")
	if err != nil {
		t.Fatal(err)
	}
	stamp, err := os.ReadFile("kernels/copy.cu.sha256")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(src)
	recorded, _, _ := strings.Cut(string(stamp), " ")
	if recorded != hex.EncodeToString(sum[:]) {
		t.Fatalf("kernels/copy.cu changed since the fatbin was built (sha256 %x, recorded %s): run make generate", sum, recorded)
	}
	if fi, err := os.Stat("kernels/copy.fatbin"); err != nil || fi.Size() == 0 {
		t.Fatalf("kernels/copy.fatbin missing or empty: %v", err)
	}
}
