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
	order *list.List         // of *lruEntry, least recent first
	back  seqHeap[*lruEntry] // set aside while pinned, evictable again: least recent first
	elems map[Key]*lruEntry
	seq   uint64 // the last place given
}

type lruEntry struct {
	key Key
	place
	evictable bool
	elem      *list.Element // in order; nil when set aside or in back
}

// place is an entry's place in a use order: seq, and its index at in a
// seqHeap (-1 when not in one).
type place struct {
	seq uint64
	at  int
}

func (p *place) placed() *place { return p }

// seqHeap is a min-heap by seq (container/heap) of the entries set aside
// while pinned that are evictable again: least recent first.
type seqHeap[E interface{ placed() *place }] []E

func (h seqHeap[E]) Len() int           { return len(h) }
func (h seqHeap[E]) Less(i, j int) bool { return h[i].placed().seq < h[j].placed().seq }
func (h seqHeap[E]) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].placed().at, h[j].placed().at = i, j
}
func (h *seqHeap[E]) Push(x any) {
	e := x.(E)
	e.placed().at = len(*h)
	*h = append(*h, e)
}
func (h *seqHeap[E]) Pop() any {
	old := *h
	e := old[len(old)-1]
	var zero E
	old[len(old)-1] = zero
	*h = old[:len(old)-1]
	e.placed().at = -1
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
		e = &lruEntry{key: k, place: place{seq: p.seq, at: -1}, evictable: true}
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
// evicted keys and steer the target size of t1. A pinned key that Evict
// meets is set aside as the LRU's are: it stays in its list (t1 or t2 by
// its in, counted in the list's size) and keeps its place (seq), out of
// the list's order, and goes into the list's back when it is evictable
// again, from where Evict takes it in its turn (an Evict walked past
// every pinned key at the front of t1 and t2, and past every key it had
// already chosen, each time it chose one).
type arc struct {
	capacity       int
	target         int // target size of t1
	t1, t2, b1, b2 *list.List
	res            [2]arcResident // t1's and t2's keys set aside
	entries        map[Key]*arcEntry
	seq            uint64 // the last place given
}

// arcResident is what a resident list has set aside: aside keys in all,
// those of them evictable again in back.
type arcResident struct {
	aside int
	back  seqHeap[*arcEntry]
}

type arcEntry struct {
	key Key
	place
	in        *list.List    // t1, t2, b1 or b2
	elem      *list.Element // in in; nil while set aside
	evictable bool
}

func newARC(capacity int) *arc {
	return &arc{capacity: capacity, t1: list.New(), t2: list.New(), b1: list.New(), b2: list.New(), entries: make(map[Key]*arcEntry)}
}

func (p *arc) Name() string { return "arc" }

// resOf is what list l (t1 or t2) has set aside.
func (p *arc) resOf(l *list.List) *arcResident {
	if l == p.t1 {
		return &p.res[0]
	}
	return &p.res[1]
}

// size is t1's or t2's size, its keys set aside included.
func (p *arc) size(l *list.List) int { return l.Len() + p.resOf(l).aside }

// detach takes e out of its list's order or what the list set aside.
func (p *arc) detach(e *arcEntry) {
	switch {
	case e.elem != nil:
		e.in.Remove(e.elem)
		e.elem = nil
	case e.in != nil:
		r := p.resOf(e.in)
		r.aside--
		if e.at >= 0 {
			heap.Remove(&r.back, e.at)
		}
	}
}

func (p *arc) move(e *arcEntry, to *list.List) {
	p.detach(e)
	e.in = to
	e.elem = to.PushBack(e)
	p.seq++
	e.seq = p.seq
}

func (p *arc) Insert(k Key) {
	e, ok := p.entries[k]
	if !ok {
		e = &arcEntry{key: k, place: place{at: -1}}
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
	p.setEvictable(e, false)
}

func (p *arc) resident(k Key) *arcEntry {
	if e, ok := p.entries[k]; ok && (e.in == p.t1 || e.in == p.t2) {
		return e
	}
	return nil
}

func (p *arc) SetEvictable(k Key, evictable bool) {
	if e := p.resident(k); e != nil {
		p.setEvictable(e, evictable)
	}
}

func (p *arc) setEvictable(e *arcEntry, evictable bool) {
	if e.elem == nil { // set aside: into back in its turn, or out of it
		r := p.resOf(e.in)
		switch {
		case evictable && e.at < 0:
			heap.Push(&r.back, e)
		case !evictable && e.at >= 0:
			heap.Remove(&r.back, e.at)
		}
	}
	e.evictable = evictable
}

func (p *arc) Access(k Key) {
	if e := p.resident(k); e != nil {
		p.move(e, p.t2)
	}
}

func (p *arc) Remove(k Key) {
	if e := p.resident(k); e != nil {
		p.detach(e)
		delete(p.entries, k)
	}
}

// arcCursor finds the least recent evictable, unprotected key of t1 or t2
// that Evict has not chosen yet: from the list's order (past the keys
// already chosen, setting pinned ones aside) and from its back.
type arcCursor struct {
	p         *arc
	l         *list.List
	el        *list.Element // the order's next key to look at
	next      *arcEntry     // the order's candidate
	skipped   []*arcEntry   // protected, taken off back for this Evict
	fromBack  []*arcEntry   // chosen, taken off back
	protected func(Key) bool
}

func (c *arcCursor) candidate() *arcEntry {
	r := c.p.resOf(c.l)
	for c.next == nil && c.el != nil {
		e, after := c.el.Value.(*arcEntry), c.el.Next()
		switch {
		case !e.evictable:
			c.l.Remove(c.el)
			e.elem = nil
			r.aside++
		case c.protected == nil || !c.protected(e.key):
			c.next = e
		}
		c.el = after
	}
	var top *arcEntry
	for len(r.back) > 0 && top == nil {
		if e := r.back[0]; c.protected == nil || !c.protected(e.key) {
			top = e
		} else {
			c.skipped = append(c.skipped, heap.Pop(&r.back).(*arcEntry))
		}
	}
	if top != nil && (c.next == nil || top.seq < c.next.seq) {
		return top
	}
	return c.next
}

// take marks v, the last candidate, chosen.
func (c *arcCursor) take(v *arcEntry) {
	if v == c.next {
		c.next = nil
		return
	}
	c.fromBack = append(c.fromBack, heap.Pop(&c.p.resOf(c.l).back).(*arcEntry))
}

// done puts back what the cursor took off back for this Evict: the
// protected keys, and the chosen ones too unless kept.
func (c *arcCursor) done(kept bool) {
	r := c.p.resOf(c.l)
	for _, e := range c.skipped {
		heap.Push(&r.back, e)
	}
	if !kept {
		for _, e := range c.fromBack {
			heap.Push(&r.back, e)
		}
	}
}

func (p *arc) Evict(n int, protected func(Key) bool) []Key {
	c1 := arcCursor{p: p, l: p.t1, el: p.t1.Front(), protected: protected}
	c2 := arcCursor{p: p, l: p.t2, el: p.t2.Front(), protected: protected}
	victims := make([]*arcEntry, 0, n)
	t1Len := p.size(p.t1)
	for len(victims) < n {
		v1, v2 := c1.candidate(), c2.candidate()
		switch {
		case v1 != nil && (t1Len > p.target || v2 == nil):
			c1.take(v1)
			victims = append(victims, v1)
			t1Len--
		case v2 != nil:
			c2.take(v2)
			victims = append(victims, v2)
		case v1 != nil:
			c1.take(v1)
			victims = append(victims, v1)
			t1Len--
		default: // fewer than n: nothing changes but what was set aside
			c1.done(false)
			c2.done(false)
			return nil
		}
	}
	c1.done(true)
	c2.done(true)
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
