package p2p

import (
	"runtime"

	"golang.org/x/sys/unix"
)

// lowered runs fn on an OS thread of its own at nice, so bulk block I/O
// yields the CPU to control frames, the engine and the admin API (issue
// 12: bulk must not starve control). The thread stays locked: when fn
// returns, the runtime ends it, and the nice value goes with it, never
// reaching another goroutine. The process's main thread cannot end, so
// fn never runs there: a caller on it holds it while fn runs on a new
// goroutine, which the runtime must then place on another thread. A nice
// of 0 or less runs fn as it is. Failures (a sandbox that forbids it) are
// ignored: the I/O works as before, at the normal priority. A niced thread
// still takes the plane's lock and the runtime's per block, so on a
// saturated machine a preempted one can delay others waiting on those
// (priority inversion); B2 showed no change either way (docs/benchmarks.md).
func lowered(nice int, fn func()) {
	if nice <= 0 {
		fn()
		return
	}
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		done := make(chan struct{})
		go func() {
			defer close(done)
			lowered(nice, fn)
		}()
		<-done
		runtime.UnlockOSThread()
		return
	}
	unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), nice)
	fn()
}
