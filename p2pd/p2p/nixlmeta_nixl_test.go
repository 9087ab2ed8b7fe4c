//go:build nixl

package p2p

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/kvtier/kvtier/nixlgo"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/vllmwire"
	"github.com/kvtier/kvtier/p2pd/wire"
	"github.com/kvtier/kvtier/p2pd/zmtp"
)

const r4Slot = 4096

// r4Plane is a vLLM-mode NIXL plane over slots slots of 4 KiB (stride =
// size, as vLLM's wire needs).
func r4Plane(t *testing.T, id string, slots int) *NIXLPlane {
	t.Helper()
	ar, err := offload.NewArena(slots, r4Slot, offload.ArenaOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ar.Close() })
	self := wire.Hello{NodeID: id}
	copy(self.Incarnation[:], id)
	p, err := NewNIXLPlane(ar, self, NIXLConfig{VLLM: true, Drain: 100 * time.Millisecond}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// connectInfo is what vconnect hands AddPeer for p's connect.
func connectInfo(p *NIXLPlane, numBlocks uint64) []byte {
	md, base := p.VLLMRegion()
	return vllmInfo(vllmwire.Msg{BaseAddr: uint64(base), BlockLen: r4Slot, NumBlocks: numBlocks, AgentMetadata: md})
}

// write writes local slot l of n into remote slot r of peer, with a
// driving a's progress (an expectation, as a vLLM consumer would poll).
func r4Write(t *testing.T, n, a *NIXLPlane, peer string, round uint64, l, r uint32) error {
	t.Helper()
	a.Expect("n:1", round, []uint32{r}, func(error) {})
	defer a.Unexpect("n:1", round, func() {})
	done := make(chan error, 1)
	n.Write(peer, round, []SlotPair{{Local: l, Remote: r}}, func(err error) { done <- err })
	return wait(t, done, "write")
}

// Found in review: in vLLM mode a peer's agent_metadata is not tied to
// its identity, and NIXLPlane keys agents by name (byAgent) without
// checking that the name is not another peer's. Peer B replaying A's
// connect (A's metadata and base: A gives them to any peer it
// handshakes with) is added and overwrites byAgent[A's agent]; when B's
// session ends, leave() finds the name gone from byAgent and invalidates
// A's agent while A's session lives: every later write to A fails.
func TestNIXLMetaAgentAlias(t *testing.T) {
	n, a := r4Plane(t, "node-n", 8), r4Plane(t, "node-a", 8)
	if err := n.AddPeer("a:1", "a:1", connectInfo(a, 8)); err != nil {
		t.Fatal(err)
	}
	if err := a.AddPeer("n:1", "n:1", connectInfo(n, 8)); err != nil {
		t.Fatal(err)
	}
	for i := range 8 {
		s := n.arena.Slot(i)
		for j := range s {
			s[j] = byte(i + 1)
		}
	}
	if err := r4Write(t, n, a, "a:1", 1, 0, 0); err != nil {
		t.Fatalf("a write to A: %v", err)
	}
	err := n.AddPeer("b:1", "b:1", connectInfo(a, 8)) // B's connect: A's region
	if err == nil {
		t.Errorf("peer B was added with peer A's NIXL agent (%s): want it refused", n.peers["b:1"].agent)
		if err := r4Write(t, n, a, "b:1", 2, 3, 5); err == nil && bytes.Equal(a.arena.Slot(5), n.arena.Slot(3)) {
			t.Logf("a write for B landed in A's slot 5 (B could write there itself with A's rkeys: not the bug)")
		}
		removed := make(chan struct{})
		n.RemovePeer("b:1", func() { close(removed) })
		wait(t, removed, "RemovePeer(B)")
	}
	if err := r4Write(t, n, a, "a:1", 3, 6, 6); err != nil || !bytes.Equal(a.arena.Slot(6), n.arena.Slot(6)) {
		t.Errorf("after B's session ended, a write to A: %v (landed: %v)", err, bytes.Equal(a.arena.Slot(6), n.arena.Slot(6)))
	}
}

// Found in review: metadata that names another peer's agent and fails
// to load makes NIXL drop that agent's remote section
// (nixlAgentData::loadRemoteSections erases it on any error), while
// NIXLPlane still holds A's prepared list: the connect is refused, but
// every later write to A fails (this NIXL detects it in makeXferReq;
// older ones, whose prepared lists point at the freed rkeys, do not).
func TestNIXLMetaBadMetadataNamingAnotherAgent(t *testing.T) {
	n, a := r4Plane(t, "node-n", 8), r4Plane(t, "node-a", 8)
	if err := n.AddPeer("a:1", "a:1", connectInfo(a, 8)); err != nil {
		t.Fatal(err)
	}
	if err := a.AddPeer("n:1", "n:1", connectInfo(n, 8)); err != nil {
		t.Fatal(err)
	}
	md, base := a.VLLMRegion()
	i := bytes.Index(md, []byte("MemSection|"))
	if i < 0 {
		t.Fatal("no MemSection in A's metadata")
	}
	bad := md[:i+len("MemSection|")] // A's name and UCX address, then no memory section
	err := n.AddPeer("b:1", "b:1", vllmInfo(vllmwire.Msg{BaseAddr: uint64(base), BlockLen: r4Slot, NumBlocks: 8, AgentMetadata: bad}))
	t.Logf("B's connect: %v", err)
	for i := range n.arena.Slot(2) {
		n.arena.Slot(2)[i] = 0x5a
	}
	if err := r4Write(t, n, a, "a:1", 1, 2, 2); err != nil || !bytes.Equal(a.arena.Slot(2), n.arena.Slot(2)) {
		t.Errorf("after B's refused connect naming A's agent, a write to A: %v (landed: %v)", err, bytes.Equal(a.arena.Slot(2), n.arena.Slot(2)))
	}
}

// Found in review: agent_metadata is handed to NIXL unchecked;
// corrupt the memory section (the packed UCX rkeys) of a valid blob under
// a fresh agent name and see whether loading it crashes the node.
func TestNIXLMetaGarbageMetadata(t *testing.T) {
	n, a := r4Plane(t, "node-n", 8), r4Plane(t, "node-a", 8)
	md, base := a.VLLMRegion()
	name := []byte("node-a-6e6f6465")
	at := bytes.Index(md, []byte("MemSection|"))
	if at < 0 || bytes.Index(md, name) < 0 {
		t.Fatalf("unexpected metadata %q", md)
	}
	rnd := uint64(1)
	next := func() uint64 { rnd ^= rnd << 13; rnd ^= rnd >> 7; rnd ^= rnd << 17; return rnd }
	ok, failed := 0, 0
	for i := range 2000 {
		m := bytes.Replace(md, name, []byte(fmt.Sprintf("node-x-%08x", i)), 1)
		var flips []string
		for range 1 + next()%4 {
			j := at + int(next()%uint64(len(m)-at))
			x := byte(1 + next()%255)
			flips = append(flips, fmt.Sprintf("byte %d (MemSection+%d) %#02x^%#02x", j, j-at, m[j], x))
			m[j] ^= x
		}
		fmt.Fprintf(os.Stderr, "blob %d (%d bytes, MemSection at %d): %s\n", i, len(m), at, strings.Join(flips, ", "))
		peer := fmt.Sprint("x", i, ":1")
		if err := n.AddPeer(peer, peer, vllmInfo(vllmwire.Msg{BaseAddr: uint64(base), BlockLen: r4Slot, NumBlocks: 8, AgentMetadata: m})); err != nil {
			failed++
			continue
		}
		ok++
		removed := make(chan struct{})
		n.RemovePeer(peer, func() { close(removed) })
		wait(t, removed, "RemovePeer")
	}
	t.Logf("2000 corrupted metadata blobs: %d loaded, %d refused, no crash", ok, failed)
}

// Found in review: one byte of a peer's agent_metadata — the memory
// type of its registration (DRAM_SEG is 0) — set out of range crashes
// the node in NIXL's loadRemoteMD (SIGSEGV in nixlMemSection::emplace):
// any vLLM peer can kill the daemon with one connect.
func TestNIXLMetaMemTypeCrash(t *testing.T) {
	n, a := r4Plane(t, "node-n", 8), r4Plane(t, "node-a", 8)
	md, base := a.VLLMRegion()
	m := bytes.Replace(md, []byte("node-a-6e6f6465"), []byte("node-x-00000000"), 1) // a name of its own
	i := bytes.Index(m, []byte("nixlSDList|t")) + len("nixlSDList|t") + 8 + 3       // the list's memory type (4 bytes, little-endian): its top byte
	t.Logf("setting byte %d (%#02x) to 0x63", i, m[i])
	m[i] = 0x63
	os.Stderr.Sync()
	err := n.AddPeer("x:1", "x:1", vllmInfo(vllmwire.Msg{BaseAddr: uint64(base), BlockLen: r4Slot, NumBlocks: 8, AgentMetadata: m}))
	t.Logf("survived: %v", err)
}

// hostileAgent is a NIXL agent that registered size bytes of reserved
// address space (nothing touched): its metadata and base.
func hostileAgent(t *testing.T, name string, size int) ([]byte, uintptr) {
	t.Helper()
	mem, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON|syscall.MAP_NORESERVE)
	if err != nil {
		t.Skip(err)
	}
	t.Cleanup(func() { syscall.Munmap(mem) })
	ag, err := nixlgo.NewAgent(name, nixlgo.AgentConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ag.Close() })
	if err := ag.CreateUCX(nil); err != nil {
		t.Fatal(err)
	}
	base := uintptr(unsafe.Pointer(&mem[0]))
	if err := ag.Register(base, size); err != nil {
		t.Skip(err)
	}
	md, err := ag.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	return md, base
}

