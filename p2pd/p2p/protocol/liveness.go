package protocol

import (
	"time"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// Liveness is a session's keep-alive (S6.9, S6.8): pings only while work
// with the peer is outstanding, so an idle session costs nothing; a peer
// that answers no ping within keepalive_timeout is dead.
type Liveness struct {
	Interval, Timeout time.Duration // keepalive_interval, keepalive_timeout
	lastRecv          time.Time
	pingSent          time.Time
	seq               uint64
}

// Received is any frame from the peer at now.
func (l *Liveness) Received(now time.Time) { l.lastRecv = now }

// LastReceived is when the peer last sent a frame.
func (l *Liveness) LastReceived() time.Time { return l.lastRecv }

// Pong is a pong frame: the outstanding ping, if it is the one answered,
// is settled.
func (l *Liveness) Pong(m wire.Pong) {
	if m.Seq == l.seq {
		l.pingSent = time.Time{}
	}
}

// Check is the clock at now with work outstanding (busy) or not: it
// returns a ping to send, whether the peer is dead, and the next deadline
// (zero: none).
func (l *Liveness) Check(now time.Time, busy bool) (ping *wire.Ping, dead bool, next time.Time) {
	if !busy {
		l.pingSent = time.Time{}
		return nil, false, time.Time{}
	}
	if !l.pingSent.IsZero() {
		d := l.pingSent.Add(l.Timeout)
		if !now.Before(d) {
			return nil, true, time.Time{}
		}
		return nil, false, d
	}
	d := l.lastRecv.Add(l.Interval)
	if now.Before(d) {
		return nil, false, d
	}
	l.seq++
	l.pingSent = now
	return &wire.Ping{Seq: l.seq}, false, now.Add(l.Timeout)
}
