package protocol

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

func newCons() (*Consumers, *Consumer) {
	cs := &Consumers{Config: ConsumerConfig{LookupTimeout: 7 * time.Second, LoadTimeout: 30 * time.Second, AbortAckTimeout: 10 * time.Second, BlockBytes: 1}}
	return cs, cs.New()
}

func takeShow(c *Consumer) string { return show(c.Take()) }

// hitLoad walks r through a lookup answered Hit and a load of k into slot.
func hitLoad(t *testing.T, c *Consumer, r *Req, k offload.Key, job uint64, now time.Time) uint64 {
	t.Helper()
	if r.Lookup(k) != offload.Retry {
		t.Fatal("first lookup not Retry")
	}
	r.Probe([]offload.Key{k})
	c.Ask(now)
	round := r.round
	c.Take()
	if err := c.LookupResp(wire.LookupResp{ReqID: r.kvID, Round: round, Keys: []wire.Key{k}, Hits: []bool{true}}); err != nil {
		t.Fatal(err)
	}
	c.Take()
	c.Load(r, &offload.Job{ID: job, Keys: []offload.Key{k}, Slots: []int32{int32(job)}}, true, now)
	c.Take()
	return round
}

// load_window (engine.Config.LoadWindow): the engine probes the next
// keys in the step that promotes the answered ones. The load ends the
// round, but the keys probed and not yet asked stay: the next Ask sends
// them at once, in a new round, so that their lookup overlaps the fetch.
func TestConsumerLoadKeepsUnaskedKeys(t *testing.T) {
	_, c := newCons()
	t0 := time.Unix(1000, 0)
	r := c.Add(&offload.Request{ID: "r"}, "kv")
	round := hitLoad(t, c, r, key(1), 1, t0)
	if c.Ask(t0) {
		t.Fatal("a load left a key to ask")
	}
	r.Probe([]offload.Key{key(2)})
	c.Ask(t0)
	c.Take()
	if err := c.LookupResp(wire.LookupResp{ReqID: "kv", Round: r.round, Keys: []wire.Key{key(2)}, Hits: []bool{true}}); err != nil {
		t.Fatal(err)
	}
	c.Take()
	r.Probe([]offload.Key{key(3)}) // the next window, in the step that promotes key 2
	c.Load(r, &offload.Job{ID: 2, Keys: []offload.Key{key(2)}, Slots: []int32{2}}, true, t0)
	c.Take()
	if asked, tracked := r.Probes(); asked != 0 || tracked != 1 {
		t.Errorf("after the load: %d asked, %d tracked; want key 3 alone, not asked yet", asked, tracked)
	}
	prev := round + 1
	if !c.Ask(t0) {
		t.Fatal("the key probed before the load was not asked")
	}
	var sent []wire.Lookup
	for _, a := range c.Take() {
		if f, ok := a.(SendFrame); ok {
			if m, ok := f.Msg.(wire.Lookup); ok {
				sent = append(sent, m)
			}
		}
	}
	if len(sent) != 1 || len(sent[0].Keys) != 1 || sent[0].Keys[0] != wire.Key(key(3)) || sent[0].Round <= prev {
		t.Errorf("the next Ask sent %+v; want one lookup of key 3 alone, in a round after the loaded one (%d)", sent, prev)
	}
}

// S6.6, S6.8 (found in review): a load failed by abort_ack waits for
// Unexpected; the session dies before it comes: PeerRemoved reports it
// once, a late Unexpected is a no-op.
func TestConsumerKillWhileStopping(t *testing.T) {
	cs, c := newCons()
	t0 := time.Unix(1000, 0)
	r := c.Add(&offload.Request{ID: "r"}, "kv")
	round := hitLoad(t, c, r, key(1), 1, t0)
	c.AbortAck(wire.AbortAck{ReqID: "kv", Round: round})
	if got := takeShow(c); !strings.Contains(got, "Unexpect") {
		t.Fatalf("abort_ack: %s", got)
	}
	c.Kill(true, t0)
	if got := takeShow(c); !strings.Contains(got, "RemovePeer") || strings.Contains(got, "JobDone") {
		t.Errorf("kill: %q, want a removal and no result before it ends", got)
	}
	c.PeerRemoved(t0)
	if got := takeShow(c); strings.Count(got, "JobDone") != 1 {
		t.Errorf("the removal's end: %q, want the load's one result", got)
	}
	c.Unexpected(round, t0)
	if got := takeShow(c); got != "" {
		t.Errorf("late Unexpected: %s", got)
	}
	if cs.Stats.RoundsFailed != 1 {
		t.Errorf("rounds failed %d", cs.Stats.RoundsFailed)
	}
	if r.Lookup(key(2)) != offload.Miss {
		t.Error("dead consumer's request does not miss")
	}
}

