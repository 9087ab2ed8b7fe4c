package protocol

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/offload/script"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// TestScenarios runs the handshake scripts of testdata/ (offload/script):
// Handshake machines of named nodes against each other, no socket, each
// frame carried by the script — so an attacker's frames (replayed,
// relayed, forged) are a line each. `go test -run TestScenarios -update`
// rewrites the expected outputs.
//
// Commands:
//
//	node N [id=ID] [token=T] [hash_seed=S]  a node's Shaker (block size 4096, data plane tcp); id: the node id
//	                                       (and incarnation) it claims, N's own by default
//	dial C D A [data] [nonce=X] [bind=B] [inc=I]  connection C: D dials A (a data
//	                                       connection to A's process, or incarnation I of it); D's frames
//	accept C [nonce=X] [bind=B] [unknown]  A takes C's hello (a data one from a process it has no session with); A's frames
//	deliver C                              the frames in flight cross, both ways, until neither side has more; each frame, then how each side stands
//	inject C to=d|a from=C0:d|a:TYPE       the frame of TYPE that a side sent on C0 is delivered on C instead; the answer
//	limit C d|a                            the largest frame that side reads next
func TestScenarios(t *testing.T) {
	script.RunDir(t, "testdata", func(*testing.T) func(*testing.T, *script.Cmd) string {
		s := &shakeScenario{nodes: map[string]*Shaker{}, conns: map[string]*shakeConn{}}
		return s.do
	})
}

type shakeScenario struct {
	nodes map[string]*Shaker
	conns map[string]*shakeConn
}

// shakeConn is one connection: its two machines, the frames each side
// has sent but the other not yet received, and every frame sent (inject).
type shakeConn struct {
	d, a     *Handshake
	acceptor string
	toA, toD []wire.Msg
	sent     map[string]wire.Msg // "d:auth" → the last such frame
}

func nonce(c *script.Cmd, def string) [32]byte {
	v, _ := strconv.Atoi(c.Val("nonce", def))
	return [32]byte{byte(v)}
}

func bindOf(c *script.Cmd) func() []byte {
	b := c.Val("bind", "")
	return func() []byte {
		if b == "" {
			return nil
		}
		return []byte(b)
	}
}

func (s *shakeScenario) do(t *testing.T, c *script.Cmd) string {
	t.Helper()
	w := c.Words()
	switch c.Name {
	case "node":
		sh := shaker(c.Val("id", w[0]), c.Val("token", ""))
		sh.Connect.HashSeed = c.Val("hash_seed", sh.Connect.HashSeed)
		s.nodes[w[0]] = sh
		return ""
	case "dial":
		d, a := s.nodes[w[1]], s.nodes[w[2]]
		sc := &shakeConn{acceptor: w[2], sent: map[string]wire.Msg{}}
		if c.Has("data") {
			peer := a.Self
			if inc, ok := c.Lookup("inc"); ok {
				v, _ := strconv.Atoi(inc)
				peer.Inc = [16]byte{byte(v)}
			}
			sc.d = d.DialData(peer, nonce(c, "1"), bindOf(c))
		} else {
			sc.d = d.DialControl(nonce(c, "1"), bindOf(c))
		}
		s.conns[w[0]] = sc
		return sc.out("d", sc.d, &sc.toA)
	case "accept":
		sc := s.conns[w[0]]
		hello := sc.toA[0].(wire.Hello)
		sc.toA = sc.toA[1:]
		a := s.nodes[sc.acceptor]
		if hello.Kind == wire.KindData {
			full := c.Has("full")
			sc.a = a.AcceptData(hello, nonce(c, "2"), !c.Has("unknown"), bindOf(c), func() bool { return !full })
		} else {
			sc.a = a.AcceptControl(hello, nonce(c, "2"), bindOf(c))
		}
		return sc.out("a", sc.a, &sc.toD)
	case "deliver":
		sc := s.conns[w[0]]
		var lines []string
		for len(sc.toA)+len(sc.toD) > 0 {
			for _, m := range sc.take(&sc.toA) {
				sc.a.Receive(m)
				if o := sc.out("a", sc.a, &sc.toD); o != "" {
					lines = append(lines, o)
				}
			}
			for _, m := range sc.take(&sc.toD) {
				sc.d.Receive(m)
				if o := sc.out("d", sc.d, &sc.toA); o != "" {
					lines = append(lines, o)
				}
			}
		}
		return strings.Join(append(lines, "d: "+state(sc.d), "a: "+state(sc.a)), "\n")
	case "inject":
		sc := s.conns[w[0]]
		from := strings.Split(c.Val("from", ""), ":")
		m := s.conns[from[0]].sent[from[1]+":"+from[2]]
		if m == nil {
			t.Fatalf("%s sent no %s on %s", from[1], from[2], from[0])
		}
		if c.Val("to", "a") == "a" {
			sc.a.Receive(m)
			return sc.out("a", sc.a, &sc.toD) + "\na: " + state(sc.a)
		}
		sc.d.Receive(m)
		return sc.out("d", sc.d, &sc.toA) + "\nd: " + state(sc.d)
	case "limit":
		sc := s.conns[w[0]]
		h := sc.d
		if w[1] == "a" {
			h = sc.a
		}
		return strconv.Itoa(h.Limit())
	}
	t.Fatalf("unknown command %q", c.Name)
	return ""
}

func (sc *shakeConn) take(q *[]wire.Msg) []wire.Msg {
	m := *q
	*q = nil
	return m
}

// out queues what side emitted for the other side and prints it.
func (sc *shakeConn) out(side string, h *Handshake, q *[]wire.Msg) string {
	var lines []string
	for _, m := range h.Take() {
		*q = append(*q, m)
		sc.sent[side+":"+m.Type().String()] = m
		line := side + "> " + m.Type().String()
		if d, ok := m.(wire.Disconnect); ok {
			line += fmt.Sprintf(" code=%v %q", d.Code, d.Reason)
		}
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n")
}

func state(h *Handshake) string {
	var re *Reject
	switch {
	case h == nil:
		return "not started"
	case errors.As(h.Err(), &re):
		return fmt.Sprintf("rejected code=%v by_peer=%v", re.Code, re.ByPeer)
	case h.Done() && h.kind == wire.KindData:
		return "done"
	case h.Done():
		r := h.Result()
		return fmt.Sprintf("done peer=%s dialer=%s dial_nonce=%d", r.Peer.NodeID, r.Dialer, r.DialNonce[0])
	}
	return fmt.Sprintf("waiting (limit %d)", h.Limit())
}
