package offload

import (
	"context"
	"fmt"
	"slices"
	"sync"
)

// EventKind says what an Event reports (S2.8).
type EventKind uint8

// Event kinds.
const (
	// EventStored: Keys became readable in Tier.
	EventStored EventKind = iota
	// EventRemoved: Keys left Tier (evicted, found corrupt, …).
	EventRemoved
	// EventCleared: a cache reset removed every block of the CPU tier;
	// Epoch is the new cache epoch. Secondary tiers keep their blocks.
	EventCleared
	// EventLost: the subscriber fell behind and Lost events were dropped
	// for it; Seq is that of the last one dropped.
	EventLost
)

var eventKindNames = [...]string{"stored", "removed", "cleared", "lost"}

func (k EventKind) String() string {
	if int(k) < len(eventKindNames) {
		return eventKindNames[k]
	}
	return fmt.Sprintf("EventKind(%d)", k)
}

// MarshalText writes the kind's name ("stored", "removed", …).
func (k EventKind) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// UnmarshalText reads a kind's name.
func (k *EventKind) UnmarshalText(b []byte) error {
	i := slices.Index(eventKindNames[:], string(b))
	if i < 0 {
		return fmt.Errorf("offload: no event kind %q", b)
	}
	*k = EventKind(i)
	return nil
}

// Event is one entry of the manager's event stream (S2.8): keys a tier
// stored or removed, a cache reset, or a gap where a slow subscriber lost
// events. Events reach a subscriber in Seq order.
type Event struct {
	// Seq numbers the events the manager delivered, across tiers, one up
	// each; events emitted while nobody subscribed are neither numbered
	// nor kept. A subscriber sees consecutive numbers, an EventLost
	// standing for the ones it skipped.
	Seq  uint64    `json:"seq"`
	Kind EventKind `json:"kind"`
	// Tier names the tier ("cpu", or a secondary tier's name).
	Tier string `json:"tier,omitempty"`
	// Keys are the blocks stored or removed; shared by every subscriber,
	// so read-only.
	Keys []Key `json:"keys,omitempty"`
	// Parent and Tokens describe a store's blocks where the request gave
	// them (Request.Chain): Keys are consecutive blocks of one prompt,
	// Parent the key before the first, Tokens their token ids in order
	// (len(Keys) blocks of equal size). Tokens is a slice of the request's
	// prompt, shared: a subscriber that keeps events long copies it, or
	// it keeps the whole prompt alive.
	Parent *Key     `json:"parent,omitempty"`
	Tokens []uint32 `json:"token_ids,omitempty"`
	// Removed is Kind == EventRemoved.
	Removed bool `json:"-"`
	// Epoch is the new cache epoch of an EventCleared.
	Epoch uint64 `json:"epoch,omitempty"`
	// Lost counts the events an EventLost stands for.
	Lost uint64 `json:"lost,omitempty"`
}

// DefaultEventBuffer is the buffer of a Subscribe(0) subscription.
const DefaultEventBuffer = 4096

// Subscription receives the manager's events (S2.8) into a buffer of a
// fixed number of events. When the buffer is full, further events are
// dropped and counted, and the next batch ends with one EventLost that
// says how many; so a subscriber that falls behind costs the manager no
// more than its buffer. Its methods are safe for concurrent use.
type Subscription struct {
	m     *Manager
	limit int
	ready chan struct{} // one slot: something happened since the last receive

	mu struct {
		sync.Mutex
		buf     []Event // at most limit; emptied by Take
		lost    uint64  // dropped since the last Take
		lostSeq uint64  // Seq of the last one dropped
		closed  bool
	}
}

// eventHub fans the tiers' events out to the subscriptions; its lock is
// taken after the manager's and the tiers' own locks, never before.
type eventHub struct {
	sync.Mutex
	closed bool
	seq    uint64
	subs   []*Subscription // shrunk by Subscription.Close and Manager.Close
}

// Subscribe starts delivering events to a new subscription with a buffer
// of buffer events (DefaultEventBuffer when buffer ≤ 0). Events from
// before the call are not delivered. Close it when done; Manager.Close
// closes it too.
func (m *Manager) Subscribe(buffer int) *Subscription {
	if buffer <= 0 {
		buffer = DefaultEventBuffer
	}
	s := &Subscription{m: m, limit: buffer, ready: make(chan struct{}, 1)}
	s.mu.buf = make([]Event, 0, min(buffer, 64))
	h := &m.events
	h.Lock()
	defer h.Unlock()
	if h.closed {
		s.mu.closed = true
		return s
	}
	h.subs = append(h.subs, s)
	return s
}