// S6.6 (found in review): two loads quarantined in one pass, then the
// session's death, ask the data plane for one removal: a second removal
// of a removed peer would report at once, before the first one's readers
// left the slots. Its end reports every load.
func TestConsumerOneRemovalAtATime(t *testing.T) {
	_, c := newCons()
	t0 := time.Unix(1000, 0)
	r1 := c.Add(&offload.Request{ID: "r1"}, "a")
	r2 := c.Add(&offload.Request{ID: "r2"}, "b")
	hitLoad(t, c, r1, key(1), 1, t0)
	hitLoad(t, c, r2, key(2), 2, t0)
	c.Timeouts(t0.Add(30 * time.Second))
	c.Take()
	c.Timeouts(t0.Add(40 * time.Second))
	got := takeShow(c)
	if n := strings.Count(got, "RemovePeer"); n != 1 {
		t.Errorf("%d RemovePeer actions for one pass (the second removal of a removed peer completes at once, S6.6)", n)
	}
	c.Kill(true, t0.Add(41*time.Second))
	if got := takeShow(c); strings.Contains(got, "RemovePeer") {
		t.Errorf("the death during the removal asked for another: %s", got)
	}
	c.PeerRemoved(t0.Add(42 * time.Second))
	if got := takeShow(c); strings.Count(got, "JobDone") != 2 {
		t.Errorf("the removal's end reported %q, want both loads", got)
	}
}

// S6.2: rounds stay unique across merged consumers (one counter per
// node), and a merged request loads.
func TestConsumerMergeRounds(t *testing.T) {
	cs, a := newCons()
	b := cs.New()
	t0 := time.Unix(1000, 0)
	ra := a.Add(&offload.Request{ID: "ra"}, "x")
	rb := b.Add(&offload.Request{ID: "rb"}, "y")
	ra.Probe([]offload.Key{key(1)})
	rb.Probe([]offload.Key{key(2)})
	a.Ask(t0)
	b.Ask(t0)
	a.Take()
	b.Take()
	if ra.round == rb.round {
		t.Fatalf("same round %d", ra.round)
	}
	if col := a.Merge(b); len(col) != 0 {
		t.Fatal(col)
	}
	if rb.Consumer() != a {
		t.Fatal("not moved")
	}
	a.LookupResp(wire.LookupResp{ReqID: "y", Round: rb.round, Keys: []wire.Key{key(2)}, Hits: []bool{true}})
	a.Take()
	a.Load(rb, &offload.Job{ID: 9, Keys: []offload.Key{key(2)}, Slots: []int32{3}}, true, t0)
	if got := takeShow(a); !strings.Contains(got, "ExpectBlocks") {
		t.Fatalf("load after merge: %s", got)
	}
}

// A second wire dialect may hand the machine any frame: an answer whose
// hits do not match its keys is a protocol error, not a panic.
func TestConsumerMalformedAnswer(t *testing.T) {
	_, c := newCons()
	r := c.Add(&offload.Request{ID: "r"}, "kv")
	r.Probe([]offload.Key{key(1), key(2)})
	c.Ask(time.Unix(1000, 0))
	c.Take()
	err := c.LookupResp(wire.LookupResp{ReqID: "kv", Round: 1, Keys: []wire.Key{key(1), key(2)}, Hits: []bool{true}})
	if !errors.Is(err, ErrMalformed) {
		t.Errorf("2 keys, 1 hit: %v, want ErrMalformed", err)
	}
}

