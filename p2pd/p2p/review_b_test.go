package p2p

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// A control connection's reader must not run ahead of the manager without
// bound (S8.5, S8.1): frames it read and posted but the manager has not
// applied yet are held in memory, so a peer that sends faster than the
// manager serves (a flood of 65,536-key lookups while one is being served)
// grew the event queue with everything it sent. Here no pass runs at all:
// the reader must stop reading once maxUnapplied bytes wait.
func TestReaderBoundsUnappliedFrames(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		defer func(v int) { maxUnapplied = v }(maxUnapplied)
		maxUnapplied = 1 << 20
		a, b := net.Pipe()
		tr := &Tier{}
		tr.env.Wake = func() {}
		cc := &ctrlConn{c: a}
		cc.out.cond = sync.NewCond(&cc.out.Mutex)
		cc.in.cond = sync.NewCond(&cc.in.Mutex)
		done := make(chan struct{})
		go func() { defer close(done); tr.reader(cc) }()
		frame := wire.Append(nil, wire.Lookup{ReqID: "kv", Round: 1, Keys: make([]wire.Key, 1024)}) // 32 KiB
		const frames = 256                                                                          // 8 MiB
		var sent atomic.Int64
		wdone := make(chan struct{})
		go func() {
			defer close(wdone)
			for range frames {
				if _, err := b.Write(frame); err != nil {
					return
				}
				sent.Add(1)
			}
		}()
		synctest.Wait() // the reader either read everything or waits for the manager
		tr.ev.Lock()
		queued := len(tr.ev.q)
		tr.ev.Unlock()
		if limit := maxUnapplied/len(frame) + 2; queued > limit {
			t.Errorf("%d frames (%d KiB) read and waiting for the manager, want at most %d (maxUnapplied %d KiB)",
				queued, queued*len(frame)>>10, limit, maxUnapplied>>10)
		}
		// Applying the queued frames lets the reader go on.
		tr.ev.Lock()
		q := tr.ev.q
		tr.ev.q = nil
		tr.ev.Unlock()
		for _, e := range q {
			if f, ok := e.(frameReceived); ok {
				f.cc.release(f.n)
			}
		}
		synctest.Wait()
		if queued < frames && sent.Load() == int64(queued) {
			t.Error("the reader did not go on once its frames were applied")
		}
		tr.endConn(cc) // wakes a reader that waits
		b.Close()
		a.Close()
		<-done
		<-wdone
	})
}
