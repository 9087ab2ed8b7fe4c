package p2p

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/kvtier/kvtier/nixlgo"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/crc32c"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// NIXLPlane is the data plane over NVIDIA NIXL (S7.3): the whole CPU arena
// is registered with a NIXL agent once, its metadata travels in the
// handshake, and the producer WRITEs a round's blocks one-sidedly from its
// slots into the consumer's slots. The round's notification, which NIXL
// delivers after the data, names the slots and carries each block's
// CRC32C: the consumer accepts a round only when the notification matches
// what it expects and every checksum holds (S7.2).
//
// One goroutine owns every NIXL request and descriptor list: it submits
// writes, polls them (the initiator's progress rule), drains notifications
// (the target's progress rule) and runs removals. It polls only while a
// write or an expectation is outstanding and parks otherwise, so an idle
// node does not spin (B3).
//
// NIXL writes are one-sided, so RemovePeer cannot close a pipe the way the
// TCP plane does: it drops the peer's requests and metadata (which
// disconnects this node's endpoint to it) and from then on ignores its
// notifications. A peer that is alive and ignores an abort can still land
// bytes in slots; docs/nixl.md says when that matters.
type NIXLPlane struct {
	arena *offload.Arena
	agent *nixlgo.Agent
	local *nixlgo.Dlist
	log   *slog.Logger
	poll  time.Duration
	dataStats

	mu      sync.Mutex
	wake    *sync.Cond
	closed  bool
	peers   map[string]*nixlPeer // by node id
	byAgent map[string]string    // NIXL agent name → node id
	ops     []func()             // run by the loop goroutine
	writes  map[roundKey]*nixlWrite
	expect  map[roundKey]*nixlExpect
	leaving []*nixlLeaving // removed peers, owned by the loop
	drain   time.Duration
	vllm    bool   // NIXLConfig.VLLM
	name    string // this node's agent name
	done    chan struct{}
}

type nixlPeer struct {
	agent  string
	remote *nixlgo.Dlist
	slots  int
}

type nixlWrite struct {
	req      *nixlgo.Req
	done     func(error)
	canceled bool
	bytes    int
}

type nixlExpect struct {
	slots    []uint32 // sorted
	done     func(error)
	checking bool   // its notification is being verified (under mu)
	drained  func() // Unexpect's done, owed once that verification ends (under mu)
}

// nixlInfoLen is the fixed part of LocalInfo: arena base, stride, slot
// bytes and slot count, then the agent's metadata.
const nixlInfoLen = 8 + 8 + 8 + 4

// notifMagic starts a round's notification: magic, round, block count,
// then (remote slot, CRC32C) per block.
const notifMagic = "KVN1"

// NIXLConfig configures the NIXL data plane.
type NIXLConfig struct {
	// UCX holds the UCX backend's parameters (NIXL's names); empty uses
	// NIXL's defaults. Transports and devices come from UCX_TLS and
	// UCX_NET_DEVICES in the environment.
	UCX map[string]string
	// PollInterval is how long the plane's goroutine sleeps between
	// progress passes that found nothing new while transfers are
	// outstanding (default 20 µs).
	PollInterval time.Duration
	// Drain bounds how long a removed peer's transfers in flight may end
	// before they are cancelled and its endpoint closed (default 2 s).
	Drain time.Duration
	// VLLM writes as vLLM's NIXL transport does (p2p_dialect vllm): no
	// notification and no checksum; the consumer learns of the end from
	// transfer_done.
	VLLM bool
}

// ucxDefaults are UCX settings the plane makes unless the environment
// sets them. UCX's TCP transport emulates puts in segments of 8 KiB by
// default; 64 KiB segments moved 1 GiB fetches between two daemons 1.5–3×
// faster (docs/nixl.md).
var ucxDefaults = map[string]string{"UCX_TCP_TX_SEG_SIZE": "64k", "UCX_TCP_RX_SEG_SIZE": "64k"}

