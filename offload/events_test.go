package offload

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
)

func eventsString(ev []Event) string {
	var b strings.Builder
	for _, e := range ev {
		fmt.Fprintf(&b, "\n  {seq %d %v tier %q keys %v epoch %d lost %d removed %v}", e.Seq, e.Kind, e.Tier, e.Keys, e.Epoch, e.Lost, e.Removed)
	}
	return b.String()
}

func checkEvents(t *testing.T, what string, got, want []Event) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s:\ngot%s\nwant%s", what, eventsString(got), eventsString(want))
	}
}

// storeOne stores k for a request of its own, inside one Do call.
func storeOne(t *testing.T, m *Manager, k Key) {
	t.Helper()
	req := &Request{ID: "w-" + k.String()}
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		p, err := s.PrepareStore([]Key{k}, req)
		if err != nil || p == nil {
			t.Fatalf("PrepareStore: %v %v", p, err)
		}
		s.CompleteStore(p.Keys, req, true)
		s.OnRequestFinished(req)
	})
}

// S2.8: the CPU and disk tiers' stored and removed keys reach a subscriber
// in the order they happened, numbered 1, 2, … across tiers; a cache reset
// is one "cleared" carrying the new epoch, never a removal per key.
func TestEventsAcrossTiers(t *testing.T) {
	m := diskManager(t, t.TempDir(), 2, 2)
	sub := m.Subscribe(0)
	defer sub.Close()
	k := testKeys(3)
	for _, key := range k {
		storeBlocks(t, m, []Key{key}) // returns once the cascade to disk ended
	}
	for range 2 {
		if err := m.ResetCache(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	want := []Event{
		{Seq: 1, Kind: EventStored, Tier: "cpu", Keys: k[:1]},
		{Seq: 2, Kind: EventStored, Tier: "disk", Keys: k[:1]},
		{Seq: 3, Kind: EventStored, Tier: "cpu", Keys: k[1:2]},
		{Seq: 4, Kind: EventStored, Tier: "disk", Keys: k[1:2]},
		{Seq: 5, Kind: EventRemoved, Removed: true, Tier: "cpu", Keys: k[:1]}, // evicted for k[2]
		{Seq: 6, Kind: EventStored, Tier: "cpu", Keys: k[2:3]},
		{Seq: 7, Kind: EventStored, Tier: "disk", Keys: k[2:3]},
		{Seq: 8, Kind: EventRemoved, Removed: true, Tier: "disk", Keys: k[:1]}, // over the 2-block cap
		{Seq: 9, Kind: EventCleared, Tier: "cpu", Epoch: 1},
		{Seq: 10, Kind: EventCleared, Tier: "cpu", Epoch: 2},
	}
	checkEvents(t, "events", sub.Take(), want)
	if ev := sub.Take(); ev != nil {
		t.Errorf("events taken twice:%s", eventsString(ev))
	}
}

// S2.8: a subscriber that does not keep up holds at most its buffer; the
// events it missed become one "lost" marker with their count and the Seq
// of the last one, and delivery goes on after it. Another subscriber is
// not affected.
func TestEventsSlowSubscriber(t *testing.T) {
	m := testManager(t, 2)
	slow, fast := m.Subscribe(3), m.Subscribe(0)
	defer slow.Close()
	defer fast.Close()
	k := testKeys(1001)
	var all []Event
	for i, key := range k[:1000] {
		storeOne(t, m, key)
		all = append(all, fast.Take()...)
		slow.mu.Lock()
		n := len(slow.mu.buf)
		slow.mu.Unlock()
		if n > 3 {
			t.Fatalf("after %d stores the slow subscriber buffers %d events, want at most 3", i+1, n)
		}
	}
	// 1000 stores into 2 slots: 1000 stored events and 998 evictions.
	const total = 1000 + 998
	if len(all) != total || all[len(all)-1].Seq != total {
		t.Fatalf("the fast subscriber got %d events, last seq %d; want %d", len(all), all[len(all)-1].Seq, total)
	}
	for i, e := range all {
		if e.Seq != uint64(i+1) || e.Kind == EventLost {
			t.Fatalf("fast subscriber event %d: %+v", i, e)
		}
	}
	want := append(all[:3:3], Event{Seq: total, Kind: EventLost, Lost: total - 3})
	checkEvents(t, "slow subscriber's events", slow.Take(), want)
	storeOne(t, m, k[1000])
	next := slow.Take()
	if len(next) != 2 || next[0].Seq != total+1 || next[1].Seq != total+2 || next[0].Kind != EventRemoved || next[1].Kind != EventStored {
		t.Errorf("after the lost marker:%s\nwant a removal and a store, seq %d and %d", eventsString(next), total+1, total+2)
	}
}

// S2.8: with no subscriber nothing is kept, not even a number: events from
// before Subscribe are never delivered, and after the last Close the
// manager holds no subscription and keeps nothing.
func TestEventsNoSubscriber(t *testing.T) {
	m := testManager(t, 2)
	k := testKeys(5)
	for _, key := range k[:3] {
		storeOne(t, m, key)
	}
	if m.events.seq != 0 || len(m.events.subs) != 0 {
		t.Fatalf("with no subscriber: seq %d, %d subscriptions; want nothing", m.events.seq, len(m.events.subs))
	}
	sub := m.Subscribe(0)
	if ev := sub.Take(); ev != nil {
		t.Errorf("events from before Subscribe:%s", eventsString(ev))
	}
	storeOne(t, m, k[3])
	checkEvents(t, "events after Subscribe", sub.Take(), []Event{
		{Seq: 1, Kind: EventRemoved, Removed: true, Tier: "cpu", Keys: k[1:2]},
		{Seq: 2, Kind: EventStored, Tier: "cpu", Keys: k[3:4]},
	})
	storeOne(t, m, k[4])
	sub.Close()
	sub.Close() // idempotent
	storeOne(t, m, k[0])
	if m.events.seq != 4 || len(m.events.subs) != 0 || sub.mu.buf != nil {
		t.Errorf("after Close: seq %d, %d subscriptions, buffer %v; want 4, 0, nil", m.events.seq, len(m.events.subs), sub.mu.buf)
	}
	if ev := sub.Take(); ev != nil {
		t.Errorf("a closed subscription got:%s", eventsString(ev))
	}
}

// S2.8: Next blocks until events arrive, until its context ends, or until
// the subscription or the manager closes; the manager's Close leaves what
// was buffered to be taken first.
func TestEventsNext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := testManager(t, 2)
		sub := m.Subscribe(0)
		k := testKeys(2)
		type got struct {
			ev  []Event
			err error
		}
		next := func(ctx context.Context, sub *Subscription) chan got {
			c := make(chan got, 1)
			go func() {
				ev, err := sub.Next(ctx)
				c <- got{ev, err}
			}()
			return c
		}

		c := next(context.Background(), sub)
		synctest.Wait()
		select {
		case r := <-c:
			t.Fatalf("Next returned with nothing to deliver: %+v", r)
		default:
		}
		storeOne(t, m, k[0])
		if r := <-c; r.err != nil || len(r.ev) != 1 || r.ev[0].Seq != 1 {
			t.Errorf("Next after a store = %s, %v; want the stored event", eventsString(r.ev), r.err)
		}

		ctx, cancel := context.WithCancelCause(context.Background())
		c = next(ctx, sub)
		synctest.Wait()
		stop := errors.New("stop")
		cancel(stop)
		if r := <-c; !errors.Is(r.err, stop) {
			t.Errorf("Next after its context ended: %v, want its cause", r.err)
		}

		closing := m.Subscribe(0)
		c = next(context.Background(), closing)
		synctest.Wait()
		closing.Close()
		if r := <-c; !errors.Is(r.err, ErrClosed) {
			t.Errorf("a Next waiting when its subscription closed: %v, want ErrClosed", r.err)
		}

		storeOne(t, m, k[1])
		idle := m.Subscribe(0)
		c = next(context.Background(), idle)
		synctest.Wait()
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
		if r := <-c; !errors.Is(r.err, ErrClosed) {
			t.Errorf("a Next waiting when the manager closed: %v, want ErrClosed", r.err)
		}
		if r := <-next(context.Background(), sub); r.err != nil || len(r.ev) != 1 || r.ev[0].Seq != 2 {
			t.Errorf("Next with events buffered before Close = %s, %v; want them", eventsString(r.ev), r.err)
		}
		if r := <-next(context.Background(), sub); !errors.Is(r.err, ErrClosed) {
			t.Errorf("Next after the manager closed: %v, want ErrClosed", r.err)
		}
		if r := <-next(context.Background(), m.Subscribe(0)); !errors.Is(r.err, ErrClosed) {
			t.Errorf("a subscription made after Close: %v, want ErrClosed", r.err)
		}
	})
}