// sendConnect dials n's ROUTER as identity id and sends connect.
func sendConnect(t *testing.T, n *node, id string, numBlocks uint64, base uintptr, md []byte) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", n.tier.Addr(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	z, err := zmtp.Handshake(c, zmtp.Dealer, []byte(id), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	if err := z.WriteMessage(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeConnect, PeerID: id, AgentMetadata: md, NumBlocks: numBlocks,
		BlockLen: uint64(n.m.BlockBytes()), BaseAddr: uint64(base), HashSeed: offload.VLLMDefaultSeed})); err != nil {
		t.Fatal(err)
	}
	return c
}

// Found in review: one unauthenticated connect whose
// agent_metadata has one byte changed (its registration's memory type)
// kills the node (SIGSEGV in NIXL's loadRemoteMD).
func TestNIXLMetaConnectCrash(t *testing.T) {
	n := newVNode(t, nil, "nixl", nil)
	md, base := hostileAgent(t, "hostile-crash", 64*n.m.BlockBytes())
	i := bytes.Index(md, []byte("nixlSDList|t")) + len("nixlSDList|t") + 8 + 3
	md[i] = 0x63
	c := sendConnect(t, n, "127.0.0.1:9", 64, base, md)
	defer c.Close()
	time.Sleep(time.Second)
	t.Log("the node survived")
}

