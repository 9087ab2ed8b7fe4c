package p2p

import (
	"runtime"

	"golang.org/x/sys/unix"
)

// lowerPriority runs the calling goroutine on an OS thread of its own at
// nice, so bulk block I/O yields the CPU to control frames, the engine
// and the admin API (issue 12: bulk must not starve control). The thread
// stays locked: when the goroutine returns, the runtime ends it, and the
// nice value goes with it, never reaching another goroutine. A nice of 0
// or less changes nothing. Failures (a sandbox that forbids it) are
// ignored: the I/O works as before, at the normal priority. A niced
// thread still takes the plane's lock and the runtime's per block, so on a
// saturated machine a preempted one can delay others waiting on those
// (priority inversion); B2 showed no change either way (docs/benchmarks.md).
func lowerPriority(nice int) {
	if nice <= 0 {
		return
	}
	runtime.LockOSThread()
	unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), nice)
}
