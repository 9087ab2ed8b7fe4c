package p2p

import (
	"context"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Network makes connections; tests inject an in-memory one (S7.1).
type Network interface {
	Listen(addr string) (net.Listener, error)
	Dial(ctx context.Context, addr string) (net.Conn, error)
}

// TCP is the real network. Its connections use kernel TCP keep-alive, so
// an idle connection costs the process no wakeups (S6.9).
type TCP struct {
	// KeepAlive is the idle time before the kernel probes (default 15 s).
	KeepAlive time.Duration
}

func (t TCP) control(_, _ string, c syscall.RawConn) error {
	idle := int(t.KeepAlive / time.Second)
	if idle <= 0 {
		idle = 15
	}
	var serr error
	err := c.Control(func(fd uintptr) {
		for _, o := range [][3]int{
			{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
			{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, idle},
			{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, 5},
			{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, 3},
			{unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
		} {
			if serr = unix.SetsockoptInt(int(fd), o[0], o[1], o[2]); serr != nil {
				return
			}
		}
	})
	if err != nil {
		return err
	}
	return serr
}

// Listen listens on addr with keep-alive set on accepted connections.
func (t TCP) Listen(addr string) (net.Listener, error) {
	lc := net.ListenConfig{Control: t.control, KeepAlive: -1}
	return lc.Listen(context.Background(), "tcp", addr)
}

// Dial connects to addr (a DNS name resolves here, at connect time).
func (t TCP) Dial(ctx context.Context, addr string) (net.Conn, error) {
	d := net.Dialer{Control: t.control, KeepAlive: -1}
	return d.DialContext(ctx, "tcp", addr)
}
