package protocol

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/p2pd/wire"
)

func shaker(node, token string) *Shaker {
	inc := [16]byte{byte(len(node))}
	copy(inc[1:], node)
	return &Shaker{Self: PeerID{Node: node, Inc: inc}, Token: []byte(token),
		Connect: wire.Connect{NodeID: node, Incarnation: inc, Version: wire.Version, BlockBytes: 4096, HashSeed: "s", DataPlane: "tcp"}}
}

// pump carries frames between a dialler and an acceptor built from the
// dialler's Hello until neither has more to say; it returns the frames in
// the order they went, as "d>" or "a>" and the type.
func pump(t *testing.T, d *Handshake, accept func(wire.Hello) *Handshake) (a *Handshake, log []string) {
	t.Helper()
	first := d.Take()
	hello, ok := first[0].(wire.Hello)
	if !ok || len(first) != 1 {
		t.Fatalf("the dialler opened with %v, want one hello", first)
	}
	log = append(log, "d>hello")
	a = accept(hello)
	for range 20 {
		moved := false
		for _, m := range a.Take() {
			moved = true
			log = append(log, "a>"+m.Type().String())
			d.Receive(m)
		}
		for _, m := range d.Take() {
			moved = true
			log = append(log, "d>"+m.Type().String())
			a.Receive(m)
		}
		if !moved {
			return a, log
		}
	}
	t.Fatal("the handshake never settled")
	return nil, nil
}

func bind(b string) func() []byte { return func() []byte { return []byte(b) } }

// S6.1: the rejects, each with its code, on the side that detects it, and
// the acceptor never proving to a dialler that did not.
func TestHandshakeRejects(t *testing.T) {
	edit := func(f func(*Shaker)) *Shaker { s := shaker("a", "tok"); f(s); return s }
	for _, tc := range []struct {
		name     string
		dialer   *Shaker
		acceptor *Shaker
		dbind    string
		code     wire.Code
		rejecter string // "a": the acceptor rejects, "d": the dialler
		log      string
	}{
		{"wrong token", shaker("d", "guess"), shaker("a", "tok"), "", wire.CodeAuth, "a", "d>hello a>challenge d>auth a>disconnect"},
		{"no token", shaker("d", ""), shaker("a", "tok"), "", wire.CodeAuth, "a", "d>hello a>challenge d>auth a>disconnect"},
		{"other binding", shaker("d", "tok"), shaker("a", "tok"), "relay", wire.CodeAuth, "a", "d>hello a>challenge d>auth a>disconnect"},
		{"same node id", shaker("a", "tok"), shaker("a", "tok"), "", wire.CodeSelf, "a", "d>hello a>disconnect"},
		{"hash seed", shaker("d", "tok"), edit(func(s *Shaker) { s.Connect.HashSeed = "t" }), "", wire.CodeHashSeed, "a",
			"d>hello a>challenge d>auth a>auth d>connect a>disconnect"},
		{"block size", shaker("d", "tok"), edit(func(s *Shaker) { s.Connect.BlockBytes = 8192 }), "", wire.CodeBlockSize, "a",
			"d>hello a>challenge d>auth a>auth d>connect a>disconnect"},
		{"data plane", shaker("d", "tok"), edit(func(s *Shaker) { s.Connect.DataPlane = "nixl" }), "", wire.CodeDataPlane, "a",
			"d>hello a>challenge d>auth a>auth d>connect a>disconnect"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := tc.dialer.DialControl([32]byte{1}, bind(tc.dbind))
			a, log := pump(t, d, func(h wire.Hello) *Handshake { return tc.acceptor.AcceptControl(h, [32]byte{2}, bind("")) })
			if got := strings.Join(log, " "); got != tc.log {
				t.Errorf("frames:\n got %s\nwant %s", got, tc.log)
			}
			mine, theirs := a, d
			if tc.rejecter == "d" {
				mine, theirs = d, a
			}
			var re *Reject
			if !errors.As(mine.Err(), &re) || re.Code != tc.code || re.ByPeer {
				t.Errorf("rejecter's error %v, want our reject with %v", mine.Err(), tc.code)
			}
			if !errors.As(theirs.Err(), &re) || re.Code != tc.code || !re.ByPeer {
				t.Errorf("other side's error %v, want the peer's reject with %v", theirs.Err(), tc.code)
			}
		})
	}
}

