package p2p

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/crc32c"
	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// DataPlane moves block bytes between the CPU tiers of two nodes (S7).
// Its callbacks run on its own goroutines: they must only queue and wake.
type DataPlane interface {
	// Name is the data plane's name, compared in the handshake.
	Name() string
	// LocalInfo is what a peer needs to reach this node's slots.
	LocalInfo() []byte
	// AddPeer registers a peer that completed its handshake.
	AddPeer(peer, addr string, info []byte) error
	// RemovePeer drops a peer; done runs once no writer of that peer can
	// write into this node's slots any more.
	RemovePeer(peer string, done func())
	// Write sends the blocks of local slots into the peer's slots for a
	// round (producer); done runs once, after every block was sent or the
	// round failed or was cancelled.
	Write(peer string, round uint64, pairs []SlotPair, done func(error))
	// Cancel stops writing a round; its done runs with ErrCanceled (or nil
	// if every block was already sent).
	Cancel(peer string, round uint64)
	// Expect registers the slots a round will fill (consumer): only these
	// (round, slot) pairs from that peer are accepted. done runs once,
	// when every slot arrived and verified, or the round failed.
	Expect(peer string, round uint64, slots []uint32, done func(error))
	// Unexpect drops a round's expectation; done runs once no block of it
	// is being read into a slot.
	Unexpect(peer string, round uint64, done func())
	// Admit is asked, once a data connection that arrived on the P2P port
	// proved it comes from peer, whether the plane takes it: false at the
	// plane's cap (max_data_conns), and the dialler is refused. When true,
	// accept must be called once: with the connection when its handshake
	// succeeded, or with nil when it failed after all.
	Admit(peer string) (accept func(net.Conn), ok bool)
	Close() error
}

// SlotPair maps a local CPU slot to a peer's.
type SlotPair = protocol.SlotPair

// Data-plane errors.
var (
	ErrCanceled = errors.New("p2p: transfer cancelled")
	ErrCRC      = errors.New("p2p: block checksum mismatch")
	ErrNoPeer   = errors.New("p2p: unknown peer")
)

// dataStats are a data plane's counters, exported as metrics.
type dataStats struct {
	crcErrors, strays, bytesOut, bytesIn, capDrops atomic.Uint64
}

func (s *dataStats) counters() *dataStats { return s }

// TCPPlane is the default data plane (S7.1, S7.2): DataConns connections
// per peer, blocks written straight from slot memory and read straight
// into the destination slot, each block checked with CRC32C computed
// chunk by chunk on both sides.
type TCPPlane struct {
	arena *offload.Arena
	net   Network
	cfg   TCPPlaneConfig
	log   *slog.Logger
	dataStats

	mu       sync.Mutex
	closed   bool
	peers    map[string]*tcpPeer
	expect   map[roundKey]*expectation
	dead     map[roundKey]bool // cancelled rounds: stray blocks are drained
	deadFIFO []roundKey        // dead in insertion order: the oldest go beyond maxDead
	writes   map[roundKey][]*write
	wg       sync.WaitGroup
	bulk     *bulkGate     // the bulk tokens: one held by each block write in progress
	slice    time.Duration // bulkSlice when the plane was made

	bulkYields atomic.Uint64 // block writes that gave their token back to wait for the peer
}

// TCPPlaneConfig configures a TCP data plane.
type TCPPlaneConfig struct {
	// Conns is how many data connections a producer keeps per peer.
	Conns int
	// MaxIn caps a peer's inbound data connections (S8.1).
	MaxIn int
	// IdleTimeout closes an inbound connection that carried no block for
	// this long (zero: never).
	IdleTimeout time.Duration
	// Auth authenticates a data connection dialled to a peer before any
	// block is written on it (S7.1); nil sends nothing before the blocks.
	Auth func(c net.Conn, peer string) error
	// HandshakeTimeout bounds a data dial with its authentication
	// (default 10s).
	HandshakeTimeout time.Duration
	// Nice runs each data connection's reader and writer on an OS thread
	// of its own at this nice value (0: as the process).
	Nice int
	// Bulk bounds the blocks written at once, across every peer
	// (bulk_concurrency). 0: GOMAXPROCS, one fewer (at least 1) while
	// EngineBusy reports true.
	Bulk int
	// EngineBusy says whether the node's engine has requests in flight
	// (offload.TierEnv.EngineBusy); nil: never. Only the default Bulk
	// reads it.
	EngineBusy func() bool
}

