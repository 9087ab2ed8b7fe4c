package e2e

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/p2pd/wire"
	"github.com/kvtier/kvtier/testing/daemon"
	"github.com/kvtier/kvtier/testing/hostile"
)

// The hardening tests of issue 11: each replays an attack or a fault
// against real p2pd processes and asserts it fails.

// tokenArgs writes a cluster token file and returns the flag for it.
func tokenArgs(t *testing.T, token string) []string {
	path := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return []string{"-cluster-token-file", path}
}

// configArgs writes a JSON config file and returns the flag for it.
func configArgs(t *testing.T, json string) []string {
	path := filepath.Join(t.TempDir(), "config.json")
	if err := os.WriteFile(path, []byte(json), 0o600); err != nil {
		t.Fatal(err)
	}
	return []string{"-config", path}
}

// metric sums a metric's samples whose labels contain every want.
func (n *node) metric(name string, want ...string) float64 {
	n.t.Helper()
	out, code := n.kvctl("metrics")
	if code != 0 {
		n.t.Fatalf("kvctl metrics: %d %s", code, out)
	}
	var v float64
	re := regexp.MustCompile(`^` + regexp.QuoteMeta(name) + `(\{[^}]*\})? (\S+)$`)
	for _, line := range strings.Split(out, "\n") {
		m := re.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		ok := true
		for _, w := range want {
			ok = ok && strings.Contains(m[1], w)
		}
		if ok {
			f, _ := strconv.ParseFloat(m[2], 64)
			v += f
		}
	}
	return v
}

// fetch runs a prompt on prod, then the same on cons from prod, and checks
// every block came from the peer with the producer's digest.
func fetch(t *testing.T, prod, cons *node, seed int, kvID string) {
	t.Helper()
	s := strconv.Itoa(seed)
	want, out, code := prod.submit("--tokens-seed", s, "--tokens", "200")
	if code != 0 {
		t.Fatalf("producer: %d %s", code, out)
	}
	got, out, code := cons.submit("--tokens-seed", s, "--tokens", "200", "--remote-kv-source", prod.p2p, "--kv-request-id", kvID)
	if code != 0 {
		t.Fatalf("consumer: %d %s", code, out)
	}
	if got.Sources.Peer != 12 || got.KVDigest != want.KVDigest {
		t.Errorf("consumer got %+v; want 12 blocks from the peer and digest %s", got, want.KVDigest)
	}
}

// S7.1, S6.1 (issue 11 finding 1): a third party without the token that
// claims the producer's identity cannot open a data connection to the
// consumer, however often it tries during a fetch: the fetched KV is the
// producer's, and every attempt is refused and counted.
func TestHostileDataInjection(t *testing.T) {
	tok := tokenArgs(t, "cluster-secret")
	prod, cons := start(t, tok...), start(t, tok...)
	victim, err := hostile.Probe(prod.p2p)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var attempts, answered int
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			c, err := hostile.Dial(cons.p2p, 2*time.Second)
			if err != nil {
				continue
			}
			nonce := [32]byte{byte(attempts)}
			if ch, err := c.Hello(wire.KindData, victim, nonce); err == nil {
				acc := hostile.Ident{Node: ch.NodeID, Inc: ch.Incarnation}
				c.Send(wire.Auth{Proof: hostile.Proof([]byte("guess"), "dialer", wire.KindData, victim, acc, nonce, ch.Nonce)})
				var hdr [wire.DataHeaderSize]byte
				wire.PutDataHeader(hdr[:], wire.DataHeader{Round: 1, Slot: 0, Len: 4096})
				c.Write(hdr[:])
				if c.Outcome() == nil {
					answered++
				}
			}
			c.Close()
			attempts++
		}
	})
	fetch(t, prod, cons, 21, "kv-inject")
	close(stop)
	wg.Wait()
	if attempts == 0 || answered != 0 {
		t.Errorf("%d of %d spoofed data connections got an answer (want none of at least one)", answered, attempts)
	}
	if got := cons.metric("kv_offload_p2p_handshake_rejects_total", `code="auth"`); got < float64(attempts) {
		t.Errorf("auth rejects %v, want at least %d", got, attempts)
	}
}

