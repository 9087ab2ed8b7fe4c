package protocol

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// parent is the manager as the producer sees it: ready keys, pending
// keys, leases numbered from 1, and the requests it was told about.
type parent struct {
	ready, pending map[offload.Key]bool
	leases         uint64
	open           map[string]bool
}

func newParent() *parent {
	return &parent{ready: map[offload.Key]bool{}, pending: map[offload.Key]bool{}, open: map[string]bool{}}
}

func (p *parent) OnNewRequest(r *offload.Request) error { p.open[r.ID] = true; return nil }
func (p *parent) OnRequestFinished(r *offload.Request) error {
	delete(p.open, r.ID)
	return nil
}

func (p *parent) Lookup(k offload.Key, _ *offload.Request) offload.Result {
	switch {
	case p.ready[k]:
		return offload.Hit
	case p.pending[k]:
		return offload.HitPending
	}
	return offload.Miss
}

func (p *parent) Lease(keys []offload.Key, _ *offload.Request) (*offload.Job, error) {
	p.leases++
	j := &offload.Job{ID: p.leases, Lease: true, Keys: keys}
	for i := range keys {
		j.Slots = append(j.Slots, int32(10+i))
	}
	return j, nil
}

func key(b byte) offload.Key { return offload.Key{b} }

// show prints actions one a line, for comparison.
func show(as []Action) string {
	var out []string
	for _, a := range as {
		switch a := a.(type) {
		case SendFrame:
			out = append(out, fmt.Sprintf("send %s %+v", a.Msg.Type(), a.Msg))
		default:
			out = append(out, fmt.Sprintf("%T %+v", a, a))
		}
	}
	return strings.Join(out, "\n")
}

func want(t *testing.T, p *Producer, substrings ...string) {
	t.Helper()
	got := show(p.Take())
	lines := strings.Split(got, "\n")
	if got == "" {
		lines = nil
	}
	if len(lines) != len(substrings) {
		t.Fatalf("actions:\n%s\nwant %d: %q", got, len(substrings), substrings)
	}
	for i, s := range substrings {
		if !strings.Contains(lines[i], s) {
			t.Errorf("action %d = %s, want it to hold %q", i, lines[i], s)
		}
	}
}

// The producer is a state machine: events in, actions out, no clock and
// no socket. One round, as docs/protocol.md walks it: a lookup parked on
// a key being written, answered at lookup_hold; the fetch starts a
// write; its end sends transfer_done and ends the lease.
func TestProducerRound(t *testing.T) {
	ps := &Producers{Config: ProducerConfig{LookupHold: 5 * time.Second, PinHold: 30 * time.Second, BlockBytes: 4096}}
	p, par := ps.New(), newParent()
	p.Peer = "peer"
	par.ready[key(1)], par.pending[key(2)] = true, true
	t0 := time.Unix(1000, 0)
	p.Lookup(wire.Lookup{ReqID: "kv", Round: 1, Keys: []wire.Key{key(1), key(2)}}, t0)
	p.Serve(par, t0)
	want(t, p) // k2 is still being written: parked
	if !p.Parked() || !p.Busy() || len(par.open) != 1 {
		t.Fatalf("parked %v, busy %v, open requests %v", p.Parked(), p.Busy(), par.open)
	}
	p.Serve(par, t0.Add(5*time.Second)) // lookup_hold: answered, k2 a miss
	want(t, p, "Hits:[true false]")
	if p.Parked() || len(par.open) != 0 {
		t.Fatalf("after the answer: parked %v, open requests %v", p.Parked(), par.open)
	}
	if err := p.Fetch(wire.Fetch{ReqID: "kv", Round: 1, Keys: []wire.Key{key(1)}, Slots: []uint32{7}}); err != nil {
		t.Fatal(err)
	}
	want(t, p, "StartWrite {Round:{KVID:kv Round:1} Pairs:[{Local:10 Remote:7}]}")
	err := p.Fetch(wire.Fetch{ReqID: "kv", Round: 1, Keys: []wire.Key{key(1)}, Slots: []uint32{7}})
	if !errors.Is(err, ErrDuplicateFetch) {
		t.Errorf("a second fetch for the round: %v, want ErrDuplicateFetch", err)
	}
	p.Take()
	// A write's end is the only way the round ends while it is written:
	// pin_hold passes without releasing the pins.
	if next := p.Timeouts(t0.Add(time.Hour)); !next.IsZero() {
		t.Errorf("a pin deadline %v while the round is written", next)
	}
	want(t, p)
	p.WriteDone(RoundID{"kv", 1}, nil)
	want(t, p, "send transfer_done", "JobDone {Result:{ID:1 OK:true Succeeded:[] Bytes:4096")
	if p.Busy() || ps.Stats.RoundsOK != 1 || ps.Stats.LookupsServed != 1 || ps.Stats.KeysHit != 1 || ps.Stats.KeysMissed != 1 {
		t.Errorf("busy %v, stats %+v", p.Busy(), ps.Stats)
	}
}

