package zmtp

import (
	"bytes"
	"errors"
	"log/slog"
	"net"
	"slices"
	"sync"
	"time"
)

// Publisher is a bound PUB socket: SUB peers connect, subscribe to topic
// prefixes, and get every message whose first frame matches one. Like
// libzmq's PUB it never blocks the publisher: each subscriber has a
// queue of at most HWM messages and MaxQueuedBytes, and what does not fit
// is dropped for that subscriber (the readers of a lossy stream
// resynchronise from its sequence numbers). At most MaxSubscribers
// connections are held (the port is unauthenticated); more are closed.
type Publisher struct {
	ln  net.Listener
	hwm int
	log *slog.Logger
	wg  sync.WaitGroup

	mu           sync.Mutex
	closed       bool
	done         chan struct{}            // closed by Close: ends the accept loop's backoff
	conns        map[net.Conn]struct{}    // every accepted connection, handshaking or not; shrinks as they end
	subs         map[*subscriber]struct{} // shrinks as subscribers go
	acceptErrors uint64
	lastLog      time.Time // the last accept failure logged
	suppressed   int       // failures not logged since
}

type subscriber struct {
	z       *Conn
	mu      sync.Mutex
	topics  [][]byte // prefixes; at most maxTopics, each once
	queue   [][][]byte
	queued  int // bytes in queue
	wake    chan struct{}
	dropped uint64
}

// Bounds of a Publisher, whatever its subscribers do.
const (
	MaxSubscribers = 256
	MaxQueuedBytes = 64 << 20
)

const (
	maxTopics       = 64
	handshakeTimout = 10 * time.Second
	// writeTimeout bounds one message's write to a subscriber that does
	// not read; it is then dropped.
	writeTimeout = 10 * time.Second
)

// Listen binds a PUB socket on addr (host:port). hwm bounds each
// subscriber's queue of messages not yet written.
func Listen(addr string, hwm int, log *slog.Logger) (*Publisher, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := newPublisher(ln, hwm, log)
	p.wg.Go(p.accept)
	return p, nil
}

func newPublisher(ln net.Listener, hwm int, log *slog.Logger) *Publisher {
	return &Publisher{ln: ln, hwm: max(hwm, 1), log: log, done: make(chan struct{}), conns: map[net.Conn]struct{}{}, subs: map[*subscriber]struct{}{}}
}

// Addr is the bound address.
func (p *Publisher) Addr() net.Addr { return p.ln.Addr() }

// accept accepts subscribers until the publisher closes. Errors do not
// stop it (S8.1): it retries with a backoff from 5 ms doubling to 1 s,
// counts them (AcceptErrors) and logs at most one a minute with the
// count of those not logged.
func (p *Publisher) accept() {
	var delay time.Duration
	for {
		c, err := p.ln.Accept()
		if err == nil {
			delay = 0
			p.wg.Go(func() { p.serve(c) })
			continue
		}
		select {
		case <-p.done:
			return
		default:
		}
		if errors.Is(err, net.ErrClosed) {
			p.log.Error("zmtp: the KV-events listener closed; no new subscribers are accepted", "err", err)
			return
		}
		delay = min(max(2*delay, 5*time.Millisecond), time.Second)
		p.acceptFailed(err, delay)
		select {
		case <-p.done:
			return
		case <-time.After(delay):
		}
	}
}

func (p *Publisher) acceptFailed(err error, delay time.Duration) {
	p.mu.Lock()
	p.acceptErrors++
	n, now := p.acceptErrors, time.Now()
	logIt := now.Sub(p.lastLog) >= time.Minute
	sup := p.suppressed
	if logIt {
		p.lastLog, p.suppressed = now, 0
	} else {
		p.suppressed++
	}
	p.mu.Unlock()
	if logIt {
		p.log.Warn("zmtp: accepting a KV-events subscriber failed; retrying", "err", err, "retry_in", delay, "errors_total", n, "suppressed", sup)
	}
}