// Issue 15, vLLM's wire (DoneCompletes): a round ends with transfer_done
// alone — ok, the load succeeds and the data plane's expectation is
// released; failed, the load fails once the data plane let go of the
// slots (Unexpected). A lookup_resp's round comes from OpenRound.
func TestConsumerDoneCompletes(t *testing.T) {
	cs, c := newCons()
	cs.Config.DoneCompletes = true
	t0 := time.Unix(1000, 0)
	r := c.Add(&offload.Request{ID: "r"}, "kv")
	r.Lookup(key(1))
	r.Probe([]offload.Key{key(1)})
	c.Ask(t0)
	c.Take()
	if c.OpenRound("kv") != r.round || c.OpenRound("other") != 0 {
		t.Fatalf("OpenRound %d, want %d", c.OpenRound("kv"), r.round)
	}
	c.LookupResp(wire.LookupResp{ReqID: "kv", Round: c.OpenRound("kv"), Keys: []wire.Key{key(1)}, Hits: []bool{true}})
	c.Take()
	c.Load(r, &offload.Job{ID: 1, Keys: []offload.Key{key(1)}, Slots: []int32{1}}, true, t0)
	if got := takeShow(c); !strings.Contains(got, "ExpectBlocks") || !strings.Contains(got, "send fetch") {
		t.Fatalf("load: %s", got)
	}
	if c.OpenRound("kv") != 0 {
		t.Error("a round stays open after its fetch")
	}
	c.TransferDone(wire.TransferDone{ReqID: "kv", Round: 1, OK: true}, t0)
	if got := takeShow(c); !strings.Contains(got, "Unexpect") || !strings.Contains(got, "JobDone") || !strings.Contains(got, "OK:true") {
		t.Fatalf("transfer_done ok: %s, want the expectation released and the load done", got)
	}
	c.Unexpected(1, t0) // the data plane's answer to that release
	if got := takeShow(c); got != "" {
		t.Errorf("after the release: %s", got)
	}
	round := hitLoad(t, c, c.Add(&offload.Request{ID: "r2"}, "kv2"), key(2), 2, t0)
	c.TransferDone(wire.TransferDone{ReqID: "kv2", Round: round}, t0)
	if got := takeShow(c); !strings.Contains(got, "Unexpect") || strings.Contains(got, "JobDone") {
		t.Fatalf("transfer_done failed: %s, want the slots released first", got)
	}
	c.Unexpected(round, t0)
	if got := takeShow(c); !strings.Contains(got, "JobDone") || strings.Contains(got, "OK:true") {
		t.Fatalf("after Unexpected: %s, want the load failed", got)
	}
	if cs.Stats.RoundsOK != 1 || cs.Stats.RoundsFailed != 1 {
		t.Errorf("rounds ok %d, failed %d", cs.Stats.RoundsOK, cs.Stats.RoundsFailed)
	}
}

// S6.10 (found in review): each lookup has its own lookup_timeout from
// when it left. A second lookup of the request, sent while the first was
// unanswered, was bounded by the first one's send time: it timed out
// early — with the first unanswered, and also once the first was answered.
func TestConsumerEachLookupItsOwnBound(t *testing.T) {
	for _, answerFirst := range []bool{false, true} {
		cs, c := newCons() // lookup_timeout 7 s
		t0 := time.Unix(1000, 0)
		r := c.Add(&offload.Request{ID: "r"}, "kv")
		r.Probe([]offload.Key{key(1)})
		c.Ask(t0)
		r.Probe([]offload.Key{key(2)})
		c.Ask(t0.Add(5 * time.Second))
		c.Take()
		if answerFirst {
			if err := c.LookupResp(wire.LookupResp{ReqID: "kv", Round: r.round, Keys: []wire.Key{key(1)}, Hits: []bool{true}}); err != nil {
				t.Fatal(err)
			}
		}
		want1 := offload.Miss // the first lookup's bound
		if answerFirst {
			want1 = offload.Hit
		}
		next := c.Timeouts(t0.Add(7 * time.Second))
		if got := [2]offload.Result{r.Lookup(key(1)), r.Lookup(key(2))}; got != [2]offload.Result{want1, offload.Retry} {
			t.Errorf("answered first %v: at 7 s the keys answer %v, want [%v retry]", answerFirst, got, want1)
		}
		if want := t0.Add(12 * time.Second); !next.Equal(want) {
			t.Errorf("answered first %v: the next deadline %v, want the second lookup's %v", answerFirst, next, want)
		}
		wantTimeouts := uint64(1)
		if answerFirst {
			wantTimeouts = 0
		}
		if cs.Stats.LookupTimeouts != wantTimeouts {
			t.Errorf("answered first %v: %d lookup timeouts at 7 s, want %d", answerFirst, cs.Stats.LookupTimeouts, wantTimeouts)
		}
		if next := c.Timeouts(t0.Add(12 * time.Second)); !next.IsZero() || r.Lookup(key(2)) != offload.Miss {
			t.Errorf("answered first %v: at 12 s key 2 answers %v and the next deadline is %v, want miss and none", answerFirst, r.Lookup(key(2)), next)
		}
		if asked, _ := r.Probes(); asked != 0 {
			t.Errorf("answered first %v: %d keys still unanswered", answerFirst, asked)
		}
	}
}