// S6.5, S8.1: pins that no fetch claims end at pin_hold; a dead session
// ends its leases and parked lookups at once and sends nothing more.
func TestProducerExpiryAndDeath(t *testing.T) {
	ps := &Producers{Config: ProducerConfig{LookupHold: 5 * time.Second, PinHold: 30 * time.Second, BlockBytes: 1}}
	p, par := ps.New(), newParent()
	par.ready[key(1)], par.pending[key(2)] = true, true
	t0 := time.Unix(1000, 0)
	p.Lookup(wire.Lookup{ReqID: "a", Round: 1, Keys: []wire.Key{key(1)}}, t0)
	p.Serve(par, t0)
	p.Take()
	if next := p.Timeouts(t0.Add(time.Second)); !next.Equal(t0.Add(30 * time.Second)) {
		t.Errorf("next pin deadline %v, want pin_hold after the lookup", next)
	}
	p.Timeouts(t0.Add(30 * time.Second))
	want(t, p, "JobDone {Result:{ID:1 OK:false")
	if ps.Stats.PinExpiries != 1 || p.Busy() {
		t.Errorf("pin expiries %d, busy %v", ps.Stats.PinExpiries, p.Busy())
	}
	p.Lookup(wire.Lookup{ReqID: "b", Round: 1, Keys: []wire.Key{key(1), key(2)}}, t0)
	p.Serve(par, t0) // k1 leased, k2 parked
	p.Kill()
	want(t, p, "FinishRequest", "JobDone {Result:{ID:2 OK:false")
	p.Serve(par, t0.Add(time.Minute))
	want(t, p)
}

// A second wire dialect may hand the machine any frame: a fetch whose
// slots do not match its keys is a protocol error, not a panic.
func TestProducerMalformedFetch(t *testing.T) {
	ps := &Producers{Config: ProducerConfig{LookupHold: time.Second, PinHold: time.Second, BlockBytes: 1}}
	p := ps.New()
	err := p.Fetch(wire.Fetch{ReqID: "kv", Round: 1, Keys: []wire.Key{key(1), key(2)}, Slots: []uint32{0}})
	if !errors.Is(err, ErrMalformed) {
		t.Errorf("a fetch of 2 keys into 1 slot: %v, want ErrMalformed", err)
	}
}

// Take hands over its slice: a handler that feeds the machine again while
// it carries actions out loses none of them.
func TestTakeReentry(t *testing.T) {
	ps := &Producers{Config: ProducerConfig{LookupHold: time.Second, PinHold: time.Second, BlockBytes: 1}}
	p := ps.New()
	p.AbortFetch(wire.AbortFetch{ReqID: "a", Round: 1})
	p.AbortFetch(wire.AbortFetch{ReqID: "b", Round: 1})
	n := 0
	for range p.Take() {
		n++
		p.AbortFetch(wire.AbortFetch{ReqID: "c", Round: 1}) // a handler feeding it again
		p.Take()
	}
	if n != 2 {
		t.Errorf("carried out %d of 2 actions", n)
	}
}

// S6.9, S6.8: no ping while idle; a ping keepalive_interval after the last
// frame while busy; dead keepalive_timeout after an unanswered ping; a
// pong for an older ping settles nothing.
func TestLiveness(t *testing.T) {
	l := Liveness{Interval: 2 * time.Second, Timeout: 10 * time.Second}
	t0 := time.Unix(1000, 0)
	l.Received(t0)
	if ping, dead, next := l.Check(t0.Add(time.Hour), false); ping != nil || dead || !next.IsZero() {
		t.Errorf("idle: ping %v, dead %v, next %v; want nothing", ping, dead, next)
	}
	if ping, _, next := l.Check(t0.Add(time.Second), true); ping != nil || !next.Equal(t0.Add(2*time.Second)) {
		t.Errorf("busy before the interval: ping %v, next %v", ping, next)
	}
	ping, _, next := l.Check(t0.Add(2*time.Second), true)
	if ping == nil || !next.Equal(t0.Add(12*time.Second)) {
		t.Fatalf("busy at the interval: ping %v, next %v", ping, next)
	}
	l.Pong(wire.Pong{Seq: ping.Seq - 1}) // a stale pong
	if _, dead, _ := l.Check(t0.Add(12*time.Second), true); !dead {
		t.Error("no pong for keepalive_timeout: not dead")
	}
	l.Pong(wire.Pong{Seq: ping.Seq})
	if _, dead, _ := l.Check(t0.Add(12*time.Second), true); dead {
		t.Error("dead after the pong")
	}
}

// S8.5: the scratch Serve shares between lookups is bounded by the lookup
// being served: after one of more than maxScratchKeys keys it is dropped,
// not kept for every later lookup to clear.
func TestServeScratchShrinks(t *testing.T) {
	ps := &Producers{Config: ProducerConfig{LookupHold: time.Second, PinHold: time.Second, BlockBytes: 1}}
	p, par := ps.New(), newParent()
	p.Peer = "peer"
	t0 := time.Unix(1000, 0)
	for round, n := range []int{maxScratchKeys + 1, 16} {
		keys := make([]wire.Key, n)
		for i := range keys {
			keys[i] = wire.Key{byte(i), byte(i >> 8), byte(round)}
		}
		p.Lookup(wire.Lookup{ReqID: "kv", Round: uint64(round + 1), Keys: keys}, t0)
		p.Serve(par, t0)
		p.Take()
		if round == 0 && ps.first != nil {
			t.Errorf("after a %d-key lookup the scratch is kept", n)
		}
	}
	if ps.first == nil { // a small lookup's is kept for the next
		t.Error("after a 16-key lookup the scratch is dropped")
	}
}