// Issue 14: a store of a request that gave its prompt (Request.Chain)
// reports each run of consecutive blocks with the parent of its first key
// and their token ids; a block already held splits the run; JSON writes
// keys as 64 lowercase hex digits.
func TestEventsCarryChain(t *testing.T) {
	m := testManager(t, 8)
	sub := m.Subscribe(0)
	defer sub.Close()
	tokens := make([]uint32, 4*16+3)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	chain := NewChain(KeyScheme{Seed: m.Config().HashSeed}, 16, tokens)
	if len(chain.Keys) != 4 || len(chain.Tokens) != 64 {
		t.Fatalf("chain of %d keys, %d tokens; want 4 full blocks", len(chain.Keys), len(chain.Tokens))
	}
	storeOne(t, m, chain.Keys[1]) // held already: the request's store skips it
	sub.Take()
	req := &Request{ID: "r", Chain: chain}
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		p, err := s.PrepareStore(chain.Keys, req)
		if err != nil || p == nil || len(p.Keys) != 3 {
			t.Fatalf("PrepareStore: %v %v", p, err)
		}
		s.CompleteStore(p.Keys, req, true)
		s.OnRequestFinished(req)
	})
	ev := sub.Take()
	if len(ev) != 2 {
		t.Fatalf("events:%s\nwant two runs", eventsString(ev))
	}
	root, k := RootKey(m.Config().HashSeed), chain.Keys
	if e := ev[0]; !reflect.DeepEqual(e.Keys, k[:1]) || *e.Parent != root || !reflect.DeepEqual(e.Tokens, tokens[:16]) {
		t.Errorf("first run: keys %v parent %v tokens %v; want block 0 under the root", e.Keys, e.Parent, e.Tokens)
	}
	if e := ev[1]; !reflect.DeepEqual(e.Keys, k[2:4]) || *e.Parent != k[1] || !reflect.DeepEqual(e.Tokens, tokens[32:64]) {
		t.Errorf("second run: keys %v parent %v tokens %d; want blocks 2, 3 under block 1", e.Keys, e.Parent, len(e.Tokens))
	}
	b, err := json.Marshal(ev[1])
	if err != nil {
		t.Fatal(err)
	}
	hexKey := hex.EncodeToString(k[2][:])
	if !strings.Contains(string(b), `"keys":["`+hexKey+`"`) || !strings.Contains(string(b), `"parent":"`+hex.EncodeToString(k[1][:])+`"`) ||
		!strings.Contains(string(b), `"kind":"stored"`) || !strings.Contains(string(b), `"token_ids":[1032,`) {
		t.Errorf("JSON %s: want hex keys and parent, the kind's name and token ids", b)
	}
	var back Event
	if err := json.Unmarshal(b, &back); err != nil || back.Keys[0] != k[2] || *back.Parent != k[1] {
		t.Errorf("JSON does not read back: %v %+v", err, back)
	}
}