// S6.1 (finding 2): no node proves anything to a client that has not
// proven the token, so there is no answer to relay: a client forwarding
// one node's challenge to the other, in either role, gets only challenges
// and rejects, and the real session between the two is not disturbed.
func TestHostileRelay(t *testing.T) {
	tok := tokenArgs(t, "cluster-secret")
	a, b := start(t, tok...), start(t, tok...)
	fetch(t, a, b, 31, "kv-relay-1") // b holds a session with a
	ia, err := hostile.Probe(a.p2p)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := hostile.Probe(b.p2p)
	if err != nil {
		t.Fatal(err)
	}
	for _, kind := range []wire.ConnKind{wire.KindControl, wire.KindData} {
		// Log in to a as b, using b's challenge as the dialler's nonce and
		// whatever b answers as the proof.
		ca, err := hostile.Dial(a.p2p, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		cb, err := hostile.Dial(b.p2p, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		chb, err := cb.Hello(kind, ia, [32]byte{1})
		if err != nil {
			t.Fatal(err)
		}
		cha, err := ca.Hello(kind, ib, chb.Nonce)
		if err != nil {
			t.Fatal(err)
		}
		cb.Send(wire.Auth{Proof: cha.Nonce}) // b has nothing to say before a proof
		if err := cb.Outcome(); !errors.Is(err, hostile.ErrRejected) {
			t.Errorf("kind %d: b answered a forged proof: %v", kind, err)
		}
		ca.Send(wire.Auth{})
		if err := ca.Outcome(); !errors.Is(err, hostile.ErrRejected) {
			t.Errorf("kind %d: a accepted the relayed login: %v", kind, err)
		}
		ca.Close()
		cb.Close()
	}
	if d := b.metric("kv_offload_p2p_peer_deaths_total"); d != 0 {
		t.Errorf("b counted %v peer deaths: the attack disturbed its session with a", d)
	}
	fetch(t, a, b, 32, "kv-relay-2")
}

// S8.1 (finding 3): connections that announce large frames and send
// nothing cost no memory: 400 of them leave RSS within a few MB.
func TestHostilePreAuthMemory(t *testing.T) {
	n := start(t, tokenArgs(t, "cluster-secret")...)
	before := daemon.RSS(n.cmd.Process.Pid)
	var conns []net.Conn
	for i := range 400 {
		c, err := net.DialTimeout("tcp", n.p2p, 2*time.Second)
		if err != nil {
			continue
		}
		claim := uint32(wire.MaxPreAuthFrame) // the largest a hello may be
		if i%2 == 1 {
			claim = 16 << 20 // refused outright
		}
		c.Write([]byte{byte(claim >> 24), byte(claim >> 16), byte(claim >> 8), byte(claim)})
		conns = append(conns, c)
	}
	deadline := time.Now().Add(3 * time.Second)
	var peak int64
	for time.Now().Before(deadline) {
		peak = max(peak, daemon.RSS(n.cmd.Process.Pid))
		time.Sleep(50 * time.Millisecond) // sampling, not waiting for an event
	}
	for _, c := range conns {
		c.Close()
	}
	if grew := peak - before; grew > 32<<20 {
		t.Errorf("RSS grew %d MB with 400 pre-auth connections (before %d MB)", grew>>20, before>>20)
	}
	t.Logf("RSS before %d MB, peak %d MB", before>>20, peak>>20)
}

// S8.1 (finding 4): fd exhaustion does not stop the P2P port: a node with
// a 256-fd limit flooded with 400 connections from 50 addresses (no global
// handshake cap in its way) counts its accept errors, says so in status,
// and serves a new peer once the flood is gone.
func TestHostileFdExhaustion(t *testing.T) {
	prod := startLimited(t, 256, configArgs(t, `{"max_handshakes": 100000}`)...)
	cons := start(t)
	var conns []net.Conn
	for i := range 400 {
		// From 50 loopback addresses: one address may hold only 8 handshakes.
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 1, byte(1+i%50))}, Timeout: 2 * time.Second}
		c, err := d.Dial("tcp", prod.p2p)
		if err == nil {
			conns = append(conns, c)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for prod.metric("kv_offload_p2p_accept_errors_total") == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no accept error counted under a 256-fd limit and %d connections", len(conns))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if out, _ := prod.kvctl("status"); !strings.Contains(out, "accept errors") {
		t.Errorf("status does not show the accept errors:\n%s", out)
	}
	for _, c := range conns {
		c.Close()
	}
	// The flood's handshakes end (closed, or at handshake_timeout).
	deadline = time.Now().Add(20 * time.Second)
	for prod.metric("kv_offload_p2p_handshakes_in_progress") != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the flood's handshakes never ended")
		}
		time.Sleep(50 * time.Millisecond)
	}
	fetch(t, prod, cons, 41, "kv-after-flood")
}

