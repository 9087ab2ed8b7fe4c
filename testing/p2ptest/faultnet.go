package p2ptest

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/kvtier/kvtier/p2pd/p2p"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// Fault is what a FaultNet does to the data connections it dials (the
// producer's side of the TCP data plane).
type Fault struct {
	// After is how many bytes of block data pass untouched first.
	After int64
	// Corrupt flips one byte at After.
	Corrupt bool
	// Cut closes the connection at After.
	Cut bool
	// Drop discards everything from After on while reporting success.
	Drop bool
	// Delay sleeps before each write.
	Delay time.Duration
}

// FaultNet is a p2p.Network over real TCP that injects Fault into data
// connections; control connections pass untouched.
type FaultNet struct {
	Inner p2p.Network
	mu    sync.Mutex
	fault Fault
}

// Set changes the fault for connections dialled from now on.
func (f *FaultNet) Set(fault Fault) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fault = fault
}

func (f *FaultNet) Listen(addr string) (net.Listener, error) { return f.Inner.Listen(addr) }

func (f *FaultNet) Dial(ctx context.Context, addr string) (net.Conn, error) {
	c, err := f.Inner.Dial(ctx, addr)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return &faultConn{Conn: c, fault: f.fault}, nil
}

// faultConn applies its fault once it has seen a data hello.
type faultConn struct {
	net.Conn
	fault   Fault
	started bool // the first frame was written
	data    bool // it was a data hello
	written int64
}

var errCut = errors.New("p2ptest: connection cut")

func (c *faultConn) Write(p []byte) (int, error) {
	if !c.started {
		c.started = true
		c.data = len(p) > 7 && wire.Type(p[4]) == wire.THello && wire.ConnKind(p[7]) == wire.KindData
		return c.Conn.Write(p)
	}
	if !c.data {
		return c.Conn.Write(p)
	}
	if c.fault.Delay > 0 {
		time.Sleep(c.fault.Delay)
	}
	f := c.fault
	start, end := c.written, c.written+int64(len(p))
	c.written = end
	switch {
	case f.Cut && end > f.After:
		keep := max(0, f.After-start)
		c.Conn.Write(p[:keep])
		c.Conn.Close()
		return int(keep), errCut
	case f.Drop && end > f.After:
		keep := max(0, f.After-start)
		if _, err := c.Conn.Write(p[:keep]); err != nil {
			return 0, err
		}
		return len(p), nil
	case f.Corrupt && start <= f.After && f.After < end:
		q := append([]byte(nil), p...)
		q[f.After-start] ^= 0xff
		return c.Conn.Write(q)
	}
	return c.Conn.Write(p)
}
