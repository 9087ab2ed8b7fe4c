package offload

import (
	"fmt"
	"time"
)

// The types every part of the manager and the tiers share: a lookup's
// answer, who holds a slot, a pin audit's line.

// Result is the answer to a lookup.
type Result uint8

const (
	// Miss: no tier has the block, or it cannot be brought in.
	Miss Result = iota
	// Hit: the block is ready in the CPU tier and may be loaded this step.
	Hit
	// HitPending: the block is being written into the CPU tier (a store or
	// a promotion); ask again after progress.
	HitPending
	// Retry: a secondary tier is still finding out; ask again after progress.
	Retry
)

var resultNames = [...]string{"miss", "hit", "hit_pending", "retry"}

func (r Result) String() string {
	if int(r) < len(resultNames) {
		return resultNames[r]
	}
	return fmt.Sprintf("Result(%d)", r)
}

// Owner names who holds a pin or a write on a CPU slot: a request (Req) or a
// transfer job (Job). Exactly one of the two is set.
type Owner struct {
	Req string
	Job uint64
}

// RequestOwner is the owner for request id.
func RequestOwner(id string) Owner { return Owner{Req: id} }

// JobOwner is the owner for job id.
func JobOwner(id uint64) Owner { return Owner{Job: id} }

func (o Owner) String() string {
	if o.Req != "" {
		return "request " + o.Req
	}
	return fmt.Sprintf("job %d", o.Job)
}

// PinInfo is one line of a pin audit (S1.3).
type PinInfo struct {
	Key   Key
	Slot  int
	Owner Owner
	Age   time.Duration
	// Detached: the block was removed by a cache reset; the pin only
	// keeps its slot from being reused.
	Detached bool
}