// NewNIXLPlane creates a NIXL agent named after self's node id and
// incarnation, with a UCX backend, and registers the arena. A binary built
// without the nixl tag returns nixlgo.ErrNotBuilt.
func NewNIXLPlane(arena *offload.Arena, self wire.Hello, cfg NIXLConfig, log *slog.Logger) (*NIXLPlane, error) {
	if err := nixlSlots(arena.Slots()); err != nil { // also checked by the tier, before it listens
		return nil, err
	}
	for k, v := range ucxDefaults {
		if _, set := os.LookupEnv(k); !set {
			os.Setenv(k, v)
		}
	}
	name := self.NodeID + "-" + hex.EncodeToString(self.Incarnation[:4])
	agent, err := nixlgo.NewAgent(name, nixlgo.AgentConfig{})
	if err != nil {
		return nil, fmt.Errorf("p2p: nixl data plane: %w", err)
	}
	p := &NIXLPlane{arena: arena, agent: agent, log: log, poll: cfg.PollInterval, drain: cfg.Drain, vllm: cfg.VLLM, name: name,
		peers: map[string]*nixlPeer{}, byAgent: map[string]string{},
		writes: map[roundKey]*nixlWrite{}, expect: map[roundKey]*nixlExpect{}, done: make(chan struct{})}
	if p.poll <= 0 {
		p.poll = 20 * time.Microsecond
	}
	if p.drain <= 0 {
		p.drain = 2 * time.Second
	}
	p.wake = sync.NewCond(&p.mu)
	err = agent.CreateUCX(cfg.UCX)
	if err == nil {
		err = agent.Register(arena.Base(), arena.Len())
	}
	if err == nil {
		p.local, err = agent.Prep("", arena.Base(), arena.Stride(), arena.SlotBytes(), arena.Slots())
		if err != nil {
			agent.Deregister(arena.Base(), arena.Len())
		}
	}
	if err != nil {
		agent.Close()
		return nil, fmt.Errorf("p2p: nixl data plane: %w", err)
	}
	go p.loop()
	return p, nil
}

func (p *NIXLPlane) Name() string { return "nixl" }

// LocalInfo is the arena's layout and the agent's metadata (its name, UCX
// address and the arena's registration).
func (p *NIXLPlane) LocalInfo() []byte {
	md, err := p.agent.LocalMetadata()
	if err != nil {
		p.log.Error("p2p: nixl metadata", "err", err)
		return nil
	}
	b := binary.LittleEndian.AppendUint64(nil, uint64(p.arena.Base()))
	b = binary.LittleEndian.AppendUint64(b, uint64(p.arena.Stride()))
	b = binary.LittleEndian.AppendUint64(b, uint64(p.arena.SlotBytes()))
	b = binary.LittleEndian.AppendUint32(b, uint32(p.arena.Slots()))
	return append(b, md...)
}

// VLLMRegion is what a vLLM connect carries (vllmRegion): the agent's
// metadata and the arena's base; vLLM addresses slot i at base + i ×
// block_len, so the tier refuses vLLM's wire unless the stride is the
// slot size.
func (p *NIXLPlane) VLLMRegion() ([]byte, uintptr) {
	md, err := p.agent.LocalMetadata()
	if err != nil {
		p.log.Error("p2p: nixl metadata", "err", err)
	}
	return md, p.arena.Base()
}

// nixlSlots refuses a CPU tier of more slots than NIXL peers and vLLM
// peers accept of a peer (AddPeer, vconnect: a descriptor each is
// prepared under the manager lock), at start rather than at every peer's
// handshake.
func nixlSlots(n int) error {
	if n > vllmMaxBlocks {
		return fmt.Errorf("%w: the NIXL data plane takes at most %d CPU slots (a peer prepares a descriptor for each); cpu_bytes gives %d",
			offload.ErrConfig, vllmMaxBlocks, n)
	}
	return nil
}