// S6.10 "is counted" (found in review): a lookup answered in full does not
// count as a timeout because an earlier lookup of the request, still
// unanswered, times out in the same pass.
func TestConsumerCountsOnlyUnansweredLookups(t *testing.T) {
	cs, c := newCons() // lookup_timeout 7 s
	t0 := time.Unix(1000, 0)
	r := c.Add(&offload.Request{ID: "r"}, "kv")
	r.Probe([]offload.Key{key(1)})
	c.Ask(t0) // lookup 1: never answered
	r.Probe([]offload.Key{key(2)})
	c.Ask(t0.Add(time.Second)) // lookup 2: answered at once
	c.Take()
	if err := c.LookupResp(wire.LookupResp{ReqID: "kv", Round: r.round, Keys: []wire.Key{key(2)}, Hits: []bool{true}}); err != nil {
		t.Fatal(err)
	}
	c.Timeouts(t0.Add(10 * time.Second)) // both are older than lookup_timeout
	if r.Lookup(key(1)) != offload.Miss || r.Lookup(key(2)) != offload.Hit {
		t.Fatalf("answers %v %v", r.Lookup(key(1)), r.Lookup(key(2)))
	}
	if cs.Stats.LookupTimeouts != 1 {
		t.Errorf("%d lookup timeouts, want 1: only lookup 1 went unanswered", cs.Stats.LookupTimeouts)
	}
}

// S6.10: a lookup the dialect held back and sent later (Sent) has its
// bound from then; lookups sent before and after it still time out at
// their own (the bounds are not in sending order any more).
func TestConsumerHeldBackLookupBound(t *testing.T) {
	cs, c := newCons() // lookup_timeout 7 s
	t0 := time.Unix(1000, 0)
	r := c.Add(&offload.Request{ID: "r"}, "kv")
	for i := range 3 {
		r.Probe([]offload.Key{key(byte(i + 1))})
		c.Ask(t0.Add(time.Duration(i) * time.Second))
	}
	c.Take()
	c.Sent(wire.Lookup{ReqID: "kv", Round: r.round, Keys: []wire.Key{key(2)}}, t0.Add(5*time.Second)) // the second leaves at 5 s
	next := c.Timeouts(t0.Add(9 * time.Second))
	if got, want := [3]offload.Result{r.Lookup(key(1)), r.Lookup(key(2)), r.Lookup(key(3))}, [3]offload.Result{offload.Miss, offload.Retry, offload.Miss}; got != want {
		t.Errorf("at 9 s the keys answer %v, want %v", got, want)
	}
	if want := t0.Add(12 * time.Second); !next.Equal(want) || cs.Stats.LookupTimeouts != 2 {
		t.Errorf("next deadline %v, %d timeouts; want %v (the held one's) and 2", next, cs.Stats.LookupTimeouts, want)
	}
}

// checkLookups checks a consumer's per-lookup bookkeeping (S6.10): every
// pending key's lookup is tracked with keys left, the lookups' keys left
// add up to the keys asked, their numbers run on from the first, and the
// first has keys left.
func checkLookups(c *Consumer) error {
	for id, r := range c.reqs {
		pending := 0
		for k, v := range r.probes {
			if v.state != probePending {
				continue
			}
			pending++
			l := r.lookupOf(v)
			if l.n != v.lookup || l.left <= 0 {
				return fmt.Errorf("%s: pending key %x of lookup %d untracked (lookups %+v)", id, k[:1], v.lookup, r.lookups)
			}
		}
		if pending != r.asked {
			return fmt.Errorf("%s: asked %d, %d pending", id, r.asked, pending)
		}
		sum := 0
		for i, l := range r.lookups {
			if l.n != r.lookups[0].n+uint32(i) {
				return fmt.Errorf("%s: numbering %+v", id, r.lookups)
			}
			if l.left < 0 {
				return fmt.Errorf("%s: negative left %+v", id, r.lookups)
			}
			sum += l.left
		}
		if sum != r.asked {
			return fmt.Errorf("%s: lookups' left %d, asked %d (%+v)", id, sum, r.asked, r.lookups)
		}
		if len(r.lookups) > 0 && r.lookups[0].left == 0 {
			return fmt.Errorf("%s: untrimmed %+v", id, r.lookups)
		}
	}
	return nil
}