// S6.10 (finding 7): a producer that answers pings but never a lookup:
// the consumer's request ends within lookup_timeout, recomputing.
func TestHostileSilentProducer(t *testing.T) {
	tok := tokenArgs(t, "cluster-secret")
	// The fake producer speaks the TCP data plane: a NIXL node would
	// refuse it at the handshake instead of waiting on its lookup.
	cons := start(t, append(append(tok, "-data-plane", "tcp"), configArgs(t, `{"lookup_hold": "1s"}`)...)...)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	done := make(chan error, 1)
	go func() { done <- hostile.SilentProducer(l, "cluster-secret", hostile.NewIdent("silent")) }()
	began := time.Now()
	got, out, code := cons.submit("--tokens-seed", "51", "--tokens", "200", "--remote-kv-source", l.Addr().String(), "--kv-request-id", "kv-silent")
	took := time.Since(began)
	if code != 0 {
		t.Fatalf("consumer: %d %s", code, out)
	}
	if got.Sources.Computed != 12 || took > 10*time.Second {
		t.Errorf("request took %v with sources %+v; want it recomputed within lookup_timeout (3s)", took, got.Sources)
	}
	if v := cons.metric("kv_offload_p2p_lookup_timeouts_total"); v != 1 {
		t.Errorf("lookup timeouts %v, want 1", v)
	}
	l.Close()
	cons.cmd.Process.Signal(os.Interrupt) // ends the fake's connection
	<-done
}

// freePort is a loopback address nothing listens on now.
func freePort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// S6.1 (finding 6): pairs of nodes that list each other as static peers
// and fetch from each other at once, for the first time: none wedges and
// none recomputes.
func TestHostileDuplicateDials(t *testing.T) {
	const pairs = 4
	for i := range pairs {
		pa, pb := freePort(t), freePort(t)
		a := start(t, "-p2p-listen", pa, "-peers", pb, "-node-id", fmt.Sprintf("a%d", i))
		b := start(t, "-p2p-listen", pb, "-peers", pa, "-node-id", fmt.Sprintf("b%d", i))
		sa, sb := strconv.Itoa(60+2*i), strconv.Itoa(61+2*i)
		wa, out, code := a.submit("--tokens-seed", sa, "--tokens", "200")
		if code != 0 {
			t.Fatalf("a: %d %s", code, out)
		}
		wb, out, code := b.submit("--tokens-seed", sb, "--tokens", "200")
		if code != 0 {
			t.Fatalf("b: %d %s", code, out)
		}
		var wg sync.WaitGroup
		for _, x := range []struct {
			n     *node
			seed  string
			from  string
			want  string
			label string
		}{{a, sb, pb, wb.KVDigest, "a"}, {b, sa, pa, wa.KVDigest, "b"}} {
			wg.Go(func() {
				got, out, code := x.n.submit("--tokens-seed", x.seed, "--tokens", "200", "--remote-kv-source", x.from, "--kv-request-id", "kv-"+x.label)
				if code != 0 || got.Sources.Peer != 12 || got.KVDigest != x.want {
					t.Errorf("pair %d, %s: exit %d, %+v; want 12 blocks from the peer (%s)", i, x.label, code, got, out)
				}
			})
		}
		wg.Wait()
		for _, n := range []*node{a, b} {
			if d := n.metric("kv_offload_p2p_peer_deaths_total"); d != 0 {
				t.Errorf("pair %d: %v peer deaths", i, d)
			}
		}
	}
}

// S2.7, S6.5 (finding 8): with admission backpressure, a producer keeps
// serving a consumer round after round: pins for peers are leases that
// never feed the store-latency estimate.
func TestHostileBackpressureProducer(t *testing.T) {
	prod := start(t, configArgs(t, `{"admission": "backpressure"}`)...)
	cons := start(t)
	for i := range 6 {
		fetch(t, prod, cons, 70+i, fmt.Sprintf("kv-bp-%d", i))
		time.Sleep(300 * time.Millisecond) // a slow fetcher: time between rounds is the point
	}
}
