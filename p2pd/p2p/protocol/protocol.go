// Package protocol holds the P2P protocol's state machines (docs/protocol.md),
// apart from its I/O: they are fed typed events — a peer's frame, a
// write's end, the clock — by the p2p tier's connection goroutines (under
// the manager lock), and emit typed actions that the tier carries out
// (frames to send, writes to start or cancel, results for the manager).
// They read no clock and touch no socket (testing/deps: this package
// imports no net), so a second wire dialect can drive the same machines
// and a test can script them.
//
// The machines: each connection's handshake (Handshake, from a node's
// Shaker), a session's keep-alive (Liveness), and its producer (Producer)
// and consumer (Consumer) sides. What is left to the I/O layer in p2p is
// connections: framing, which of two duplicate connections to one peer
// survives (the tie-break on Shaken.DialNonce), their retirement, and the
// data planes.
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

// JobDone hands the manager a job's result: a lease the producer held
// for the peer (offload.Parent.Lease), or a consumer's load.
type JobDone struct{ Result offload.JobResult }

// FinishRequest tells the manager an outside request (a served lookup's)
// ended: offload.Parent.OnRequestFinished, now or at the next Serve.
type FinishRequest struct{ Req *offload.Request }

func (SendFrame) isAction()     {}
func (StartWrite) isAction()    {}
func (CancelWrite) isAction()   {}
func (JobDone) isAction()       {}
func (FinishRequest) isAction() {}

// outbox collects a machine's actions; Take hands them over.
type outbox struct{ out []Action }

func (o *outbox) emit(a Action) { o.out = append(o.out, a) }

// Take returns the actions emitted since the last Take, in order; the
// slice is the caller's (a handler may feed the machine again while it
// carries them out).
func (o *outbox) Take() []Action {
	a := o.out
	o.out = nil
	return a
}
