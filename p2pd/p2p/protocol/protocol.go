// Package protocol holds the P2P protocol's state machines (docs/protocol.md),
// apart from its I/O: they are fed typed events — a peer's frame, a
// write's end, the clock — by the p2p tier's connection goroutines (under
// the manager lock), and emit typed actions that the tier carries out
// (frames to send, writes to start or cancel, results for the manager).
// They read no clock and touch no socket (testing/deps: this package
// imports no net), so a second wire dialect can drive the same machines
// and a test can script them.
//
// So far the producer side (Producer, issue 13's first machine); the
// session and consumer machines are still methods of p2p.Tier.
package protocol

import (
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// RoundID names a round: the peer's kv_request_id and round number.
type RoundID struct {
	KVID  string
	Round uint64
}

// SlotPair is one block of a write: a local CPU slot and the peer's.
type SlotPair struct{ Local, Remote uint32 }

// Action is what a machine asks its I/O layer to do.
type Action interface{ isAction() }

// SendFrame sends a frame to the peer, in order.
type SendFrame struct{ Msg wire.Msg }

// StartWrite writes a round's blocks into the peer's slots; when the write
// ended the I/O layer reports it with Producer.WriteDone.
type StartWrite struct {
	Round RoundID
	Pairs []SlotPair
}

// CancelWrite stops a round's write; its WriteDone follows.
type CancelWrite struct{ Round RoundID }

// LeaseDone hands the manager the result of a lease (pins held for the
// peer, offload.Parent.Lease).
type LeaseDone struct{ Result offload.JobResult }

// FinishRequest tells the manager an outside request (a served lookup's)
// ended: offload.Parent.OnRequestFinished, now or at the next Serve.
type FinishRequest struct{ Req *offload.Request }

func (SendFrame) isAction()     {}
func (StartWrite) isAction()    {}
func (CancelWrite) isAction()   {}
func (LeaseDone) isAction()     {}
func (FinishRequest) isAction() {}

// outbox collects a machine's actions; Take hands them over.
type outbox struct{ out, spare []Action }

func (o *outbox) emit(a Action) { o.out = append(o.out, a) }

// Take returns the actions emitted since the last Take, in order. The
// slice is valid until the next Take.
func (o *outbox) Take() []Action {
	a := o.out
	clear(o.spare)
	o.out, o.spare = o.spare[:0], a
	return a
}
