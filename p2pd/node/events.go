package node

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
)

// eventLog keeps the newest events of the manager's stream (S2.8) for
// GET /v0/events: the node's one subscription, drained by one goroutine
// (stopped by the manager's Close, which closes the subscription; joined
// by close) into a ring of event_history events. Readers of the API walk
// the ring at their own pace from a sequence number: one that falls more
// than the ring behind is told how many it lost, so a slow reader costs
// the node nothing beyond the ring.
type eventLog struct {
	sub  *offload.Subscription
	done chan struct{} // closed when the drain goroutine returned

	base uint64 // the number before this run's first event

	mu      sync.Mutex
	ring    []offload.Event // oldest at head, len ≤ cap
	head    int
	n       int
	last    uint64        // Seq of the newest event; 0 before the first
	changed chan struct{} // closed, and replaced, on every append and at the end
	ended   bool
}

func newEventLog(m *offload.Manager, base uint64, history int) *eventLog {
	l := &eventLog{sub: m.Subscribe(offload.DefaultEventBuffer), done: make(chan struct{}), base: base, last: base,
		ring: make([]offload.Event, history), changed: make(chan struct{})}
	go l.drain()
	return l
}

func (l *eventLog) drain() {
	defer close(l.done)
	for {
		ev, err := l.sub.Next(context.Background()) // ends with ErrClosed at the manager's Close
		if err != nil {
			l.mu.Lock()
			l.ended = true
			close(l.changed)
			l.mu.Unlock()
			return
		}
		l.mu.Lock()
		for _, e := range ev {
			// Token ids share the request's whole prompt (offload.Chain):
			// the ring keeps a copy of the event's own (found in review: 32
			// one-block events held 31 MiB of prompts).
			e.Tokens = slices.Clone(e.Tokens)
			l.push(e)
		}
		close(l.changed)
		l.changed = make(chan struct{})
		l.mu.Unlock()
	}
}

func (l *eventLog) push(e offload.Event) {
	if l.n < len(l.ring) {
		l.ring[(l.head+l.n)%len(l.ring)] = e
		l.n++
	} else {
		l.ring[l.head] = e
		l.head = (l.head + 1) % len(l.ring)
	}
	l.last = e.Seq
}

// close stops the subscription and joins the drain goroutine.
func (l *eventLog) close() {
	l.sub.Close()
	<-l.done
}

// Last is the newest event's sequence number.
func (l *eventLog) Last() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.last
}

// read returns up to max events after since, in order: when events after
// since are no longer held, a lost marker for them comes first. since 0
// is this run's start (a reader that holds nothing); a since from before
// this run (the node restarted) gets a lost marker. With nothing after
// since it returns a channel closed when something arrives (or the log
// ends) and whether the log ended.
func (l *eventLog) read(since uint64, max int) (ev []offload.Event, wait <-chan struct{}, ended bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if since == 0 {
		since = l.base
	}
	if since >= l.last {
		return nil, l.changed, l.ended
	}
	oldest := l.ring[l.head].Seq
	if l.ring[l.head].Kind == offload.EventLost {
		oldest -= l.ring[l.head].Lost - 1 // it stands for the events up to its Seq
	}
	if since+1 < oldest {
		ev = append(ev, offload.Event{Seq: oldest - 1, Kind: offload.EventLost, Lost: oldest - 1 - since})
	}
	at := func(i int) offload.Event { return l.ring[(l.head+i)%len(l.ring)] }
	for i := sort.Search(l.n, func(i int) bool { return at(i).Seq > since }); i < l.n && len(ev) < max; i++ {
		e := at(i)
		if e.Kind == offload.EventLost && e.Seq-e.Lost < since {
			e.Lost = e.Seq - since // the reader had the first of them
		}
		ev = append(ev, e)
	}
	return ev, nil, l.ended
}

// eventBatch bounds the events one read of the log hands a stream;
// eventWriteTimeout bounds writing one batch to a follower.
const (
	eventBatch        = 1024
	eventWriteTimeout = 30 * time.Second
)

func toAPIEvent(e offload.Event) api.Event {
	a := api.Event{Seq: e.Seq, Kind: e.Kind.String(), Tier: e.Tier, TokenIDs: e.Tokens, Epoch: e.Epoch, Lost: e.Lost}
	for _, k := range e.Keys {
		t, _ := k.MarshalText()
		a.Keys = append(a.Keys, string(t))
	}
	if e.Parent != nil {
		t, _ := e.Parent.MarshalText()
		a.Parent = string(t)
	}
	return a
}