// S6.1: a frame other than the one due is a protocol error, told to the
// peer; so is a frame that did not decode. After the end nothing more is
// sent whatever arrives.
func TestHandshakeOutOfOrder(t *testing.T) {
	a := shaker("a", "tok").AcceptControl(wire.Hello{NodeID: "d"}, [32]byte{2}, nil)
	a.Take()
	err := a.Receive(wire.Connect{NodeID: "d"})
	var re *Reject
	if !errors.As(err, &re) || re.Code != wire.CodeProtocol || !strings.Contains(re.Text, "where auth was due") {
		t.Fatalf("connect before auth: %v, want a protocol reject naming auth", err)
	}
	if out := a.Take(); len(out) != 1 || out[0].Type() != wire.TDisconnect {
		t.Errorf("sent %v, want one disconnect", out)
	}
	a.Receive(wire.Auth{})
	if out := a.Take(); len(out) != 0 || !a.Done() {
		t.Errorf("after the reject: sent %v, done %v; want nothing, done", out, a.Done())
	}
	d := shaker("d", "tok").DialControl([32]byte{1}, nil)
	d.Take()
	if err := d.Malformed(fmt.Errorf("%w: bad", wire.ErrMalformed)); !errors.As(err, &re) || re.Code != wire.CodeProtocol {
		t.Errorf("malformed frame: %v, want a protocol reject", err)
	}
}

// S6.1: nothing above 64 KiB is read until both sides proved themselves;
// the Connect (which carries the data plane's info) may be larger.
func TestHandshakeLimits(t *testing.T) {
	d := shaker("d", "tok").DialControl([32]byte{1}, nil)
	var limits []int
	limits = append(limits, d.Limit())
	d.Take()
	d.Receive(wire.Challenge{NodeID: "a", Incarnation: shaker("a", "").Self.Inc, Nonce: [32]byte{2}})
	limits = append(limits, d.Limit())
	a := shaker("a", "tok")
	d.Receive(wire.Auth{Proof: a.ControlProof("acceptor", d.s.Self, a.Self, [32]byte{1}, [32]byte{2}, nil)})
	limits = append(limits, d.Limit())
	want := []int{wire.MaxPreAuthFrame, wire.MaxPreAuthFrame, wire.MaxHandshakeFrame}
	if fmt.Sprint(limits) != fmt.Sprint(want) || d.Err() != nil {
		t.Errorf("limits %v (error %v), want %v", limits, d.Err(), want)
	}
}

// S6.1: a proof covers both nonces, both ids and incarnations, the kind,
// the direction and the channel binding: changing any changes it.
func TestProofBindsTranscript(t *testing.T) {
	key := []byte("k")
	d, a := PeerID{Node: "d", Inc: [16]byte{1}}, PeerID{Node: "a", Inc: [16]byte{2}}
	dn, an := [32]byte{3}, [32]byte{4}
	base := Proof(key, "dialer", wire.KindControl, d, a, dn, an, nil)
	for name, p := range map[string][32]byte{
		"label":          Proof(key, "acceptor", wire.KindControl, d, a, dn, an, nil),
		"kind":           Proof(key, "dialer", wire.KindData, d, a, dn, an, nil),
		"swapped ids":    Proof(key, "dialer", wire.KindControl, a, d, dn, an, nil),
		"dialler id":     Proof(key, "dialer", wire.KindControl, PeerID{Node: "e", Inc: d.Inc}, a, dn, an, nil),
		"acceptor inc":   Proof(key, "dialer", wire.KindControl, d, PeerID{Node: a.Node, Inc: [16]byte{9}}, dn, an, nil),
		"dialler nonce":  Proof(key, "dialer", wire.KindControl, d, a, [32]byte{5}, an, nil),
		"acceptor nonce": Proof(key, "dialer", wire.KindControl, d, a, dn, [32]byte{5}, nil),
		"binding":        Proof(key, "dialer", wire.KindControl, d, a, dn, an, []byte{1}),
		"token":          Proof([]byte("j"), "dialer", wire.KindControl, d, a, dn, an, nil),
	} {
		if p == base {
			t.Errorf("changing the %s leaves the proof unchanged", name)
		}
	}
	if SessionKey(key, d, a) == nil || string(SessionKey(key, d, a)) != string(SessionKey(key, a, d)) {
		t.Error("the session key differs between the two sides")
	}
}

// Review (issue 14): a peer's node id becomes a log field and a metric
// label; one that is not printable UTF-8 is a protocol error at its
// Connect.
func TestHandshakeRejectsUnprintableID(t *testing.T) {
	for _, id := range []string{"node-\xff\xfe", "a\nb", "bell\x07"} {
		d := shaker(id, "tok").DialControl([32]byte{1}, nil)
		a, _ := pump(t, d, func(h wire.Hello) *Handshake { return shaker("a", "tok").AcceptControl(h, [32]byte{2}, nil) })
		var re *Reject
		if !errors.As(a.Err(), &re) || re.Code != wire.CodeProtocol || !strings.Contains(re.Text, "printable") {
			t.Errorf("node id %q: %v, want a protocol reject", id, a.Err())
		}
	}
}
