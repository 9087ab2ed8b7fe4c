package cudakv

import (
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// mmapped returns n bytes outside the Go heap, unmapped at the end of t.
func mmapped(t testing.TB, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

// backends opens a mover on every backend this machine has; the CUDA one
// is skipped with the reason when no GPU or driver is present, unless
// KVTIER_REQUIRE_GPU=1 (the GPU bundle sets it) makes that a failure.
func backends(t *testing.T, spec Spec, run func(t *testing.T, m *Mover)) {
	for _, name := range []string{"host", "cuda"} {
		t.Run(name, func(t *testing.T) {
			s := spec
			s.Backend = name
			m, err := Open(s)
			if errors.Is(err, ErrUnavailable) && os.Getenv("KVTIER_REQUIRE_GPU") != "1" {
				t.Skipf("no GPU: %v", err)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := m.Close(); err != nil {
					t.Errorf("Close: %v", err)
				}
			}()
			run(t, m)
		})
	}
}

type copyCase struct {
	layers, seg, batch int
	fused              bool
}

func (c copyCase) String() string {
	kv := "split"
	if c.fused {
		kv = "fused"
	}
	return fmt.Sprintf("L%d/seg%d/batch%d/%s", c.layers, c.seg, c.batch, kv)
}

func copyCases() []copyCase {
	var cs []copyCase
	for _, b := range []int{1, 15, 16, 17, 576} {
		cs = append(cs, copyCase{layers: 2, seg: 2 << 10, batch: b})
	}
	for _, seg := range []int{2 << 10, 4 << 10, 8 << 10, 32 << 10, 64 << 10, 128 << 10} {
		cs = append(cs, copyCase{layers: 3, seg: seg, batch: 17}, copyCase{layers: 3, seg: seg, batch: 17, fused: true})
	}
	// Misaligned sizes take the 4-byte and the byte paths, each loaded
	// without checksums (even batches) and with them (odd ones).
	for _, b := range []int{15, 16} {
		cs = append(cs, copyCase{layers: 2, seg: 2052, batch: b}, copyCase{layers: 2, seg: 2050, batch: b})
	}
	cs = append(cs, copyCase{layers: 3, seg: 4099, batch: 15, fused: true})
	return cs
}

// A byte-exact round trip GPU → CPU → GPU with random ids on both sides;
// destinations poisoned first; blocks and slots outside the batch
// untouched.
func TestRoundTrip(t *testing.T) {
	for _, c := range copyCases() {
		t.Run(c.String(), func(t *testing.T) {
			layout := Layout{Layers: c.layers, Fused: c.fused, SegmentBytes: c.seg, Blocks: c.batch + 3}
			bb := layout.BlockBytes()
			stride := (bb + 4095) / 4096 * 4096
			slots := c.batch + 2
			spec := Spec{Layout: layout, Arena: mmapped(t, slots*stride), SlotStride: stride, Workers: 3, Checksums: true}
			backends(t, spec, func(t *testing.T, m *Mover) { roundTrip(t, m, spec, c, slots) })
		})
	}
}

func roundTrip(t *testing.T, m *Mover, spec Spec, c copyCase, slots int) {
	rng := rand.New(rand.NewPCG(uint64(c.seg), uint64(c.batch)))
	l := spec.Layout
	bb := l.BlockBytes()
	blocks := make([][]byte, l.Blocks)
	for i := range blocks {
		blocks[i] = make([]byte, bb)
		for j := range blocks[i] {
			blocks[i][j] = byte(rng.Uint32())
		}
		if err := m.WriteBlock(i, blocks[i]); err != nil {
			t.Fatal(err)
		}
	}
	for i := range spec.Arena {
		spec.Arena[i] = 0xEE
	}
	gpuIDs, cpuIDs := rng.Perm(l.Blocks)[:c.batch], rng.Perm(slots)[:c.batch]
	pairs := make([]Pair, c.batch)
	for i := range pairs {
		pairs[i] = Pair{GPU: int32(gpuIDs[i]), CPU: int32(cpuIDs[i])}
	}
	tk, err := m.Store(pairs)
	if err != nil {
		t.Fatal(err)
	}
	if err := tk.Wait(); err != nil {
		t.Fatal(err)
	}
	if done, err := tk.Done(); !done || err != nil {
		t.Errorf("Done after Wait = %v, %v", done, err)
	}
	slot := func(s int) []byte { return spec.Arena[s*spec.SlotStride : s*spec.SlotStride+bb] }
	// S7.2: the store computed each block's CRC32C as it copied (the host
	// backend after each segment, the CUDA backend in kv_store_sum).
	switch sums := tk.Sums(); {
	case sums == nil:
		t.Errorf("the %s backend's store computed no checksums", m.Backend())
	default:
		for i, p := range pairs {
			if want := crc32.Checksum(slot(int(p.CPU)), crc32.MakeTable(crc32.Castagnoli)); sums[i] != want {
				t.Fatalf("store: checksum of slot %d %08x, want %08x", p.CPU, sums[i], want)
			}
		}
	}
	inBatch := map[int]bool{}
	for _, p := range pairs {
		inBatch[int(p.CPU)] = true
		if !bytes.Equal(slot(int(p.CPU)), blocks[p.GPU]) {
			t.Fatalf("store: slot %d differs from GPU block %d", p.CPU, p.GPU)
		}
	}
	for s := range slots {
		if !inBatch[s] && !bytes.Equal(slot(s), bytes.Repeat([]byte{0xEE}, bb)) {
			t.Fatalf("store touched slot %d outside the batch", s)
		}
	}
	// Load the slots back into other, poisoned, GPU blocks.
	poison := bytes.Repeat([]byte{0x5A}, bb)
	back := rng.Perm(l.Blocks)[:c.batch]
	want := map[int][]byte{}
	loads := make([]Pair, c.batch)
	for i, p := range pairs {
		loads[i] = Pair{GPU: int32(back[i]), CPU: p.CPU}
		want[back[i]] = blocks[p.GPU]
		if err := m.WriteBlock(back[i], poison); err != nil {
			t.Fatal(err)
		}
	}
	// Odd batches load with the blocks' checksums (kv_load_sum on CUDA),
	// even ones without (kv_load).
	summed := c.batch%2 == 1
	if summed {
		tk, err = m.LoadSummed(loads)
	} else {
		tk, err = m.Load(loads)
	}
	if err != nil {
		t.Fatal(err)
	}
	for {
		done, err := tk.Done()
		if err != nil {
			t.Fatal(err)
		}
		if done {
			break
		}
		tk.Wait()
	}
	switch sums := tk.Sums(); {
	case !summed && sums != nil:
		t.Errorf("a load without checksums returned %d", len(sums))
	case summed && sums == nil:
		t.Errorf("the %s backend's LoadSummed computed no checksums", m.Backend())
	case summed:
		for i, p := range loads {
			if want := crc32.Checksum(want[int(p.GPU)], crc32.MakeTable(crc32.Castagnoli)); sums[i] != want {
				t.Fatalf("load: checksum of GPU block %d %08x, want %08x", p.GPU, sums[i], want)
			}
		}
	}
	got := make([]byte, bb)
	for b := range l.Blocks {
		if err := m.ReadBlock(b, got); err != nil {
			t.Fatal(err)
		}
		var seen []byte // VisitBlock's pieces, in order, are the same bytes
		if err := m.VisitBlock(b, make([]byte, bb), func(p []byte) { seen = append(seen, p...) }); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(seen, got) {
			t.Fatalf("VisitBlock(%d) passes other bytes than ReadBlock reads", b)
		}
		w, ok := want[b]
		if !ok {
			w = blocks[b] // untouched
			if inLoads(back, b) {
				continue
			}
		}
		if !bytes.Equal(got, w) {
			t.Fatalf("load: GPU block %d (in batch %v) holds the wrong bytes", b, ok)
		}
	}
}

func inLoads(ids []int, b int) bool {
	for _, x := range ids {
		if x == b {
			return true
		}
	}
	return false
}

// Out-of-range ids are an error and nothing is copied.
func TestBadPairs(t *testing.T) {
	layout := Layout{Layers: 2, SegmentBytes: 1024, Blocks: 4}
	spec := Spec{Layout: layout, Arena: mmapped(t, 4*4096), SlotStride: 4096}
	backends(t, spec, func(t *testing.T, m *Mover) {
		for _, p := range []Pair{{GPU: 4}, {GPU: -1}, {CPU: 4}, {CPU: -2}} {
			spec.Arena[0] = 0x11
			if _, err := m.Store([]Pair{{0, 0}, p}); !errors.Is(err, ErrBadPair) {
				t.Errorf("Store(%v) = %v, want ErrBadPair", p, err)
			}
			if _, err := m.Load([]Pair{p}); !errors.Is(err, ErrBadPair) {
				t.Errorf("Load(%v) = %v, want ErrBadPair", p, err)
			}
			if spec.Arena[0] != 0x11 {
				t.Error("a rejected batch copied something")
			}
		}
		if err := m.WriteBlock(0, make([]byte, 7)); !errors.Is(err, ErrBadSpec) {
			t.Errorf("WriteBlock with a short buffer: %v", err)
		}
		if err := m.ReadBlock(9, make([]byte, layout.BlockBytes())); !errors.Is(err, ErrBadPair) {
			t.Errorf("ReadBlock(9): %v", err)
		}
	})
}

func TestSpecValidation(t *testing.T) {
	good := Spec{Layout: Layout{Layers: 2, SegmentBytes: 1024, Blocks: 4}, Arena: make([]byte, 8192), SlotStride: 4096, Backend: "host"}
	for name, edit := range map[string]func(s *Spec){
		"layers":      func(s *Spec) { s.Layout.Layers = 0 },
		"segment":     func(s *Spec) { s.Layout.SegmentBytes = 0 },
		"blocks":      func(s *Spec) { s.Layout.Blocks = 0 },
		"stride":      func(s *Spec) { s.Layout.BlockStride = 10 },
		"slot stride": func(s *Spec) { s.SlotStride = 100 },
		"arena":       func(s *Spec) { s.Arena = make([]byte, 10) },
		"threads":     func(s *Spec) { s.Threads = 100 },
		"backend":     func(s *Spec) { s.Backend = "tpu" },
	} {
		s := good
		edit(&s)
		if _, err := Open(s); !errors.Is(err, ErrBadSpec) {
			t.Errorf("%s: Open = %v, want ErrBadSpec", name, err)
		}
	}
	m, err := Open(good)
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	if err := m.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := m.Store(nil); !errors.Is(err, ErrClosed) {
		t.Errorf("Store after Close: %v", err)
	}
}

// "auto" answers with a backend on every machine: the GPU when one is
// usable, else the host.
func TestAuto(t *testing.T) {
	spec := Spec{Layout: Layout{Layers: 1, SegmentBytes: 1024, Blocks: 2}, Arena: mmapped(t, 8192), SlotStride: 4096}
	m, err := Open(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	_, cudaErr := DeviceCount()
	if (cudaErr != nil) != (m.Backend() == "host") {
		t.Errorf("backend %q with DeviceCount error %v", m.Backend(), cudaErr)
	}
	t.Logf("auto picked %s (CUDA: %v)", m.Backend(), cudaErr)
}

// The host backend's checksums go through Spec.CRC32C when it is set (p2pd
// passes a faster CRC32C than hash/crc32's), for stores and summed loads
// alike, and give the same CRC32Cs.
func TestHostCRC32CHook(t *testing.T) {
	layout := Layout{Layers: 3, SegmentBytes: 4 << 10, Blocks: 4}
	bb := layout.BlockBytes()
	stride := (bb + 4095) / 4096 * 4096
	calls := 0 // one worker: no concurrent updates
	spec := Spec{Layout: layout, Arena: mmapped(t, 4*stride), SlotStride: stride, Backend: "host", Workers: 1, Checksums: true,
		CRC32C: func(crc uint32, p []byte) uint32 {
			calls++
			return crc32.Update(crc, crc32.MakeTable(crc32.Castagnoli), p)
		}}
	m, err := Open(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	block := make([]byte, bb)
	for i := range block {
		block[i] = byte(i * 7)
	}
	want := crc32.Checksum(block, crc32.MakeTable(crc32.Castagnoli))
	if err := m.WriteBlock(1, block); err != nil {
		t.Fatal(err)
	}
	pairs := []Pair{{GPU: 1, CPU: 2}}
	st, err := m.Store(pairs)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Wait(); err != nil {
		t.Fatal(err)
	}
	ld, err := m.LoadSummed([]Pair{{GPU: 3, CPU: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ld.Wait(); err != nil {
		t.Fatal(err)
	}
	for op, sums := range map[string][]uint32{"store": st.Sums(), "load": ld.Sums()} {
		if len(sums) != 1 || sums[0] != want {
			t.Errorf("%s sums %#x, want [%#x]", op, sums, want)
		}
	}
	if segs := layout.Segments(); calls != 2*segs {
		t.Errorf("Spec.CRC32C called %d times, want %d (each segment of the store and of the load)", calls, 2*segs)
	}
}