// maxDead bounds the cancelled rounds whose stray blocks are drained
// quietly (S8.5); a block of a round forgotten beyond it closes its data
// connection as unexpected, and the producer dials again.
const maxDead = 4096

// markDeadLocked remembers a cancelled round, forgetting the oldest
// beyond maxDead.
func (p *TCPPlane) markDeadLocked(k roundKey) {
	if p.dead[k] {
		return
	}
	p.dead[k] = true
	p.deadFIFO = append(p.deadFIFO, k)
	for len(p.deadFIFO) > maxDead {
		delete(p.dead, p.deadFIFO[0])
		p.deadFIFO = p.deadFIFO[1:]
	}
}

type roundKey struct {
	peer  string
	round uint64
}

type tcpPeer struct {
	addr    string // under the plane's mu
	ctx     context.Context
	cancel  context.CancelFunc // ends the peer's dials (RemovePeer, Close)
	out     []*outConn         // under the plane's mu
	q       sendQueue
	in      map[net.Conn]bool
	admits  int // connections admitted whose handshake has not ended (under the plane's mu)
	readers sync.WaitGroup
	dialMu  sync.Mutex // one dialler at a time
	full    time.Time  // the peer refused a connection for its max_data_conns: no more dials until then (under dialMu)
}

// fullFor is how long a producer keeps the connections it has after the
// peer refused one more for its cap, before it tries again: the peer's
// max_data_conns is below this node's data_conns, or its old connections
// have not closed yet.
const fullFor = time.Minute

type expectation struct {
	left    map[uint32]bool
	done    func(error)
	reading int    // blocks being read into slots now
	ended   bool   // done was called or the round was dropped
	drained func() // Unexpect's callback, when reading drops to 0
}

// outConn is one producer data connection with its writer goroutine. Its
// state is guarded by its peer's queue lock.
type outConn struct {
	c    net.Conn
	q    *sendQueue
	dead error
	busy bool      // writing a block now
	used time.Time // the last block it took: an idle connection is replaced before the peer times it out
}

// sendQueue is the blocks a producer has to send a peer: every data
// connection's writer takes the next one as it frees up (S7.1), so a slow
// connection delays only the block it is writing.
type sendQueue struct {
	mu      sync.Mutex
	cond    *sync.Cond
	tasks   []*blockTask
	writers int // live writer goroutines; the last to go fails what is left
}

type blockTask struct {
	w     *write
	local uint32
	hdr   wire.DataHeader
}

// write tracks one Write call.
type write struct {
	key      roundKey
	left     atomic.Int64
	canceled atomic.Bool
	err      atomic.Pointer[error]
	done     func(error)
}

func (w *write) finish(err error) {
	if err != nil {
		w.err.CompareAndSwap(nil, &err)
	}
	if w.left.Add(-1) == 0 {
		if p := w.err.Load(); p != nil {
			w.done(*p)
			return
		}
		w.done(nil)
	}
}

// NewTCPPlane returns a TCP data plane over arena.
func NewTCPPlane(arena *offload.Arena, n Network, cfg TCPPlaneConfig, log *slog.Logger) *TCPPlane {
	cfg.Conns = max(cfg.Conns, 1)
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = 10 * time.Second
	}
	if cfg.MaxIn < cfg.Conns {
		cfg.MaxIn = 4 * cfg.Conns
	}
	bulk := newBulkGate(cfg.Bulk, nil)
	if cfg.Bulk <= 0 {
		bulk = newBulkGate(runtime.GOMAXPROCS(0), cfg.EngineBusy)
	}
	return &TCPPlane{arena: arena, net: n, cfg: cfg, log: log, bulk: bulk, slice: bulkSlice,
		peers: make(map[string]*tcpPeer), expect: make(map[roundKey]*expectation), dead: make(map[roundKey]bool),
		writes: make(map[roundKey][]*write)}
}

