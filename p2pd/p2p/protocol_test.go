package p2p

import (
	"context"
	"encoding/binary"
	"hash/crc32"
	"io"
	"net"
	"testing"
	"testing/synctest"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/crc32c"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// Protocol tests: a real node against a hand-driven fake peer over net.Pipe
// connections, under testing/synctest, so every timeout runs in fake time.

func wkeys(ks []offload.Key) []wire.Key { return toWire(ks) }

func pins(n *node) int { return len(n.m.Audit(0)) }

func expect[M wire.Msg](t *testing.T, f *fakePeer) M {
	t.Helper()
	m := f.next()
	got, ok := m.(M)
	if !ok {
		t.Fatalf("fake peer got %T %+v, want %T", m, m, got)
	}
	return got
}

// readBlocks accepts the producer's data connections (DataConns of them)
// and returns the first n blocks by destination slot, checking each CRC.
func readBlocks(t *testing.T, f *fakePeer, l net.Listener, n, size int) map[uint32][]byte {
	type blk struct {
		slot uint32
		b    []byte
	}
	ch := make(chan blk, n)
	go func() {
		for range 2 {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				p, err := wire.ReadFrame(c, nil, wire.MaxPreAuthFrame)
				if err != nil {
					return
				}
				m, _ := wire.Decode(p)
				h, _ := m.(wire.Hello)
				if err := f.shaker().acceptData(c, h, func(peerID) bool { return true }, nil); err != nil {
					t.Errorf("data handshake: %v", err)
					return
				}
				for {
					h, err := wire.ReadDataHeader(c)
					if err != nil {
						return
					}
					b := make([]byte, h.Len+wire.DataTrailerSize)
					if _, err := io.ReadFull(c, b); err != nil {
						return
					}
					b, trailer := b[:h.Len], b[h.Len:]
					if crc32.Checksum(b, crc32c.Table) != binary.BigEndian.Uint32(trailer) {
						t.Errorf("block for slot %d: bad CRC", h.Slot)
					}
					ch <- blk{h.Slot, b}
				}
			}()
		}
	}()
	out := map[uint32][]byte{}
	for range n {
		b := <-ch
		if len(b.b) != size {
			t.Errorf("block of %d bytes, want %d", len(b.b), size)
		}
		out[b.slot] = b.b
	}
	return out
}

// stat sums the P2P tier's samples of a metric (0 when it has none).
func stat(n *node, name string) float64 {
	var v float64
	for _, s := range n.m.Metrics().Tiers[1].Stats {
		if s.Name == name {
			v += s.Value
		}
	}
	return v
}

// step looks keys up in one engine step and returns the answers.
func step(n *node, req *offload.Request, keys []offload.Key) []offload.Result {
	var out []offload.Result
	s := n.m.Begin()
	for _, k := range keys {
		out = append(out, s.Lookup(k, req))
	}
	s.OnScheduleEnd()
	return out
}

// S7.1: the consumer accepts blocks only for (round, slot) pairs it
// registered with that peer; anything else drops the data connection.
func TestUnexpectedBlock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		cons := newNode(t, mn, nil, 16)
		connectFake(t, mn, cons, "fake") // registers the peer
		synctest.Wait()
		c, _ := mn.Dial(context.Background(), cons.tier.Addr())
		if err := newFake(t, "fake", "").shaker().dialData(c, peerID{Node: cons.tier.self.NodeID, Inc: cons.tier.self.Incarnation}); err != nil {
			t.Fatalf("data handshake: %v", err)
		}
		var hdr [wire.DataHeaderSize]byte
		wire.PutDataHeader(hdr[:], wire.DataHeader{Round: 99, Slot: 3, Len: uint32(cons.m.BlockBytes())})
		c.Write(hdr[:])
		synctest.Wait()
		var b [1]byte
		if _, err := c.Read(b[:]); err == nil {
			t.Error("the data connection stayed open after an unexpected block")
		}
		if v := stat(cons, "kv_offload_p2p_unexpected_blocks_total"); v != 1 {
			t.Errorf("unexpected blocks %v, want 1", v)
		}
		if cons.m.Metrics().CPU.Used != 0 {
			t.Error("an unexpected block reached a slot")
		}
	})
}