// AddPeer loads the peer's metadata and prepares its slots as write
// targets.
func (p *NIXLPlane) AddPeer(peer, _ string, info []byte) error {
	if len(info) <= nixlInfoLen {
		return errors.New("p2p: nixl: the peer sent no NIXL metadata")
	}
	base := uintptr(binary.LittleEndian.Uint64(info))
	stride := int(binary.LittleEndian.Uint64(info[8:]))
	size := int(binary.LittleEndian.Uint64(info[16:]))
	slots := int(binary.LittleEndian.Uint32(info[24:]))
	if size != p.arena.SlotBytes() || stride < size {
		return fmt.Errorf("p2p: nixl: the peer's slots hold %d bytes %d apart, ours %d", size, stride, p.arena.SlotBytes())
	}
	if slots < 1 || slots > vllmMaxBlocks { // a descriptor each is prepared, under the manager lock (S8.1)
		return fmt.Errorf("p2p: nixl: the peer claims %d slots, at most %d", slots, vllmMaxBlocks)
	}
	errc := make(chan error, 1)
	if !p.run(func() { errc <- p.addPeer(peer, info[nixlInfoLen:], base, stride, size, slots) }) {
		return net.ErrClosed
	}
	return <-errc
}

func (p *NIXLPlane) addPeer(peer string, md []byte, base uintptr, stride, size, slots int) error {
	// NIXL trusts parts of the blob: it is read here first (nixlmeta.go),
	// and a name that is this agent's or another peer's is refused before
	// NIXL could merge it into, or on failure erase, that agent's state.
	meta, err := checkNIXLMeta(md)
	if err != nil {
		return err
	}
	p.mu.Lock()
	owner, taken := p.byAgent[meta.Agent]
	if !taken { // a removed peer's agent is its own until its drain ends
		for _, l := range p.leaving {
			if l.np.agent == meta.Agent {
				owner, taken = l.peer, true
			}
		}
	}
	p.mu.Unlock()
	switch {
	case meta.Agent == p.name:
		return fmt.Errorf("p2p: nixl: the peer's metadata names this node's agent %q", meta.Agent)
	case taken && owner != peer:
		return fmt.Errorf("p2p: nixl: the peer's metadata names agent %q, which is peer %s's", meta.Agent, owner)
	}
	// Agent names carry the node's incarnation: a restarted peer is a
	// new name, and the same name is the same process.
	agent, err := p.agent.LoadRemote(md)
	if err != nil {
		return fmt.Errorf("p2p: nixl: loading the peer's metadata: %w", err)
	}
	if old := p.peers[peer]; old != nil {
		if old.agent == agent {
			return nil
		}
		p.dropPeer(peer, old, nil) // a restarted peer
	}
	remote, err := p.agent.Prep(agent, base, stride, size, slots)
	if err != nil {
		p.agent.InvalidateRemote(agent)
		return fmt.Errorf("p2p: nixl: preparing the peer's slots: %w", err)
	}
	p.mu.Lock()
	p.peers[peer] = &nixlPeer{agent: agent, remote: remote, slots: slots}
	p.byAgent[agent] = peer
	p.mu.Unlock()
	return nil
}

// RemovePeer fails the peer's rounds both ways at once; done runs once the
// peer is forgotten (see dropPeer).
func (p *NIXLPlane) RemovePeer(peer string, done func()) {
	if !p.run(func() {
		if np := p.peers[peer]; np != nil {
			p.dropPeer(peer, np, done)
			return
		}
		done()
	}) {
		done()
	}
}

// dropPeer runs on the loop goroutine. The peer's expectations and writes
// fail now; its metadata is invalidated (which closes this node's UCX
// endpoint to it) only once transfers in flight between the two had a
// chance to end: writes to it until they complete, and, when this node
// expected rounds from it, for the drain time, while the loop keeps
// driving progress. UCX 1.13's software RMA (the TCP transport) aborts the
// process when a put's fragments arrive on an endpoint already closed.
func (p *NIXLPlane) dropPeer(peer string, np *nixlPeer, done func()) {
	p.mu.Lock()
	delete(p.peers, peer)
	delete(p.byAgent, np.agent)
	var fail []func(error)
	for k, e := range p.expect {
		if k.peer == peer {
			delete(p.expect, k)
			fail = append(fail, e.done)
		}
	}
	l := &nixlLeaving{peer: peer, np: np, until: time.Now().Add(p.drain), expected: len(fail) > 0, done: done}
	for k, w := range p.writes {
		if k.peer == peer {
			delete(p.writes, k)
			l.writes = append(l.writes, w)
		}
	}
	p.leaving = append(p.leaving, l)
	p.mu.Unlock()
	for _, w := range l.writes {
		w.done(ErrNoPeer)
	}
	for _, f := range fail {
		f(ErrNoPeer)
	}
}