func (p *TCPPlane) Name() string      { return "tcp" }
func (p *TCPPlane) LocalInfo() []byte { return nil }

func (p *TCPPlane) AddPeer(peer, addr string, _ []byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return net.ErrClosed
	}
	if old := p.peers[peer]; old != nil {
		old.addr = addr
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	tp := &tcpPeer{addr: addr, ctx: ctx, cancel: cancel, in: make(map[net.Conn]bool)}
	tp.q.cond = sync.NewCond(&tp.q.mu)
	p.peers[peer] = tp
	return nil
}

func (p *TCPPlane) RemovePeer(peer string, done func()) {
	p.mu.Lock()
	tp := p.peers[peer]
	delete(p.peers, peer)
	var fail []*expectation
	for k, e := range p.expect {
		if k.peer == peer {
			delete(p.expect, k)
			p.markDeadLocked(k)
			if !e.ended {
				e.ended = true
				fail = append(fail, e)
			}
		}
	}
	p.mu.Unlock()
	for _, e := range fail {
		e.done(ErrNoPeer)
	}
	if tp == nil {
		done()
		return
	}
	// Close the peer's connections both ways; once its readers returned,
	// nothing it sends can reach a slot.
	tp.cancel()
	p.mu.Lock()
	for c := range tp.in {
		c.Close()
	}
	for _, o := range tp.out {
		o.kill(ErrNoPeer)
	}
	p.wg.Go(func() { // under mu, so never after Close's Wait began
		tp.readers.Wait()
		done()
	})
	p.mu.Unlock()
}

func (o *outConn) kill(err error) {
	o.q.mu.Lock()
	defer o.q.mu.Unlock()
	if o.dead == nil {
		o.dead = err
		o.c.Close()
	}
	o.q.cond.Broadcast()
}