// Random walks (3,000 seeded, 60 steps each) over one consumer's events —
// probes, asks, partial, stale and hostile answers, timeouts, Sent, Left,
// loads, finishes, time passing — keep the per-lookup bookkeeping whole,
// Timeouts never asks for a deadline at or before now, and nothing stays
// pending a lookup_timeout after the last step (found no bug; kept as the
// bookkeeping's invariant).
func TestConsumerLookupsRandomWalk(t *testing.T) {
	for seed := range uint64(3000) {
		rng := rand.New(rand.NewPCG(seed, 7))
		_, c := newCons()
		T := c.cs.Config.LookupTimeout
		now := time.Unix(1000, 0)
		reqs := map[string]*Req{}
		var sentMsgs []wire.Lookup
		var log []string
		fail := func(err error) {
			t.Fatalf("seed %d: %v\nops: %v", seed, err, log)
		}
		ids := []string{"a", "b", "c"}
		job := uint64(0)
		for step := 0; step < 60; step++ {
			id := ids[rng.IntN(len(ids))]
			r := reqs[id]
			if r == nil {
				r = c.Add(&offload.Request{ID: id}, id)
				reqs[id] = r
				log = append(log, "add "+id)
			}
			switch op := rng.IntN(10); op {
			case 0, 1:
				var ks []offload.Key
				for range 1 + rng.IntN(3) {
					ks = append(ks, key(byte(1+rng.IntN(12))))
				}
				r.Probe(ks)
				log = append(log, fmt.Sprintf("probe %s %d", id, len(ks)))
			case 2:
				c.Ask(now)
				for _, a := range c.Take() {
					if f, ok := a.(SendFrame); ok {
						if l, ok := f.Msg.(wire.Lookup); ok {
							sentMsgs = append(sentMsgs, l)
						}
					}
				}
				log = append(log, "ask")
			case 3, 4:
				if len(sentMsgs) == 0 {
					continue
				}
				m := sentMsgs[rng.IntN(len(sentMsgs))]
				var ks []wire.Key
				var hits []bool
				for _, k := range m.Keys {
					if rng.IntN(3) > 0 {
						ks = append(ks, k)
						hits = append(hits, rng.IntN(2) == 0)
					}
				}
				if rng.IntN(4) == 0 {
					ks = append(ks, key(byte(1+rng.IntN(12))))
					hits = append(hits, true)
				}
				c.LookupResp(wire.LookupResp{ReqID: m.ReqID, Round: m.Round, Keys: ks, Hits: hits})
				c.Take()
				log = append(log, fmt.Sprintf("resp %s r%d %d", m.ReqID, m.Round, len(ks)))
			case 5:
				next := c.Timeouts(now)
				c.Take()
				if !next.IsZero() && !next.After(now) {
					fail(fmt.Errorf("Timeouts(%v) returned %v: not after now", now, next))
				}
				log = append(log, "timeouts")
			case 6:
				if len(sentMsgs) > 0 {
					c.Sent(sentMsgs[rng.IntN(len(sentMsgs))], now)
					log = append(log, "sent")
				} else {
					c.Left(now)
					log = append(log, "left")
				}
			case 7:
				if rng.IntN(3) == 0 {
					var hk []offload.Key
					var sl []int32
					for k, v := range r.probes {
						if v.state == probeHit {
							hk = append(hk, k)
							sl = append(sl, int32(len(sl)))
						}
					}
					job++
					c.Load(r, &offload.Job{ID: job, Keys: hk, Slots: sl}, true, now)
					c.Take()
					log = append(log, fmt.Sprintf("load %s %d", id, len(hk)))
				}
			case 8:
				if rng.IntN(3) == 0 {
					c.Finish(r, now)
					c.Take()
					delete(reqs, id)
					log = append(log, "finish "+id)
				}
			case 9:
				now = now.Add(time.Duration(rng.IntN(4000)) * time.Millisecond)
				log = append(log, "+t")
			}
			if err := checkLookups(c); err != nil {
				fail(err)
			}
		}
		// Everything asked is answered or missed by now + lookup_timeout.
		now = now.Add(T)
		c.Timeouts(now)
		c.Take()
		for id, r := range c.reqs {
			if r.asked != 0 || len(r.lookups) != 0 {
				fail(fmt.Errorf("%s: %d keys still pending, lookups %+v, after lookup_timeout", id, r.asked, r.lookups))
			}
		}
	}
}