// nixlLeaving is a removed peer whose transfers may still be in flight.
type nixlLeaving struct {
	peer     string
	np       *nixlPeer
	writes   []*nixlWrite // already reported; their requests not yet released
	until    time.Time    // the drain's end
	expected bool         // rounds from the peer were expected: wait until then
	done     func()
}

// leave forgets a removed peer once its writes completed and, if rounds
// from it were expected, the drain time passed; at the drain's end, or
// when force, it cancels what is left. False while it must wait.
func (p *NIXLPlane) leave(l *nixlLeaving, force bool) bool {
	l.writes = slices.DeleteFunc(l.writes, func(w *nixlWrite) bool {
		complete, err := w.req.Status()
		if complete || err != nil {
			w.req.Release()
			return true
		}
		return false
	})
	if !force && time.Now().Before(l.until) && (len(l.writes) > 0 || l.expected) {
		return false
	}
	for _, w := range l.writes {
		w.req.Release() // cancels it
	}
	l.np.remote.Release()
	p.mu.Lock()
	_, back := p.byAgent[l.np.agent]
	p.mu.Unlock()
	if !back { // not added again meanwhile under the same name
		p.agent.InvalidateRemote(l.np.agent)
	}
	if l.done != nil {
		l.done()
	}
	return true
}

// Write WRITEs the local slots into the peer's slots, with the round's
// notification carrying each slot's kept CRC32C (S7.2).
func (p *NIXLPlane) Write(peer string, round uint64, pairs []SlotPair, done func(error)) {
	if !p.run(func() { p.write(peer, round, pairs, done) }) {
		done(net.ErrClosed)
	}
}

func (p *NIXLPlane) write(peer string, round uint64, pairs []SlotPair, done func(error)) {
	np := p.peers[peer]
	if np == nil {
		done(ErrNoPeer)
		return
	}
	if len(pairs) == 0 {
		done(nil)
		return
	}
	p.mu.Lock()
	_, busy := p.writes[roundKey{peer, round}]
	p.mu.Unlock()
	if busy { // a confused consumer's two fetches of one round: one write a round
		done(fmt.Errorf("p2p: nixl: round %d to %s is being written already", round, peer))
		return
	}
	lidx, ridx := make([]int32, len(pairs)), make([]int32, len(pairs))
	var notif []byte // vLLM's wire: none
	if !p.vllm {
		notif = make([]byte, 0, len(notifMagic)+12+8*len(pairs))
		notif = append(notif, notifMagic...)
		notif = binary.LittleEndian.AppendUint64(notif, round)
		notif = binary.LittleEndian.AppendUint32(notif, uint32(len(pairs)))
	}
	for i, sp := range pairs {
		if int(sp.Local) >= p.arena.Slots() || int(sp.Remote) >= np.slots {
			done(fmt.Errorf("p2p: nixl: slot pair %d→%d out of range", sp.Local, sp.Remote))
			return
		}
		lidx[i], ridx[i] = int32(sp.Local), int32(sp.Remote)
		if !p.vllm {
			notif = binary.LittleEndian.AppendUint32(notif, sp.Remote)
			notif = binary.LittleEndian.AppendUint32(notif, p.arena.SumOf(int(sp.Local)))
		}
	}
	req, err := p.agent.MakeXfer(nixlgo.Write, p.local, lidx, np.remote, ridx, notif)
	if err != nil {
		done(err)
		return
	}
	w := &nixlWrite{req: req, done: done, bytes: len(pairs) * p.arena.SlotBytes()}
	complete, err := req.Post()
	if complete || err != nil {
		p.finishWrite(w, err)
		return
	}
	p.mu.Lock()
	p.writes[roundKey{peer, round}] = w
	p.mu.Unlock()
}