// dial makes sure the producer has its Conns live connections to a
// peer: dead ones (and ones idle for half the peer's idle timeout, which
// the peer may be closing) are replaced. It returns the live ones.
func (p *TCPPlane) dial(peer string, tp *tcpPeer) ([]*outConn, error) {
	tp.dialMu.Lock()
	defer tp.dialMu.Unlock()
	p.mu.Lock()
	if p.closed || p.peers[peer] != tp {
		p.mu.Unlock()
		return nil, ErrNoPeer
	}
	now := time.Now()
	live := tp.out[:0]
	for _, o := range tp.out {
		tp.q.mu.Lock()
		stale := o.dead != nil || (p.cfg.IdleTimeout > 0 && !o.busy && len(tp.q.tasks) == 0 && now.Sub(o.used) > p.cfg.IdleTimeout/2)
		if stale && o.dead == nil { // killed in the same hold as the check: no block can slip onto it
			o.dead = ErrCanceled
			o.c.Close()
			tp.q.cond.Broadcast()
		}
		tp.q.mu.Unlock()
		if stale {
			continue
		}
		live = append(live, o)
	}
	clear(tp.out[len(live):])
	tp.out = live
	missing := p.cfg.Conns - len(tp.out)
	if len(tp.out) > 0 && now.Before(tp.full) {
		missing = 0
	}
	addr := tp.addr
	p.mu.Unlock()
	for range missing {
		// The dial and its authentication share one deadline; RemovePeer
		// and Close cancel it.
		deadline := time.Now().Add(p.cfg.HandshakeTimeout)
		ctx, cancel := context.WithDeadline(tp.ctx, deadline)
		c, err := p.net.Dial(ctx, addr)
		if err == nil && p.cfg.Auth != nil {
			stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
			c.SetDeadline(deadline)
			if err = p.cfg.Auth(c, peer); err != nil {
				c.Close()
			} else {
				c.SetDeadline(time.Time{})
			}
			stop()
		}
		cancel()
		if err != nil {
			if r := (*protocol.Reject)(nil); errors.As(err, &r) && r.ByPeer && r.Code == wire.CodeCapacity {
				tp.full = time.Now().Add(fullFor)
			}
			err = fmt.Errorf("p2p: data connection to %s: %w", addr, err)
			p.mu.Lock()
			out := slices.Clone(tp.out)
			p.mu.Unlock()
			if len(out) > 0 {
				p.log.Warn("p2p: fewer data connections than configured", "peer", peer, "err", err)
				return out, nil
			}
			return nil, err
		}
		o := &outConn{c: c, q: &tp.q, used: time.Now()}
		p.mu.Lock()
		if p.closed || p.peers[peer] != tp {
			p.mu.Unlock()
			c.Close()
			return nil, ErrNoPeer
		}
		tp.out = append(tp.out, o)
		tp.q.mu.Lock()
		tp.q.writers++
		tp.q.mu.Unlock()
		p.wg.Go(func() { lowered(p.cfg.Nice, func() { p.writer(o) }) })
		p.mu.Unlock()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(tp.out), nil
}

func (p *TCPPlane) Write(peer string, round uint64, pairs []SlotPair, done func(error)) {
	w := &write{key: roundKey{peer, round}}
	w.done = func(err error) {
		p.mu.Lock()
		ws := p.writes[w.key]
		for i, x := range ws {
			if x == w {
				ws = append(ws[:i], ws[i+1:]...)
				break
			}
		}
		if len(ws) == 0 {
			delete(p.writes, w.key)
		} else {
			p.writes[w.key] = ws
		}
		p.mu.Unlock()
		done(err)
	}
	w.left.Store(int64(len(pairs)) + 1) // +1 until every block is queued
	p.mu.Lock()
	tp := p.peers[peer]
	if tp == nil {
		p.mu.Unlock()
		w.left.Store(1)
		w.finish(ErrNoPeer)
		return
	}
	defer p.mu.Unlock()
	p.writes[w.key] = append(p.writes[w.key], w)
	// Dialling may block: do it off the caller's goroutine (started under
	// mu, so never after Close's Wait began).
	p.wg.Go(func() {
		if _, err := p.dial(peer, tp); err != nil {
			w.left.Store(1)
			w.finish(err)
			return
		}
		bs := uint32(p.arena.SlotBytes())
		q := &tp.q
		q.mu.Lock()
		if q.writers == 0 {
			q.mu.Unlock()
			w.left.Store(1)
			w.finish(ErrNoPeer)
			return
		}
		for _, pr := range pairs {
			q.tasks = append(q.tasks, &blockTask{w: w, local: pr.Local, hdr: wire.DataHeader{Round: round, Slot: pr.Remote, Len: bs}})
		}
		q.cond.Broadcast()
		q.mu.Unlock()
		w.finish(nil)
	})
}

func (p *TCPPlane) writer(o *outConn) {
	var hdr [wire.DataHeaderSize]byte
	q := o.q
	for {
		q.mu.Lock()
		for len(q.tasks) == 0 && o.dead == nil {
			q.cond.Wait()
		}
		if o.dead != nil {
			q.writers--
			var orphans []*blockTask
			if q.writers == 0 {
				orphans, q.tasks = q.tasks, nil
			}
			err := o.dead
			q.mu.Unlock()
			for _, t := range orphans {
				t.w.finish(err)
			}
			return
		}
		t := q.tasks[0]
		q.tasks[0] = nil
		q.tasks = q.tasks[1:]
		o.busy, o.used = true, time.Now()
		q.mu.Unlock()
		err := ErrCanceled
		if !t.w.canceled.Load() {
			// The block goes out with its CRC32C after it: the one recorded
			// when it entered the CPU tier, so the block is read once (S7.2).
			wire.PutDataHeader(hdr[:], t.hdr)
			// A consumer that stops reading inside a block is cut off, as it
			// cuts off a producer that stalls inside one. The deadline is
			// cleared after the block: one left armed on the idle connection
			// cost the idle producer 1.2 – 5.4 context switches a second in
			// kvbench's B3 (against 0 – 0.2 without).
			if p.cfg.IdleTimeout > 0 {
				o.c.SetWriteDeadline(time.Now().Add(p.cfg.IdleTimeout))
			}
			err = p.writeBlock(o.c, hdr[:], p.arena.Slot(int(t.local)), p.arena.SumOf(int(t.local)))
			if p.cfg.IdleTimeout > 0 && err == nil {
				o.c.SetWriteDeadline(time.Time{})
			}
			if err != nil {
				o.kill(err)
			} else {
				p.bytesOut.Add(uint64(t.hdr.Len))
			}
		}
		q.mu.Lock()
		o.busy, o.used = false, time.Now()
		q.mu.Unlock()
		if errors.Is(err, ErrCanceled) {
			t.w.finish(ErrCanceled)
			continue
		}
		t.w.finish(err)
	}
}

func (p *TCPPlane) Cancel(peer string, round uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, w := range p.writes[roundKey{peer, round}] {
		w.canceled.Store(true)
	}
}

func (p *TCPPlane) Expect(peer string, round uint64, slots []uint32, done func(error)) {
	e := &expectation{left: make(map[uint32]bool, len(slots)), done: done}
	for _, s := range slots {
		e.left[s] = true
	}
	p.mu.Lock()
	_, known := p.peers[peer]
	if known && len(slots) > 0 {
		p.expect[roundKey{peer, round}] = e
	}
	p.mu.Unlock()
	switch {
	case !known:
		done(ErrNoPeer)
	case len(slots) == 0:
		done(nil)
	}
}

func (p *TCPPlane) Unexpect(peer string, round uint64, done func()) {
	k := roundKey{peer, round}
	p.mu.Lock()
	e := p.expect[k]
	delete(p.expect, k)
	p.markDeadLocked(k)
	var fail bool
	if e != nil {
		fail = !e.ended
		e.ended = true
		if e.reading > 0 {
			e.drained = done
			done = nil
		}
	}
	p.mu.Unlock()
	if fail {
		e.done(ErrCanceled)
	}
	if done != nil {
		done()
	}
}

// Admit takes one more of a known peer's inbound data connections, up to
// MaxIn (those open and those admitted whose handshake has not ended);
// beyond, the dialler is refused and it is counted. accept serves the
// connection, reading its blocks straight into their slots.
func (p *TCPPlane) Admit(peer string) (accept func(net.Conn), ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	tp := p.peers[peer]
	if tp == nil || p.closed {
		return p.stray, true
	}
	if len(tp.in)+tp.admits >= p.cfg.MaxIn {
		p.capDrops.Add(1)
		return nil, false
	}
	tp.admits++
	return func(c net.Conn) {
		p.mu.Lock()
		tp.admits--
		if c == nil {
			p.mu.Unlock()
			return
		}
		if p.closed || p.peers[peer] != tp {
			p.mu.Unlock()
			p.stray(c)
			return
		}
		tp.in[c] = true
		tp.readers.Add(1)
		defer p.mu.Unlock() // the goroutine starts under mu, never after Close's Wait began
		p.wg.Go(func() {
			defer tp.readers.Done()
			var err error
			lowered(p.cfg.Nice, func() { err = p.read(peer, c) })
			p.mu.Lock()
			delete(tp.in, c)
			p.mu.Unlock()
			c.Close()
			if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				p.log.Warn("p2p: data connection dropped", "peer", peer, "err", err)
			}
		})
	}, true
}