// AcceptErrors counts the accept failures since Listen.
func (p *Publisher) AcceptErrors() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.acceptErrors
}

// serve runs one subscriber: the handshake, its subscriptions (read
// here), its queue (written by a second goroutine); both end when the
// connection does or the publisher closes.
func (p *Publisher) serve(c net.Conn) {
	p.mu.Lock()
	if p.closed || len(p.conns) >= MaxSubscribers {
		p.mu.Unlock()
		c.Close()
		return
	}
	p.conns[c] = struct{}{}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.conns, c)
		p.mu.Unlock()
		c.Close()
	}()
	c.SetDeadline(time.Now().Add(handshakeTimout))
	z, err := Handshake(c, Pub, nil, 64<<10)
	if err != nil {
		p.log.Debug("zmtp: a subscriber's handshake failed", "err", err)
		return
	}
	c.SetDeadline(time.Time{})
	s := &subscriber{z: z, wake: make(chan struct{}, 1)}
	p.mu.Lock()
	p.subs[s] = struct{}{}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.subs, s)
		p.mu.Unlock()
	}()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { s.write(done) })
	defer func() { close(done); wg.Wait() }()
	for {
		m, err := z.ReadMessage()
		if err != nil {
			return
		}
		if len(m) != 1 || len(m[0]) == 0 {
			continue // a SUB sends only subscriptions
		}
		topic := slices.Clone(m[0][1:])
		s.mu.Lock()
		switch {
		case m[0][0] == 1 && len(s.topics) < maxTopics &&
			!slices.ContainsFunc(s.topics, func(t []byte) bool { return bytes.Equal(t, topic) }):
			// one entry a topic, as libzmq's PUB keeps: a libzmq SUB that
			// subscribed twice cancels once (review)
			s.topics = append(s.topics, topic)
		case m[0][0] == 0:
			if i := slices.IndexFunc(s.topics, func(t []byte) bool { return bytes.Equal(t, topic) }); i >= 0 {
				s.topics = slices.Delete(s.topics, i, i+1)
			}
		}
		s.mu.Unlock()
	}
}

func (s *subscriber) write(done <-chan struct{}) {
	for {
		select {
		case <-done:
			return
		case <-s.wake:
		}
		for {
			s.mu.Lock()
			if len(s.queue) == 0 {
				s.mu.Unlock()
				break
			}
			m := s.queue[0]
			s.queue[0] = nil
			s.queue = s.queue[1:]
			s.queued -= size(m)
			s.mu.Unlock()
			s.z.NetConn().SetWriteDeadline(time.Now().Add(writeTimeout))
			if err := s.z.WriteMessage(m...); err != nil {
				s.z.Close() // ends the reader, and serve
				return
			}
		}
	}
}

// Publish queues a message for every subscriber whose subscriptions match
// its first frame; it never blocks on a subscriber.
func (p *Publisher) Publish(parts ...[]byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for s := range p.subs {
		s.mu.Lock()
		match := slices.ContainsFunc(s.topics, func(t []byte) bool { return bytes.HasPrefix(parts[0], t) })
		switch {
		case !match:
		case len(s.queue) >= p.hwm || s.queued+size(parts) > MaxQueuedBytes:
			s.dropped++
		default:
			s.queue = append(s.queue, parts)
			s.queued += size(parts)
			select {
			case s.wake <- struct{}{}:
			default:
			}
		}
		s.mu.Unlock()
	}
}

func size(parts [][]byte) int {
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	return n
}

// Subscribers counts the connected subscribers with at least one
// subscription, and the messages dropped for them (their queues full).
func (p *Publisher) Subscribers() (n int, dropped uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for s := range p.subs {
		s.mu.Lock()
		if len(s.topics) > 0 {
			n++
		}
		dropped += s.dropped
		s.mu.Unlock()
	}
	return n, dropped
}

// Close stops accepting, disconnects every subscriber and joins their
// goroutines.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if !p.closed {
		close(p.done)
	}
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}
