package p2ptest

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/kvtier/kvtier/offload"
)

// Issue 12: the lookup paths allocate nothing per key — the consumer's
// lookups of a remote request and the frame they send, the producer
// serving that lookup (its Lookups, the lease pinning every hit, the
// answer), the consumer taking the answer, and the engine's second pass,
// whose Lookups queue a promotion of every hit. A request of 256 keys
// allocates about as often as one of a single key: per request there is
// the request's own state, per frame its buffers; maps and lists grow a
// few times (about 30 allocations at 256 keys), not once a key, and the
// slots' records exist from the start. The slack, a quarter of an
// allocation a key, covers that growth, a garbage collection emptying the
// pools, and the peer's goroutines, which allocate in the same process.
// The load the promotions submit is outside the count (it moves each
// block).
func TestRemoteLookupAllocsPerKey(t *testing.T) {
	if race {
		t.Skip("the race detector makes sync.Pool drop items: counts would vary")
	}
	const n = 256
	prod := NewNode(t, tiny, 2*n, nil, nil)
	cons := NewNode(t, tiny, 2*n, nil, nil)
	keys := Keys(9, n, tiny.BlockTokens)
	prod.Store(t, keys)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1)) // as testing.AllocsPerRun
	var ms runtime.MemStats
	mallocs := func() uint64 {
		runtime.ReadMemStats(&ms)
		return ms.Mallocs
	}
	deadline := time.After(time.Minute)
	progress := func() {
		select {
		case <-cons.M.Progress():
		case <-deadline:
			t.Fatal("no progress for a minute")
		}
	}
	i := 0
	// round looks up keys[:n] as an engine does until the peer answered,
	// then until every block loaded, and reports the allocations from the
	// first lookup to the last Lookup of the pass that saw the answer.
	round := func(n int) uint64 {
		req := &offload.Request{ID: fmt.Sprintf("a-%d", i), TransferParams: Source(fmt.Sprintf("a-%d", i), prod.Tier.Addr())}
		i++
		cons.M.Do(func(s *offload.Step) { s.OnNewRequest(req) })
		for len(cons.M.Progress()) > 0 {
			<-cons.M.Progress()
		}
		look := func(want offload.Result) bool {
			s := cons.M.Begin()
			defer s.OnScheduleEnd()
			for _, k := range keys[:n] {
				if r := s.Lookup(k, req); r != want {
					return false
				}
			}
			return true
		}
		m0 := mallocs()
		if !look(offload.Retry) {
			t.Fatal("the first lookup of a remote key did not answer retry")
		}
		var m1 uint64
		for {
			progress()
			s := cons.M.Begin()
			r := s.Lookup(keys[0], req)
			for _, k := range keys[1:n] {
				s.Lookup(k, req)
			}
			if r != offload.Retry {
				m1 = mallocs()
				s.OnScheduleEnd()
				if r != offload.HitPending {
					t.Fatalf("a key the peer holds answered %v after its answer, want hit_pending", r)
				}
				break
			}
			s.OnScheduleEnd()
		}
		for !look(offload.Hit) {
			progress()
		}
		cons.M.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
		if err := cons.M.ResetCache(context.Background()); err != nil {
			t.Fatal(err)
		}
		return m1 - m0
	}
	avg := func(n int) float64 {
		var sum uint64
		for range 20 {
			sum += round(n)
		}
		return float64(sum) / 20
	}
	avg(n) // fills the pools and grows the maps
	one, many := avg(1), avg(n)
	t.Logf("allocations per round trip: %.1f for 1 key, %.1f for %d", one, many, n)
	if many > one+n/4 {
		t.Fatalf("%d keys allocate %.1f times per round trip, 1 key %.1f: the lookup paths allocate per key", n, many, one)
	}
}