// closeData is Admit's accept for a plane without TCP data connections.
func closeData(c net.Conn) {
	if c != nil {
		c.Close()
	}
}

// stray closes a data connection of a peer the plane does not know (it
// left while the connection was in its handshake), counted.
func (p *TCPPlane) stray(c net.Conn) {
	if c != nil {
		p.strays.Add(1)
		c.Close()
	}
}

// read reads blocks from a peer's data connection straight into their
// destination slots.
func (p *TCPPlane) read(peer string, c net.Conn) error {
	bs := p.arena.SlotBytes()
	for {
		if p.cfg.IdleTimeout > 0 {
			c.SetReadDeadline(time.Now().Add(p.cfg.IdleTimeout))
		}
		h, err := wire.ReadDataHeader(c)
		if err != nil {
			return err
		}
		if p.cfg.IdleTimeout > 0 { // a producer stalled inside a block is cut off too
			c.SetReadDeadline(time.Now().Add(p.cfg.IdleTimeout))
		}
		k := roundKey{peer, h.Round}
		p.mu.Lock()
		e := p.expect[k]
		ok := e != nil && !e.ended && e.left[h.Slot] && int(h.Len) == bs
		if ok {
			e.reading++
			delete(e.left, h.Slot)
		}
		stray := !ok && p.dead[k] && int(h.Len) == bs
		p.mu.Unlock()
		switch {
		case stray: // a block of a cancelled round: drain it, touch no slot
			if _, err := io.CopyN(io.Discard, c, int64(h.Len)+wire.DataTrailerSize); err != nil {
				return err
			}
			continue
		case !ok:
			p.strays.Add(1)
			return fmt.Errorf("p2p: unexpected block (round %d, slot %d, %d bytes) from %s", h.Round, h.Slot, h.Len, peer)
		}
		slot := p.arena.Slot(int(h.Slot))
		crc, err := readChecked(c, slot)
		var trailer [wire.DataTrailerSize]byte
		if err == nil {
			_, err = io.ReadFull(c, trailer[:])
		}
		var result error
		switch {
		case err != nil:
			result = err
		case crc != binary.BigEndian.Uint32(trailer[:]):
			p.crcErrors.Add(1)
			result = fmt.Errorf("%w: round %d slot %d from %s", ErrCRC, h.Round, h.Slot, peer)
		default:
			p.arena.SetSum(int(h.Slot), crc) // verified: kept with the slot (S7.2)
		}
		p.bytesIn.Add(uint64(bs))
		p.mu.Lock()
		e.reading--
		var done func(error)
		var drained func()
		switch {
		case e.ended:
		case result != nil:
			// Later blocks of the round are drained; Unexpect removes it
			// once no reader is inside a slot.
			e.ended = true
			done = e.done
			p.markDeadLocked(k)
		case len(e.left) == 0 && e.reading == 0:
			e.ended = true
			done = e.done
			delete(p.expect, k)
		}
		if e.reading == 0 && e.drained != nil {
			drained, e.drained = e.drained, nil
		}
		p.mu.Unlock()
		if done != nil {
			done(result)
		}
		if drained != nil {
			drained()
		}
		if err != nil {
			return err
		}
	}
}

// chunk is how much of a block is read before its checksum is updated:
// small enough that the bytes are still in cache.
const chunk = 128 << 10

// readChecked reads a whole block from r straight into slot and returns
// its CRC32C, computed chunk by chunk as the bytes arrive.
func readChecked(r io.Reader, slot []byte) (uint32, error) {
	var crc uint32
	for off := 0; off < len(slot); {
		end := min(off+chunk, len(slot))
		n, err := io.ReadFull(r, slot[off:end])
		crc = crc32c.Update(crc, slot[off:off+n])
		if err != nil {
			return crc, err
		}
		off = end
	}
	return crc, nil
}

// Close closes every connection and waits for the plane's goroutines.
func (p *TCPPlane) Close() error {
	p.mu.Lock()
	p.closed = true
	peers := p.peers
	p.peers = map[string]*tcpPeer{}
	var out []*outConn
	for _, tp := range peers {
		tp.cancel()
		for c := range tp.in {
			c.Close()
		}
		out = append(out, tp.out...) // under mu: dial compacts tp.out
	}
	p.mu.Unlock()
	for _, o := range out {
		o.kill(net.ErrClosed)
	}
	p.wg.Wait()
	return nil
}
