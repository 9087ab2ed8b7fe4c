//go:build nixl

package nixlgo

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

const (
	procBlock  = 64 << 10
	procBlocks = 8
	targetEnv  = "KVTIER_NIXL_TARGET"
)

// targetByte and initByte are the patterns the two processes fill their
// blocks with.
func targetByte(i int) byte { return byte(i/procBlock*3 + 1) }
func initByte(i int) byte   { return byte(i/procBlock + 100) }

// TestMain turns the test binary into the target process when the
// two-process test starts it.
func TestMain(m *testing.M) {
	if os.Getenv(targetEnv) == "1" {
		if err := target(os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "target:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// target is the other process: an agent with registered blocks that
// prints its metadata, loads the initiator's, then drives progress and
// answers each notification with whether its blocks hold what the
// notification says ("write": blocks 3 and 1 hold the initiator's 0 and
// 2). "exit" on stdin ends it.
func target(in io.Reader, out io.Writer) error {
	a, err := NewAgent("kvtier-target", AgentConfig{})
	if err != nil {
		return err
	}
	defer a.Close()
	if err := a.CreateUCX(nil); err != nil {
		return err
	}
	mem, err := syscall.Mmap(-1, 0, procBlock*procBlocks, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return err
	}
	for i := range mem {
		mem[i] = targetByte(i)
	}
	if err := a.Register(base(mem), len(mem)); err != nil {
		return err
	}
	defer a.Deregister(base(mem), len(mem))
	md, err := a.LocalMetadata()
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "%s %d\n", hex.EncodeToString(md), base(mem))
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(in)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	peer, err := hex.DecodeString(<-lines)
	if err != nil {
		return err
	}
	if _, err := a.LoadRemote(peer); err != nil {
		return err
	}
	fmt.Fprintln(out, "ready")
	for {
		select {
		case l, ok := <-lines:
			if !ok || l == "exit" {
				return nil
			}
		default:
		}
		ns, err := a.Notifs()
		if err != nil {
			return err
		}
		for _, n := range ns {
			ok := string(n.Msg) == "write" && n.From == "kvtier-init"
			for i := range procBlock {
				ok = ok && mem[3*procBlock+i] == initByte(i) && mem[procBlock+i] == initByte(2*procBlock+i)
			}
			fmt.Fprintf(out, "notif %s %v\n", n.Msg, ok)
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// run drives a request to completion or failure, with a deadline.
func run(t *testing.T, r *Req) error {
	t.Helper()
	done, err := r.Post()
	deadline := time.Now().Add(10 * time.Second)
	for err == nil && !done {
		if time.Now().After(deadline) {
			t.Fatal("transfer neither completed nor failed in 10s")
		}
		done, err = r.Status()
	}
	return err
}

// Two OS processes over UCX (TCP on loopback under make test-nixl): a
// WRITE lands byte for byte with its notification, a READ brings the
// target's blocks back, deregistered memory cannot be prepared any more,
// and once the target is killed a transfer fails with
// ErrRemoteDisconnect, not a generic error.
func TestTwoProcesses(t *testing.T) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), targetEnv+"=1")
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	lines := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
	})
	next := func(what string) string {
		t.Helper()
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("target exited before %s", what)
			}
			return l
		case <-time.After(10 * time.Second):
			t.Fatalf("no %s from the target in 10s", what)
		}
		return ""
	}

	f := strings.Fields(next("metadata"))
	if len(f) != 2 {
		t.Fatalf("target said %q", f)
	}
	md, err := hex.DecodeString(f[0])
	if err != nil {
		t.Fatal(err)
	}
	rbase, err := strconv.ParseUint(f[1], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	a, err := NewAgent("kvtier-init", AgentConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := a.CreateUCX(nil); err != nil {
		t.Fatal(err)
	}
	mem, err := syscall.Mmap(-1, 0, procBlock*procBlocks, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	for i := range mem {
		mem[i] = initByte(i)
	}
	if err := a.Register(base(mem), len(mem)); err != nil {
		t.Fatal(err)
	}
	name, err := a.LoadRemote(md)
	if err != nil || name != "kvtier-target" {
		t.Fatalf("LoadRemote: %q, %v", name, err)
	}
	own, err := a.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(stdin, hex.EncodeToString(own))
	if l := next("ready"); l != "ready" {
		t.Fatalf("target said %q, want ready", l)
	}
	local, err := a.Prep("", base(mem), procBlock, procBlock, procBlocks)
	if err != nil {
		t.Fatal(err)
	}
	remote, err := a.Prep(name, uintptr(rbase), procBlock, procBlock, procBlocks)
	if err != nil {
		t.Fatal(err)
	}

	w, err := a.MakeXfer(Write, local, []int32{0, 2}, remote, []int32{3, 1}, []byte("write"))
	if err != nil {
		t.Fatal(err)
	}
	if err := run(t, w); err != nil {
		t.Fatalf("write: %v", err)
	}
	w.Release()
	if l := next("the write's notification"); l != "notif write true" {
		t.Fatalf("target: %q, want \"notif write true\" (the notification, after the right bytes)", l)
	}

	for i := range mem {
		mem[i] = 0xEE
	}
	r, err := a.MakeXfer(Read, local, []int32{5, 6}, remote, []int32{0, 7}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := run(t, r); err != nil {
		t.Fatalf("read: %v", err)
	}
	r.Release()
	for i := range procBlock {
		if mem[5*procBlock+i] != targetByte(i) || mem[6*procBlock+i] != targetByte(7*procBlock+i) {
			t.Fatalf("read: byte %d of local blocks 5, 6 differs from the target's blocks 0, 7", i)
		}
	}
	if !bytes.Equal(mem[:procBlock], bytes.Repeat([]byte{0xEE}, procBlock)) {
		t.Fatal("read touched a local block it was not given")
	}

	// Deregistered memory can no longer take part in a transfer.
	local.Release()
	if err := a.Deregister(base(mem), len(mem)); err != nil {
		t.Fatalf("deregister: %v", err)
	}
	if d, err := a.Prep("", base(mem), procBlock, procBlock, procBlocks); err == nil {
		d.Release()
		t.Fatal("deregistered memory was prepared for transfers")
	}
	if err := a.Register(base(mem), len(mem)); err != nil {
		t.Fatalf("registering again: %v", err)
	}
	defer a.Deregister(base(mem), len(mem))
	local, err = a.Prep("", base(mem), procBlock, procBlock, procBlocks)
	if err != nil {
		t.Fatal(err)
	}
	defer local.Release()

	// A killed peer is a distinct error.
	cmd.Process.Kill()
	<-exited
	exited <- nil
	w, err = a.MakeXfer(Write, local, []int32{1}, remote, []int32{1}, nil)
	if err == nil {
		err = run(t, w)
		w.Release()
	}
	if !errors.Is(err, ErrRemoteDisconnect) {
		t.Fatalf("write to a killed peer: %v, want ErrRemoteDisconnect", err)
	}
	remote.Release()
}