// events serves GET /v0/events?since=SEQ&follow=BOOL: the events after
// since (default: the newest, so only what comes next), one JSON line
// each, flushed per batch; with follow (the default) it waits for more
// until the client goes, the node shuts down or the stream ends.
func (n *Node) events(w http.ResponseWriter, r *http.Request) {
	q, ok := params(w, r, "since", "follow")
	if !ok {
		return
	}
	since := n.evlog.Last()
	if v, ok := q["since"]; ok {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			fail(w, 400, "since: %q is not a sequence number", v)
			return
		}
		if newest := n.M.EventSeq(); s > newest {
			// Not a number this node gave: resuming from it would skip
			// what comes until the numbers reach it (found in review).
			fail(w, 400, "since: %d is after the newest event, %d (a number from another node?)", s, newest)
			return
		}
		since = s
	}
	follow := true
	if v, ok := q["follow"]; ok {
		f, err := strconv.ParseBool(v)
		if err != nil {
			fail(w, 400, "follow: %q is not a boolean", v)
			return
		}
		follow = f
	}
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(200)
	rc := http.NewResponseController(w)
	if err := rc.Flush(); err != nil { // the headers now: a follower knows it is connected
		return
	}
	// Every write is bounded (a follower that stops reading must not hold
	// a goroutine, or the node's shutdown, for ever): eventWriteTimeout a
	// batch, and a second once the node shuts down, also for a write
	// already blocked.
	var deadline struct {
		sync.Mutex
		final bool
	}
	setDeadline := func(d time.Duration, final bool) {
		deadline.Lock()
		defer deadline.Unlock()
		if !deadline.final {
			deadline.final = final
			rc.SetWriteDeadline(time.Now().Add(d))
		}
	}
	done := make(chan struct{})
	defer close(done)
	go func() { // ends with the handler
		select {
		case <-n.quit:
			setDeadline(time.Second, true)
		case <-done:
		}
	}()
	enc := json.NewEncoder(w)
	for {
		ev, wait, ended := n.evlog.read(since, eventBatch)
		if len(ev) > 0 {
			setDeadline(eventWriteTimeout, false)
		}
		for _, e := range ev {
			if err := enc.Encode(toAPIEvent(e)); err != nil {
				return // the client went
			}
			since = e.Seq
		}
		if len(ev) > 0 {
			if err := rc.Flush(); err != nil {
				return
			}
			continue
		}
		if !follow || ended {
			return
		}
		select {
		case <-wait:
		case <-r.Context().Done():
			return
		case <-n.quit:
			if ev, _, _ := n.evlog.read(since, eventBatch); len(ev) > 0 {
				continue // what was there when the node began to stop
			}
			return
		}
	}
}

// blocks serves GET /v0/blocks?tier=T&cursor=KEY&limit=N: one page of
// what tier T (default cpu) holds.
func (n *Node) blocks(w http.ResponseWriter, r *http.Request) {
	q, ok := params(w, r, "tier", "cursor", "limit")
	if !ok {
		return
	}
	limit := 1000
	if v, ok := q["limit"]; ok {
		l, err := strconv.Atoi(v)
		if err != nil || l < 1 || l > offload.MaxBlockPage {
			fail(w, 400, "limit: %q is not in [1, %d]", v, offload.MaxBlockPage)
			return
		}
		limit = l
	}
	var after *offload.Key
	if v, ok := q["cursor"]; ok && v != "" {
		k, err := offload.ParseKey(v)
		if err != nil {
			fail(w, 400, "cursor: %v", err)
			return
		}
		after = &k
	}
	page, err := n.M.Blocks(orDefault(q["tier"], "cpu"), after, limit)
	if err != nil {
		fail(w, 400, "%v", err)
		return
	}
	out := api.Blocks{Tier: page.Tier, Seq: page.Seq, Keys: make([]string, len(page.Keys))}
	for i, k := range page.Keys {
		t, _ := k.MarshalText()
		out.Keys[i] = string(t)
	}
	if page.Next != nil {
		t, _ := page.Next.MarshalText()
		out.Next = string(t)
	}
	reply(w, 200, out)
}

// pins serves GET /v0/pins?older_than=D: the pin audit (S1.3).
func (n *Node) pins(w http.ResponseWriter, r *http.Request) {
	q, ok := params(w, r, "older_than")
	if !ok {
		return
	}
	var older time.Duration
	if v, ok := q["older_than"]; ok {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			fail(w, 400, "older_than: %q is not a duration ≥ 0 (30s, 5m)", v)
			return
		}
		older = d
	}
	audit := n.M.Audit(older)
	out := api.Pins{Pins: make([]api.Pin, len(audit))}
	for i, p := range audit {
		t, _ := p.Key.MarshalText()
		out.Pins[i] = api.Pin{Key: string(t), Slot: p.Slot, Owner: p.Owner.String(), AgeMS: ms(p.Age), Detached: p.Detached}
	}
	reply(w, 200, out)
}