// finishWrite releases a write's request and reports it.
func (p *NIXLPlane) finishWrite(w *nixlWrite, err error) {
	w.req.Release()
	switch {
	case err != nil:
	case w.canceled:
		err = ErrCanceled
	default:
		p.bytesOut.Add(uint64(w.bytes))
	}
	w.done(err)
}

// Cancel releases the round's request if it is still in flight, which
// cancels it (no notification is sent).
func (p *NIXLPlane) Cancel(peer string, round uint64) {
	k := roundKey{peer, round}
	p.run(func() {
		p.mu.Lock()
		w := p.writes[k]
		delete(p.writes, k)
		p.mu.Unlock()
		if w != nil {
			w.canceled = true
			p.finishWrite(w, nil)
		}
	})
}

// Expect waits for the round's notification from the peer. On vLLM's wire
// none comes: the expectation keeps the loop driving progress (UCX's TCP
// transport completes a put only while its target progresses) until the
// round ends and Unexpect drops it.
func (p *NIXLPlane) Expect(peer string, round uint64, slots []uint32, done func(error)) {
	if len(slots) == 0 {
		done(nil)
		return
	}
	e := &nixlExpect{slots: slices.Sorted(slices.Values(slots)), done: done}
	p.mu.Lock()
	_, known := p.peers[peer]
	known = known && !p.closed
	if known {
		p.expect[roundKey{peer, round}] = e
		p.wake.Signal()
	}
	p.mu.Unlock()
	if !known {
		done(ErrNoPeer)
	}
}

// Unexpect drops the round's expectation. The protocol calls it once the
// producer stopped (abort_ack) or finished (transfer_done), and a late
// notification of the round is ignored, so done runs at once — unless
// the round's notification is being verified: the check reads the
// slots, so done waits for it (the protocol frees them on done).
func (p *NIXLPlane) Unexpect(peer string, round uint64, done func()) {
	k := roundKey{peer, round}
	p.mu.Lock()
	e := p.expect[k]
	delete(p.expect, k)
	if e != nil && e.checking {
		e.drained, done = done, nil
	}
	p.mu.Unlock()
	if e != nil {
		e.done(ErrCanceled)
	}
	if done != nil {
		done()
	}
}

// Admit closes TCP data connections: this plane has none.
func (p *NIXLPlane) Admit(string) (func(net.Conn), bool) { return closeData, true }

// Close removes every peer (letting transfers in flight end, as
// RemovePeer does), then deregisters the arena and destroys the agent.
func (p *NIXLPlane) Close() error {
	if !p.run(func() {
		for peer, np := range p.peers {
			p.dropPeer(peer, np, nil)
		}
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
	}) {
		<-p.done
		return nil
	}
	<-p.done
	return errors.Join(p.local.Release(), p.agent.Deregister(p.arena.Base(), p.arena.Len()), p.agent.Close())
}

// run queues fn for the loop goroutine; false once the plane is closed.
func (p *NIXLPlane) run(fn func()) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.ops = append(p.ops, fn)
	p.wake.Signal()
	return true
}

