package zmtp

import (
	"bufio"
	"bytes"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const python = "/usr/bin/python3"

func needZMQ(t *testing.T) {
	t.Helper()
	if err := exec.Command(python, "-c", "import zmq").Run(); err != nil {
		t.Skip("python3-zmq is not installed (.ci/run installs it)")
	}
}

// Issue 15: a libzmq DEALER (the one vLLM opens to each peer, identity
// "host:port", heartbeats on) talks to this package's ROUTER side: the
// identity arrives in READY, one frame per message with no delimiter, a
// multipart message of a long frame arrives whole, and heartbeats keep
// the one connection alive past their timeout because PINGs are answered
// (libzmq would drop and redial otherwise). Messages back reach it.
func TestRouterWithLibzmqDealer(t *testing.T) {
	needZMQ(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cmd := exec.Command(python, "testdata/peer.py", "dealer", ln.Addr().String(), "127.0.0.1:5710")
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	z, err := Handshake(c, Router, nil, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if z.PeerType() != "DEALER" || string(z.PeerIdentity()) != "127.0.0.1:5710" {
		t.Errorf("peer %s %q, want a DEALER named 127.0.0.1:5710", z.PeerType(), z.PeerIdentity())
	}
	var got []string
	for range 3 {
		m, err := z.ReadMessage()
		if err != nil {
			t.Fatalf("after %v: %v", got, err)
		}
		var sizes []string
		for _, p := range m {
			sizes = append(sizes, string(p[:min(len(p), 5)]))
		}
		got = append(got, strings.Join(sizes, "+"))
	}
	if strings.Join(got, " ") != "one two+xxxxx three" {
		t.Errorf("messages %v", got)
	}
	for _, reply := range []string{"r1", "r2"} {
		if err := z.WriteMessage([]byte(reply)); err != nil {
			t.Fatal(err)
		}
	}
	sc := bufio.NewScanner(out)
	var back []string
	for sc.Scan() {
		back = append(back, sc.Text())
	}
	if strings.Join(back, " ") != "r1 r2" {
		t.Errorf("the DEALER got %v", back)
	}
	ln.(*net.TCPListener).SetDeadline(time.Now().Add(100 * time.Millisecond))
	if c2, err := ln.Accept(); err == nil {
		c2.Close()
		t.Error("libzmq dialled again: its heartbeats timed out (PINGs unanswered)")
	}
}

// Issue 15: this package's DEALER (identity its address, as vLLM's) to a
// libzmq ROUTER: the ROUTER sees [identity, payload] for each message,
// long frames included, and its answers come back; a PING is answered
// with PONG echoing its context.
func TestDealerWithLibzmqRouter(t *testing.T) {
	needZMQ(t)
	portFile := filepath.Join(t.TempDir(), "port")
	cmd := exec.Command(python, "testdata/peer.py", "router", portFile)
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	var port []byte
	for deadline := time.Now().Add(10 * time.Second); len(port) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the ROUTER never bound")
		}
		port, _ = os.ReadFile(portFile)
	}
	c, err := net.Dial("tcp", "127.0.0.1:"+string(port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	z, err := Handshake(c, Dealer, []byte("127.0.0.1:6000"), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if z.PeerType() != "ROUTER" {
		t.Errorf("peer type %s", z.PeerType())
	}
	big := bytes.Repeat([]byte("b"), 300)
	for _, p := range [][]byte{[]byte("hello"), append([]byte("long:"), big...), []byte("bye")} {
		if string(p) == "bye" {
			// libzmq answers a PING in its I/O thread as it reads it, so
			// the PONG precedes the answer to what follows.
			if err := z.Ping(time.Second, []byte("ctx")); err != nil {
				t.Fatal(err)
			}
		}
		if err := z.WriteMessage(p); err != nil {
			t.Fatal(err)
		}
		m, err := z.ReadMessage()
		if err != nil || len(m) != 1 || !strings.HasPrefix(string(m[0]), "ack:"+string(p[:min(len(p), 4)])) {
			t.Fatalf("answer %q, %v", m, err)
		}
	}
	if at, ctx := z.LastPong(); at.IsZero() || string(ctx) != "ctx" {
		t.Errorf("PONG at %v with context %q, want one echoing ctx", at, ctx)
	}
	var lines []string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if len(lines) != 3 || lines[0] != "127.0.0.1:6000 [5] hello" || lines[1] != "127.0.0.1:6000 [305] long:bbb" {
		t.Errorf("the ROUTER saw %q", lines)
	}
}

// pipeHandshake runs Handshake on one end of a pipe against raw bytes
// written to the other.
func pipeHandshake(t *testing.T, typ string, maxMsg int, peer func(c net.Conn)) (*Conn, error) {
	t.Helper()
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	go func() {
		buf := make([]byte, 64)
		b.Read(buf) // our greeting
		peer(b)
		go func() { // drain whatever else we write
			for {
				if _, err := b.Read(buf); err != nil {
					return
				}
			}
		}()
	}()
	a.SetDeadline(time.Now().Add(5 * time.Second))
	return Handshake(a, typ, nil, maxMsg)
}

func ready(typ string) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, readyBody("Socket-Type", typ)...)
	return appendFrame(nil, flagCommand, body)
}

// S8.1 for ZMTP: a greeting that is not one, another mechanism, an
// incompatible socket type, a command or a message frame whose header
// claims more than the limit: each a protocol error, nothing allocated
// for what a header claims.
func TestHandshakeAndFramesRejected(t *testing.T) {
	good := greeting()
	curve := greeting()
	copy(curve[12:32], "CURVE\x00\x00\x00")
	for name, peer := range map[string][]byte{
		"not ZMTP":        append([]byte("GET / HTTP/1.1\r\n"), make([]byte, 48)...),
		"CURVE":           curve,
		"a PUB peer":      append(good, ready("PUB")...),
		"a huge command":  append(good, flagCommand|flagLong, 0, 0, 0, 1, 0, 0, 0, 0),
		"a message first": append(good, 0, 1, 'x'),
	} {
		_, err := pipeHandshake(t, Router, 1<<10, func(c net.Conn) { c.Write(peer) })
		if !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: %v, want ErrProtocol", name, err)
		}
	}
	for name, frames := range map[string][]byte{
		"a 2^60-byte frame": {flagLong, 0x10, 0, 0, 0, 0, 0, 0, 0},
		"over the limit":    appendFrame(nil, 0, make([]byte, 2000)),
		"too many parts":    bytes.Repeat([]byte{flagMore, 0}, MaxParts+1),
		"bad flags":         {0x80, 0},
		"a bad PING":        appendFrame(nil, flagCommand, append([]byte{4}, "PING"...)),
	} {
		z, err := pipeHandshake(t, Router, 1<<10, func(c net.Conn) { c.Write(append(append(greeting(), ready("DEALER")...), frames...)) })
		if err != nil {
			t.Fatalf("%s: handshake %v", name, err)
		}
		if _, err := z.ReadMessage(); !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: %v, want ErrProtocol", name, err)
		}
	}
}