// forgeRegions rewrites a NIXL metadata blob with one registration into
// one of k registrations (the same UCX rkey, k distinct 4 KiB regions),
// as a peer may within the 8 MiB message bound.
func forgeRegions(t *testing.T, md []byte, k int) []byte {
	t.Helper()
	at := bytes.Index(md, []byte("nixlSDList|t"))
	if at < 0 {
		t.Fatal("no descriptor list")
	}
	tAt := at + len("nixlSDList|")
	nAt := tAt + 1 + 8 + 4 + 1
	if md[nAt] != 'n' || binary.LittleEndian.Uint64(md[nAt+9:]) != 1 {
		t.Fatalf("unexpected layout at %d", nAt)
	}
	dAt := nAt + 1 + 8 + 8 + 1
	dl := int(binary.LittleEndian.Uint64(md[dAt:]))
	desc := md[dAt+8 : dAt+8+dl]
	rest := md[dAt+8+dl+1:]
	out := append([]byte(nil), md[:nAt+9]...)
	out = binary.LittleEndian.AppendUint64(out, uint64(k))
	out = append(out, '|')
	addr := binary.LittleEndian.Uint64(desc)
	for i := range k {
		d := append([]byte(nil), desc...)
		binary.LittleEndian.PutUint64(d, addr+uint64(i)*r4Slot)
		binary.LittleEndian.PutUint64(d[8:], r4Slot)
		out = binary.LittleEndian.AppendUint64(out, uint64(len(d)))
		out = append(out, d...)
		out = append(out, '|')
	}
	return append(out, rest...)
}

// Found in review: after NIXL 2, A's agent cannot come back: its
// session ends (RemovePeer) and A connects again with the same metadata
// (a vLLM session restart keeps its NIXL agent), but NIXL's UCX backend
// still holds A's connection (loadRemoteSections dropped its record
// without disconnecting), so loading A's metadata fails from then on:
// one hostile message locks A out of this node until either restarts.
func TestNIXLMetaPeerLockedOut(t *testing.T) {
	n, a := r4Plane(t, "node-n", 8), r4Plane(t, "node-a", 8)
	if err := n.AddPeer("a:1", "a:1", connectInfo(a, 8)); err != nil {
		t.Fatal(err)
	}
	if err := a.AddPeer("n:1", "n:1", connectInfo(n, 8)); err != nil {
		t.Fatal(err)
	}
	md, base := a.VLLMRegion()
	bad := md[:bytes.Index(md, []byte("MemSection|"))+len("MemSection|")]
	n.AddPeer("b:1", "b:1", vllmInfo(vllmwire.Msg{BaseAddr: uint64(base), BlockLen: r4Slot, NumBlocks: 8, AgentMetadata: bad}))
	removed := make(chan struct{})
	n.RemovePeer("a:1", func() { close(removed) }) // A's session ends
	wait(t, removed, "RemovePeer(A)")
	if err := n.AddPeer("a:1", "a:1", connectInfo(a, 8)); err != nil { // and A connects again
		t.Errorf("A connecting again after B's one refused connect: %v", err)
	}
}
