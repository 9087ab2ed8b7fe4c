// Package nixlgo is a thin Go binding to NVIDIA NIXL (the Inference Xfer
// Library), covering what a KV-block mover needs: an agent, a UCX backend,
// memory registration, metadata exchange, prepared descriptor lists,
// transfer requests built from block indices, and notifications.
//
// The real binding is behind the build tag `nixl` and needs a NIXL install
// (see docs/nixl.md); without the tag every constructor returns
// ErrNotBuilt, so default and CGO_ENABLED=0 builds need nothing.
//
// An Agent serialises all its calls (NIXL's SYNC_NONE mode, no progress
// thread): the target of one-sided transfers must keep calling Notifs
// while it serves them, and the initiator must keep polling Status until
// a request completes (NIXL's progress rules).
package nixlgo

import (
	"errors"
	"fmt"
)

// ErrNotBuilt is returned by every constructor of a build without the
// `nixl` tag.
var ErrNotBuilt = errors.New("nixlgo: this binary was built without NIXL (rebuild with -tags nixl against a NIXL install)")

// Status is NIXL's nixl_status_t.
type Status int

// NIXL statuses.
const (
	StatusInProgress       Status = 1
	StatusSuccess          Status = 0
	StatusNotPosted        Status = -1
	StatusInvalidParam     Status = -2
	StatusBackend          Status = -3
	StatusNotFound         Status = -4
	StatusMismatch         Status = -5
	StatusNotAllowed       Status = -6
	StatusRepostActive     Status = -7
	StatusUnknown          Status = -8
	StatusNotSupported     Status = -9
	StatusRemoteDisconnect Status = -10
	StatusCanceled         Status = -11
)

// Sentinel errors, one per failure status: errors.Is(err,
// nixlgo.ErrRemoteDisconnect) tells a dead peer from a bad argument.
var (
	ErrNotPosted        = errors.New("nixlgo: not posted")
	ErrInvalidParam     = errors.New("nixlgo: invalid parameter")
	ErrBackend          = errors.New("nixlgo: backend error")
	ErrNotFound         = errors.New("nixlgo: not found")
	ErrMismatch         = errors.New("nixlgo: mismatch")
	ErrNotAllowed       = errors.New("nixlgo: not allowed")
	ErrRepostActive     = errors.New("nixlgo: request still active")
	ErrUnknown          = errors.New("nixlgo: unknown error")
	ErrNotSupported     = errors.New("nixlgo: not supported")
	ErrRemoteDisconnect = errors.New("nixlgo: remote disconnected")
	ErrCanceled         = errors.New("nixlgo: canceled")
)

var sentinels = map[Status]error{StatusNotPosted: ErrNotPosted, StatusInvalidParam: ErrInvalidParam,
	StatusBackend: ErrBackend, StatusNotFound: ErrNotFound, StatusMismatch: ErrMismatch,
	StatusNotAllowed: ErrNotAllowed, StatusRepostActive: ErrRepostActive, StatusUnknown: ErrUnknown,
	StatusNotSupported: ErrNotSupported, StatusRemoteDisconnect: ErrRemoteDisconnect, StatusCanceled: ErrCanceled}

// Error is a failed NIXL call.
type Error struct {
	Op     string
	Status Status
	Msg    string // an exception's message, when the shim caught one
}

func (e *Error) Error() string {
	s := fmt.Sprintf("nixlgo: %s: status %d", e.Op, int(e.Status))
	if u := sentinels[e.Status]; u != nil {
		s = fmt.Sprintf("nixlgo: %s: %v", e.Op, u)
	}
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	return s
}

// Unwrap returns the sentinel of the status.
func (e *Error) Unwrap() error { return sentinels[e.Status] }

// statusErr turns a status other than success into an *Error.
func statusErr(op string, s Status, msg string) error {
	if s == StatusSuccess || s == StatusInProgress {
		return nil
	}
	return &Error{Op: op, Status: s, Msg: msg}
}

// Op is a transfer's direction, from the initiator's point of view.
type Op int

// Transfer operations.
const (
	Read  Op = 0 // remote → local
	Write Op = 1 // local → remote
)

// AgentConfig configures an agent.
type AgentConfig struct {
	// ProgressThread runs NIXL's own progress thread (off: the caller
	// drives progress through Status and Notifs).
	ProgressThread bool
}