// loop runs the queued operations and, while transfers are outstanding or
// removed peers drain, drives NIXL's progress; it ends after Close once
// every removed peer is gone.
func (p *NIXLPlane) loop() {
	defer close(p.done)
	for {
		p.mu.Lock()
		for len(p.ops) == 0 && len(p.writes) == 0 && len(p.expect) == 0 && len(p.leaving) == 0 && !p.closed {
			p.wake.Wait()
		}
		ops := p.ops
		p.ops = nil
		p.mu.Unlock()
		for _, op := range ops {
			op()
		}
		// After the operations (Cancel and RemovePeer take requests away),
		// the writes still in flight and the removed peers.
		p.mu.Lock()
		writes := make(map[roundKey]*nixlWrite, len(p.writes))
		for k, w := range p.writes {
			writes[k] = w
		}
		leaving, closed := p.leaving, p.closed
		p.mu.Unlock()
		progressed := len(ops) > 0
		for k, w := range writes {
			complete, err := w.req.Status()
			if !complete && err == nil {
				continue
			}
			progressed = true
			p.mu.Lock()
			delete(p.writes, k)
			p.mu.Unlock()
			p.finishWrite(w, err)
		}
		leaving = slices.DeleteFunc(leaving, func(l *nixlLeaving) bool { return p.leave(l, false) })
		p.mu.Lock()
		p.leaving = leaving
		p.mu.Unlock()
		notifs, err := p.agent.Notifs()
		if err != nil {
			p.log.Error("p2p: nixl notifications", "err", err)
		}
		for _, n := range notifs {
			p.notified(n)
			progressed = true
		}
		if closed && len(leaving) == 0 {
			return
		}
		if !progressed {
			time.Sleep(p.poll)
		}
	}
}

// testHookNIXLChecking, when set, runs as a round's notification starts
// being verified (a test's way into that window).
var testHookNIXLChecking func(round uint64)

// notified checks a round's notification against its expectation and the
// slots' bytes.
func (p *NIXLPlane) notified(n nixlgo.Notif) {
	m := n.Msg
	p.mu.Lock()
	peer, known := p.byAgent[n.From]
	var e *nixlExpect
	var k roundKey
	if known && len(m) >= len(notifMagic)+12 && string(m[:len(notifMagic)]) == notifMagic {
		k = roundKey{peer, binary.LittleEndian.Uint64(m[len(notifMagic):])}
		if e = p.expect[k]; e != nil && e.checking {
			e = nil // a second notification for the round
		} else if e != nil {
			e.checking = true // stays expected, so Unexpect can still take it
		}
	}
	p.mu.Unlock()
	if e == nil {
		p.strays.Add(1)
		p.log.Debug("p2p: nixl notification nobody expects", "from", n.From, "bytes", len(m))
		return
	}
	// finish ends the round unless Unexpect took it meanwhile (then it
	// runs the done Unexpect left: the slots are read no more); the slots'
	// checksums are kept only for a round still expected.
	finish := func(err error, got, sums []uint32) {
		p.mu.Lock()
		mine := p.expect[k] == e
		if mine {
			delete(p.expect, k)
			for i, slot := range got {
				p.arena.SetSum(int(slot), sums[i]) // verified: kept with the slot (S7.2)
			}
		}
		e.checking = false
		drained := e.drained
		p.mu.Unlock()
		if mine {
			e.done(err)
		}
		if drained != nil {
			drained()
		}
	}
	if testHookNIXLChecking != nil {
		testHookNIXLChecking(k.round)
	}
	m = m[len(notifMagic)+8:]
	count := int(binary.LittleEndian.Uint32(m))
	m = m[4:]
	if count != len(e.slots) || len(m) != 8*count {
		finish(fmt.Errorf("p2p: nixl: round %d's notification names %d blocks, %d expected", k.round, count, len(e.slots)), nil, nil)
		return
	}
	got := make([]uint32, count)
	for i := range got {
		got[i] = binary.LittleEndian.Uint32(m[8*i:])
	}
	if !slices.Equal(slices.Sorted(slices.Values(got)), e.slots) {
		finish(fmt.Errorf("p2p: nixl: round %d's notification names other slots than expected", k.round), nil, nil)
		return
	}
	sums := make([]uint32, count)
	for i, slot := range got {
		sums[i] = crc32c.Checksum(p.arena.Slot(int(slot)))
		if sums[i] != binary.LittleEndian.Uint32(m[8*i+4:]) {
			p.crcErrors.Add(1)
			finish(fmt.Errorf("%w: round %d, slot %d", ErrCRC, k.round, slot), nil, nil)
			return
		}
	}
	p.bytesIn.Add(uint64(count * p.arena.SlotBytes()))
	finish(nil, got, sums)
}