// Issue 14, S2.8: a subscriber that never takes costs the manager its
// buffer and no more: 20,000 events into a buffer of 64 leave the heap
// where it was (measured), and one lost marker counts the rest.
func TestEventsSlowSubscriberHeap(t *testing.T) {
	m := testManager(t, 2)
	sub := m.Subscribe(64)
	defer sub.Close()
	k := testKeys(10000)
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	for _, key := range k[:100] {
		storeOne(t, m, key)
	}
	before := heap()
	for _, key := range k[100:] {
		storeOne(t, m, key)
	}
	after := heap()
	if after > before+256<<10 {
		t.Errorf("heap grew %d KiB over 19,800 undelivered events, want under 256 KiB", (after-before)>>10)
	}
	ev := sub.Take()
	if len(ev) != 65 || ev[64].Kind != EventLost || ev[64].Lost != 2*10000-2-64 {
		t.Errorf("took %d events, last %+v; want 64 and a lost marker for %d", len(ev), ev[len(ev)-1], 2*10000-2-64)
	}
}

// Issue 14: Blocks pages a tier's ready blocks in key order with the
// event number they are current to; a block being written is not listed;
// bad limits and unknown tiers are errors.
func TestBlocksPages(t *testing.T) {
	m := diskManager(t, t.TempDir(), 8, 8)
	sub := m.Subscribe(0)
	defer sub.Close()
	k := testKeys(5)
	storeBlocks(t, m, k) // and their cascade to disk
	writing := &Request{ID: "w"}
	m.Do(func(s *Step) {
		s.OnNewRequest(writing)
		s.PrepareStore(testKeys(6)[5:], writing) // reserved, never completed
	})
	want := slices.SortedFunc(slices.Values(k), func(a, b Key) int { return bytes.Compare(a[:], b[:]) })
	for _, tier := range []string{"cpu", "disk"} {
		var got []Key
		var after *Key
		var seqs []uint64
		for range 10 {
			p, err := m.Blocks(tier, after, 2)
			if err != nil {
				t.Fatal(err)
			}
			got, seqs = append(got, p.Keys...), append(seqs, p.Seq)
			if p.Next == nil {
				break
			}
			after = p.Next
		}
		if !slices.Equal(got, want) || seqs[0] != m.eventSeq() || len(seqs) != 3 {
			t.Errorf("%s: pages %v (seqs %v), want %v in 3 pages at event %d", tier, got, seqs, want, m.eventSeq())
		}
	}
	for _, bad := range []struct {
		tier  string
		limit int
	}{{"cpu", 0}, {"cpu", MaxBlockPage + 1}, {"nope", 10}} {
		if _, err := m.Blocks(bad.tier, nil, bad.limit); !errors.Is(err, ErrConfig) {
			t.Errorf("Blocks(%q, %d): %v, want ErrConfig", bad.tier, bad.limit, err)
		}
	}
	m.Do(func(s *Step) { s.Abort(writing) })
}
