package offload

import "errors"

// Errors returned by the manager and the CPU tier. Callers test with
// errors.Is; messages add the key, request or job concerned.
var (
	ErrConfig         = errors.New("offload: bad config")
	ErrNotReady       = errors.New("offload: block not ready")
	ErrNotPinned      = errors.New("offload: no such pin")
	ErrUnknownRequest = errors.New("offload: unknown request")
	ErrRequestExists  = errors.New("offload: request already known")
	ErrUnknownJob     = errors.New("offload: unknown job")
	ErrWrongTier      = errors.New("offload: job result from the wrong tier")
	ErrNoStore        = errors.New("offload: no store in flight")
	ErrStepEnded      = errors.New("offload: step already ended")
	ErrClosed         = errors.New("offload: manager closed")
	// ErrTierPanic wraps a panic recovered from a call into a tier (S2.11).
	ErrTierPanic = errors.New("offload: tier panicked")
)