// discard is a connection whose writes (PONGs) go nowhere.
type discard struct{ net.Conn }

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// FuzzReadMessage: whatever a peer sends after the handshake, reading
// never panics and never returns a message over the limit.
func FuzzReadMessage(f *testing.F) {
	f.Add(appendFrame(nil, 0, []byte("hello")))
	f.Add(append(appendFrame(nil, flagMore, []byte("id")), appendFrame(nil, 0, make([]byte, 300))...))
	f.Add(appendFrame(nil, flagCommand, append(append([]byte{4}, "PING"...), 0, 10, 'c')))
	f.Add([]byte{flagLong, 0xff, 0, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, p []byte) {
		z := &Conn{c: discard{}, r: bufio.NewReader(bytes.NewReader(p)), maxMsg: 1024}
		for {
			m, err := z.ReadMessage()
			if err != nil {
				return
			}
			n := 0
			for _, part := range m {
				n += len(part)
			}
			if n > 1024 || len(m) > MaxParts {
				t.Fatalf("a message of %d bytes in %d parts", n, len(m))
			}
		}
	})
}

// Review (issue 15): a frame whose size would wrap the message's running
// total (2^64-1 after a 1-byte frame) is over the limit, not a message
// of an empty frame that desynchronises the stream.
func TestFrameSizeWrap(t *testing.T) {
	var in bytes.Buffer
	in.Write([]byte{flagMore, 1, 'a'})
	in.Write([]byte{flagLong, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	in.Write([]byte{0, 1, 'z'})
	z := &Conn{c: discard{}, r: bufio.NewReader(&in), maxMsg: 1 << 20}
	if m, err := z.ReadMessage(); !errors.Is(err, ErrProtocol) {
		t.Fatalf("ReadMessage = %q, %v; want a protocol error", m, err)
	}
}

// Review (issue 15): libzmq sends an empty Identity for a socket that
// set none; that is no identity.
func TestEmptyIdentityIsNone(t *testing.T) {
	z, err := pipeHandshake(t, Router, 1<<10, func(c net.Conn) {
		body := append([]byte{5}, "READY"...)
		body = append(body, readyBody("Socket-Type", "DEALER", "Identity", "")...)
		c.Write(append(greeting(), appendFrame(nil, flagCommand, body)...))
	})
	if err != nil || z.PeerIdentity() != nil {
		t.Errorf("identity %q (%v), want none", z.PeerIdentity(), err)
	}
}

// Found in review: a PONG's context was not bounded as a PING's is (16
// bytes) and was kept, as a slice of the read buffer, for the
// connection's life: one 64 KiB PONG pinned a whole buffer. A longer one
// is a protocol error; what is kept is a copy.
func TestPongContext(t *testing.T) {
	pong := func(ctx []byte) []byte {
		return appendFrame(nil, flagCommand, append(append([]byte{4}, "PONG"...), ctx...))
	}
	z := &Conn{c: discard{}, r: bufio.NewReader(bytes.NewReader(append(pong(make([]byte, 17)), 0, 1, 'x'))), maxMsg: 1024}
	if _, err := z.ReadMessage(); !errors.Is(err, ErrProtocol) {
		t.Errorf("a 17-byte PONG context: %v, want ErrProtocol", err)
	}
	z = &Conn{c: discard{}, r: bufio.NewReader(bytes.NewReader(append(pong([]byte("12345678")), 0, 1, 'x'))), maxMsg: 1024}
	if _, err := z.ReadMessage(); err != nil {
		t.Fatal(err)
	}
	if _, ctx := z.LastPong(); string(ctx) != "12345678" || cap(ctx) > 16 {
		t.Errorf("kept PONG context %q (cap %d), want a copy of 8 bytes", ctx, cap(ctx))
	}
}
