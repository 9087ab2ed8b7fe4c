//go:build nixl

package nixlgo

import (
	"bytes"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// pair makes two agents with the UCX backend, each with n blocks of block
// bytes of registered memory, and each holding the other's metadata.
func pair(t *testing.T, block, n int) (a, b *Agent, ma, mb []byte) {
	t.Helper()
	mk := func(name string) (*Agent, []byte) {
		ag, err := NewAgent(name, AgentConfig{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ag.Close() })
		if err := ag.CreateUCX(nil); err != nil {
			t.Fatal(err)
		}
		mem, err := syscall.Mmap(-1, 0, block*n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { syscall.Munmap(mem) })
		if err := ag.Register(base(mem), len(mem)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ag.Deregister(base(mem), len(mem)) })
		return ag, mem
	}
	a, ma = mk("kvtier-a")
	b, mb = mk("kvtier-b")
	for _, p := range [][2]*Agent{{a, b}, {b, a}} {
		md, err := p[1].LocalMetadata()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p[0].LoadRemote(md); err != nil {
			t.Fatal(err)
		}
	}
	return a, b, ma, mb
}

func base(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

// xfer runs one transfer from a to completion, driving b's progress.
func xfer(t *testing.T, a, b *Agent, op Op, ma, mb []byte, block, n int, lidx, ridx []int32, notif []byte) {
	t.Helper()
	local, err := a.Prep("", base(ma), block, block, n)
	if err != nil {
		t.Fatal(err)
	}
	defer local.Release()
	remote, err := a.Prep("kvtier-b", base(mb), block, block, n)
	if err != nil {
		t.Fatal(err)
	}
	defer remote.Release()
	req, err := a.MakeXfer(op, local, lidx, remote, ridx, notif)
	if err != nil {
		t.Fatal(err)
	}
	defer req.Release()
	done, err := req.Post()
	deadline := time.Now().Add(10 * time.Second)
	for err == nil && !done {
		if time.Now().After(deadline) {
			t.Fatal("transfer did not complete in 10s")
		}
		if _, err = b.Notifs(); err != nil {
			break
		}
		done, err = req.Status()
	}
	if err != nil {
		t.Fatal(err)
	}
}

// A WRITE lands local blocks in the chosen remote slots, a READ brings
// remote blocks back, and the notification reaches the target after the
// data.
func TestWriteReadNotif(t *testing.T) {
	const block, n = 4096, 4
	a, b, ma, mb := pair(t, block, n)
	for i := range ma {
		ma[i] = byte(i/block + 1)
	}
	xfer(t, a, b, Write, ma, mb, block, n, []int32{0, 2}, []int32{3, 1}, []byte("wrote"))
	if !bytes.Equal(mb[3*block:4*block], ma[:block]) || !bytes.Equal(mb[block:2*block], ma[2*block:3*block]) {
		t.Fatal("write: remote blocks 3 and 1 differ from local blocks 0 and 2")
	}
	if mb[0] != 0 || mb[2*block] != 0 {
		t.Fatal("write touched remote blocks it was not given")
	}
	var got []Notif
	deadline := time.Now().Add(10 * time.Second)
	for len(got) == 0 && time.Now().Before(deadline) {
		ns, err := b.Notifs()
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ns...)
	}
	if len(got) != 1 || got[0].From != "kvtier-a" || string(got[0].Msg) != "wrote" {
		t.Fatalf("notifications %+v, want one \"wrote\" from kvtier-a", got)
	}

	for i := range mb {
		mb[i] = 0xEE
	}
	xfer(t, a, b, Read, ma, mb, block, n, []int32{1}, []int32{0}, nil)
	if !bytes.Equal(ma[block:2*block], mb[:block]) {
		t.Fatal("read: local block 1 differs from remote block 0")
	}
}
