package offload

import (
	"container/heap"
	"container/list"
	"fmt"
)

// Policy chooses which blocks the CPU tier evicts. The CPU tier tells it
// about every resident key and whether the key is evictable (ready and
// unpinned); the policy never sees a slot's bytes. Calls come with the
// manager lock held.
type Policy interface {
	// Name is the policy's config name ("lru", "arc").
	Name() string
	// Insert records a newly resident key; it starts not evictable.
	Insert(k Key)
	// SetEvictable marks a resident key evictable or not.
	SetEvictable(k Key, evictable bool)
	// Access records a use of a resident key (a load or a touch).
	Access(k Key)
	// Remove forgets a key whose slot was freed without eviction.
	Remove(k Key)
	// Evict removes and returns exactly n evictable keys for which protected
	// is false, or returns nil and changes nothing if there are fewer.
	Evict(n int, protected func(Key) bool) []Key
}

// NewPolicy returns the policy called name with room for capacity keys.
func NewPolicy(name string, capacity int) (Policy, error) {
	switch name {
	case "lru":
		return newLRU(), nil
	case "arc":
		return newARC(capacity), nil
	}
	return nil, fmt.Errorf("%w: cpu_policy: unknown policy %q (want lru or arc)", ErrConfig, name)
}

// lru evicts the least recently used evictable key. A key enters the
// order at the most recent end when it first becomes evictable (its write
// committed) and moves there on each use (Access). Becoming unevictable (a
// pin) keeps its place: a read pin that records no use (a cascade's, a
// lease's, a scrub's) leaves the order as it was: a scrub pins every
// block, and would otherwise shuffle the order by its unpins. A pinned key
// that Evict meets is set aside (out of the order, keeping its place,
// seq), and goes into back when it is evictable again, from where Evict
// takes it in its turn: an Evict walks past no pinned key twice, where
// it used to walk past every pinned key at the least recent end each time
// (282 µs an Evict(1) with the 65,536 oldest of 200,000 keys pinned).
type lru struct {
	order *list.List // of *lruEntry, least recent first
	back  lruHeap    // set aside while pinned, evictable again: least recent first
	elems map[Key]*lruEntry
	seq   uint64 // the last place given
}

type lruEntry struct {
	key       Key
	seq       uint64 // its place in the use order
	evictable bool
	elem      *list.Element // in order; nil when set aside or in back
	at        int           // its index in back; -1 when not there
}

// lruHeap is a min-heap of entries by seq (container/heap).
type lruHeap []*lruEntry

func (h lruHeap) Len() int           { return len(h) }
func (h lruHeap) Less(i, j int) bool { return h[i].seq < h[j].seq }
func (h lruHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].at, h[j].at = i, j
}
func (h *lruHeap) Push(x any) {
	e := x.(*lruEntry)
	e.at = len(*h)
	*h = append(*h, e)
}
func (h *lruHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	e.at = -1
	return e
}

func newLRU() *lru { return &lru{order: list.New(), elems: make(map[Key]*lruEntry)} }

func (p *lru) Name() string { return "lru" }
func (p *lru) Insert(Key)   {}

func (p *lru) SetEvictable(k Key, evictable bool) {
	e, ok := p.elems[k]
	switch {
	case !ok && evictable:
		p.seq++
		e = &lruEntry{key: k, seq: p.seq, evictable: true, at: -1}
		e.elem = p.order.PushBack(e)
		p.elems[k] = e
	case !ok:
	case evictable && e.elem == nil && e.at < 0: // set aside: back in its turn
		e.evictable = true
		heap.Push(&p.back, e)
	case !evictable && e.at >= 0: // set aside again
		heap.Remove(&p.back, e.at)
		e.evictable = false
	default:
		e.evictable = evictable
	}
}

// detach takes e out of the order or back.
func (p *lru) detach(e *lruEntry) {
	if e.elem != nil {
		p.order.Remove(e.elem)
		e.elem = nil
	}
	if e.at >= 0 {
		heap.Remove(&p.back, e.at)
	}
}

func (p *lru) Access(k Key) {
	if e, ok := p.elems[k]; ok {
		if e.elem != nil {
			p.order.MoveToBack(e.elem)
		} else {
			p.detach(e)
			e.elem = p.order.PushBack(e)
		}
		p.seq++
		e.seq = p.seq
	}
}

func (p *lru) Remove(k Key) {
	if e, ok := p.elems[k]; ok {
		p.detach(e)
		delete(p.elems, k)
	}
}

