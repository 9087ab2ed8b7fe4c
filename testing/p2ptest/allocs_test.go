package p2ptest

import (
	"fmt"
	"testing"

	"github.com/kvtier/kvtier/offload"
)

// Issue 12: a consumer's lookups of a remote request, and the lookup
// frame they send, allocate nothing per key: a request of 64 keys
// allocates about as often as one of a single key (per request there is
// the request's own state; maps come back from finished requests). The
// slack, a quarter of an allocation a key, covers a map or list growing
// (a few times, not once a key) when a garbage collection emptied the
// pools, and the peer's goroutines, which allocate in the same process.
func TestRemoteLookupAllocsPerKey(t *testing.T) {
	if race {
		t.Skip("the race detector makes sync.Pool drop items: counts would vary")
	}
	prod := NewNode(t, tiny, 64, nil, nil)
	cons := NewNode(t, tiny, 64, nil, nil)
	keys := Keys(9, 64, tiny.BlockTokens)
	i := 0
	allocs := func(n int) float64 {
		return testing.AllocsPerRun(50, func() {
			req := &offload.Request{ID: fmt.Sprintf("a-%d", i), TransferParams: Source(fmt.Sprintf("a-%d", i), prod.Tier.Addr())}
			i++
			cons.M.Do(func(s *offload.Step) { s.OnNewRequest(req) })
			s := cons.M.Begin()
			for _, k := range keys[:n] {
				if r := s.Lookup(k, req); r != offload.Retry {
					t.Fatalf("first lookup of a remote key: %v, want retry", r)
				}
			}
			s.OnScheduleEnd()
			cons.M.Do(func(s *offload.Step) { s.Abort(req) })
		})
	}
	allocs(64) // fills the pools
	one, many := allocs(1), allocs(64)
	if many > one+16 {
		t.Fatalf("64 keys allocate %.1f times per request, 1 key %.1f: lookups allocate per key", many, one)
	}
}