// emit numbers e and delivers it to every subscription. It never blocks on
// a subscriber and may be called from any goroutine, with the manager's
// or a tier's lock held. With no subscription it keeps nothing.
func (m *Manager) emit(e Event) { m.publish(e, true) }

// emitShared is emit of an event whose Keys nobody changes afterwards
// (the CPU tier's: Commit's, the policy's victims, a fresh slice), so
// subscribers share them without a copy (issue 14: the store path's cost).
func (m *Manager) emitShared(e Event) { m.publish(e, false) }

func (m *Manager) publish(e Event, copyKeys bool) {
	h := &m.events
	h.Lock()
	defer h.Unlock()
	if len(h.subs) == 0 {
		return // S2.8: nobody listens, nothing is kept
	}
	h.seq++
	e.Seq = h.seq
	e.Removed = e.Kind == EventRemoved
	if copyKeys {
		e.Keys = slices.Clone(e.Keys) // the tier may reuse its slice
	}
	// Tokens are a slice of a Chain's, which never changes: shared as is.
	for _, s := range h.subs {
		s.push(e)
	}
}

// EventSeq is the number of the last event numbered (Config.EventSeqBase
// before the first).
func (m *Manager) EventSeq() uint64 { return m.eventSeq() }

func (m *Manager) eventSeq() uint64 {
	h := &m.events
	h.Lock()
	defer h.Unlock()
	return h.seq
}

// emitter returns the emit function of the tier named tier.
func (m *Manager) emitter(tier string) func(Event) {
	return func(e Event) {
		e.Tier = tier
		m.emit(e)
	}
}

// closeEvents closes every subscription (Manager.Close): each keeps what
// it buffered for Take and Next, then reports ErrClosed.
func (m *Manager) closeEvents() {
	h := &m.events
	h.Lock()
	subs := h.subs
	h.subs, h.closed = nil, true
	h.Unlock()
	for _, s := range subs {
		s.mu.Lock()
		s.mu.closed = true
		s.mu.Unlock()
		signal(s.ready)
	}
}

func (s *Subscription) push(e Event) {
	s.mu.Lock()
	if len(s.mu.buf) < s.limit {
		s.mu.buf = append(s.mu.buf, e)
	} else {
		s.mu.lost++
		s.mu.lostSeq = e.Seq
	}
	s.mu.Unlock()
	signal(s.ready)
}

// Take returns and forgets the buffered events, in Seq order, ending with
// an EventLost if any were dropped since the last call; nil when there is
// none. It never blocks.
func (s *Subscription) Take() []Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.takeLocked()
}

func (s *Subscription) takeLocked() []Event {
	ev := s.mu.buf
	if len(ev) == 0 {
		ev = nil
	} else {
		// The taken slice is the caller's; the next batch starts at the
		// size of this one instead of growing from nothing (issue 14:
		// the store path's cost with a follower).
		s.mu.buf = make([]Event, 0, min(max(len(ev), 64), s.limit))
	}
	if s.mu.lost > 0 {
		ev = append(ev, Event{Seq: s.mu.lostSeq, Kind: EventLost, Lost: s.mu.lost})
		s.mu.lost = 0
	}
	return ev
}

// Next waits until events are buffered and returns them as Take does. It
// waits at most until ctx ends (returning its cause) or the subscription
// or the manager is closed (returning ErrClosed once nothing is left).
func (s *Subscription) Next(ctx context.Context) ([]Event, error) {
	for {
		s.mu.Lock()
		ev, closed := s.takeLocked(), s.mu.closed
		s.mu.Unlock()
		switch {
		case len(ev) > 0:
			return ev, nil
		case closed:
			return nil, ErrClosed
		}
		select {
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-s.ready:
		}
	}
}

// Ready receives a value when events may be waiting or the subscription
// was closed, for callers that select on several things; Take then
// collects them. It has one slot: several events may signal once.
func (s *Subscription) Ready() <-chan struct{} { return s.ready }

// Close stops delivery and drops what is buffered; a Next waiting on it
// returns ErrClosed. Close is idempotent.
func (s *Subscription) Close() {
	h := &s.m.events
	h.Lock()
	h.subs = slices.DeleteFunc(h.subs, func(x *Subscription) bool { return x == s })
	h.Unlock()
	s.mu.Lock()
	s.mu.closed = true
	s.mu.buf, s.mu.lost = nil, 0
	s.mu.Unlock()
	signal(s.ready)
}