// Evict takes the least recent of the order's and back's candidates, n
// times; pinned keys it meets in the order are set aside on the way (that
// changes no key's place), and if there are fewer than n it puts back
// what it took and changes nothing else.
func (p *lru) Evict(n int, protected func(Key) bool) []Key {
	var victims, skipped []*lruEntry // skipped: protected, taken off back
	el := p.order.Front()
	var next *lruEntry // the order's next candidate
	for len(victims) < n {
		for next == nil && el != nil {
			e, after := el.Value.(*lruEntry), el.Next()
			switch {
			case !e.evictable:
				p.order.Remove(el)
				e.elem = nil
			case protected == nil || !protected(e.key):
				next = e
			}
			el = after
		}
		var top *lruEntry
		for len(p.back) > 0 && top == nil {
			if e := p.back[0]; protected == nil || !protected(e.key) {
				top = e
			} else {
				skipped = append(skipped, heap.Pop(&p.back).(*lruEntry))
			}
		}
		switch {
		case top != nil && (next == nil || top.seq < next.seq):
			victims = append(victims, heap.Pop(&p.back).(*lruEntry))
		case next != nil:
			victims, next = append(victims, next), nil
		default: // fewer than n
			for _, e := range victims {
				if e.elem == nil {
					heap.Push(&p.back, e)
				}
			}
			victims = nil
		}
		if victims == nil {
			break
		}
	}
	for _, e := range skipped {
		heap.Push(&p.back, e)
	}
	if len(victims) < n {
		return nil
	}
	keys := make([]Key, len(victims))
	for i, e := range victims {
		keys[i] = e.key
		if e.elem != nil {
			p.order.Remove(e.elem)
		}
		delete(p.elems, e.key)
	}
	return keys
}

// arc is the adaptive replacement cache (Megiddo and Modha): resident keys
// seen once live in t1, keys seen again in t2; b1 and b2 remember recently
// evicted keys and steer the target size of t1. Pinned and writing keys
// stay in their lists but are skipped by eviction.
type arc struct {
	capacity       int
	target         int // target size of t1
	t1, t2, b1, b2 *list.List
	entries        map[Key]*arcEntry
}

type arcEntry struct {
	key       Key
	in        *list.List
	elem      *list.Element
	evictable bool
}

func newARC(capacity int) *arc {
	return &arc{capacity: capacity, t1: list.New(), t2: list.New(), b1: list.New(), b2: list.New(), entries: make(map[Key]*arcEntry)}
}

func (p *arc) Name() string { return "arc" }

func (p *arc) move(e *arcEntry, to *list.List) {
	if e.in != nil {
		e.in.Remove(e.elem)
	}
	e.in = to
	e.elem = to.PushBack(e)
}

func (p *arc) Insert(k Key) {
	e, ok := p.entries[k]
	if !ok {
		e = &arcEntry{key: k}
		p.entries[k] = e
		p.move(e, p.t1)
		return
	}
	switch e.in {
	case p.b1: // evicted too early from t1: favour recency
		p.target = min(p.capacity, p.target+max(p.b2.Len()/max(p.b1.Len(), 1), 1))
		p.move(e, p.t2)
	case p.b2: // evicted too early from t2: favour frequency
		p.target = max(0, p.target-max(p.b1.Len()/max(p.b2.Len(), 1), 1))
		p.move(e, p.t2)
	}
	e.evictable = false
}

func (p *arc) resident(k Key) *arcEntry {
	if e, ok := p.entries[k]; ok && (e.in == p.t1 || e.in == p.t2) {
		return e
	}
	return nil
}

func (p *arc) SetEvictable(k Key, evictable bool) {
	if e := p.resident(k); e != nil {
		e.evictable = evictable
	}
}

func (p *arc) Access(k Key) {
	if e := p.resident(k); e != nil {
		p.move(e, p.t2)
	}
}

func (p *arc) Remove(k Key) {
	if e := p.resident(k); e != nil {
		e.in.Remove(e.elem)
		delete(p.entries, k)
	}
}

// candidate returns the least recent evictable, unprotected entry of l that
// is not in taken.
func (p *arc) candidate(l *list.List, protected func(Key) bool, taken map[*arcEntry]bool) *arcEntry {
	for el := l.Front(); el != nil; el = el.Next() {
		e := el.Value.(*arcEntry)
		if e.evictable && !taken[e] && (protected == nil || !protected(e.key)) {
			return e
		}
	}
	return nil
}

func (p *arc) Evict(n int, protected func(Key) bool) []Key {
	taken := make(map[*arcEntry]bool, n)
	victims := make([]*arcEntry, 0, n)
	t1Len := p.t1.Len()
	for len(victims) < n {
		c1 := p.candidate(p.t1, protected, taken)
		c2 := p.candidate(p.t2, protected, taken)
		var v *arcEntry
		switch {
		case c1 != nil && (t1Len > p.target || c2 == nil):
			v = c1
			t1Len--
		case c2 != nil:
			v = c2
		case c1 != nil:
			v = c1
			t1Len--
		default:
			return nil
		}
		taken[v] = true
		victims = append(victims, v)
	}
	keys := make([]Key, len(victims))
	for i, v := range victims {
		keys[i] = v.key
		if v.in == p.t1 {
			p.move(v, p.b1)
		} else {
			p.move(v, p.b2)
		}
		v.evictable = false
	}
	for p.b1.Len()+p.b2.Len() > p.capacity {
		ghosts := p.b1
		if p.b2.Len() > p.b1.Len() {
			ghosts = p.b2
		}
		e := ghosts.Remove(ghosts.Front()).(*arcEntry)
		delete(p.entries, e.key)
	}
	return keys
}
