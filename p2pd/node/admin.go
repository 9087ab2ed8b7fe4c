package node

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/offload"
)

// ErrAdminInUse is an admin socket path on which a live daemon answers.
var ErrAdminInUse = errors.New("node: admin socket in use")

// adminProbeTimeout bounds the connect that tells a live daemon's socket
// from a stale one.
const adminProbeTimeout = time.Second

// adminSocket is the admin API's unix socket. It is removed on close only
// while the path still names the socket it created.
type adminSocket struct {
	path string
	ln   *net.UnixListener
	made os.FileInfo // the socket as created, for os.SameFile
}

// listenAdmin opens the admin socket at path with mode 0600 (S8.3). An
// existing path is never taken over: anything but a socket is an error
// and is left alone; a socket on which a daemon accepts a connection
// within adminProbeTimeout is ErrAdminInUse; only a stale socket (the
// connection is refused) is removed.
func listenAdmin(path string) (*adminSocket, error) {
	if err := clearStale(path); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("admin: %w", err)
	}
	// Closing must not unlink a path another daemon may have taken since.
	ln.SetUnlinkOnClose(false)
	a := &adminSocket{path: path, ln: ln}
	if a.made, err = os.Lstat(path); err != nil {
		ln.Close()
		return nil, fmt.Errorf("admin: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		a.close()
		return nil, fmt.Errorf("admin: %w", err)
	}
	return a, nil
}

// clearStale makes way for a new socket at path, or says why not.
func clearStale(path string) error {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return fmt.Errorf("admin: %w", err)
	case fi.Mode().Type() != fs.ModeSocket:
		return fmt.Errorf("%w: admin: %s exists and is not a unix socket (%s); it is left alone", offload.ErrConfig, path, kind(fi.Mode()))
	}
	c, err := net.DialTimeout("unix", path, adminProbeTimeout)
	switch {
	case err == nil:
		c.Close()
		return fmt.Errorf("%w: admin: a daemon answers on %s", ErrAdminInUse, path)
	case errors.Is(err, fs.ErrNotExist):
		return nil // gone meanwhile
	case !errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Errorf("admin: %s: cannot tell whether a daemon listens on it: %w", path, err)
	}
	// Stale. Remove it only if it is still the socket probed.
	if now, err := os.Lstat(path); err != nil || !os.SameFile(fi, now) {
		return fmt.Errorf("admin: %s changed while it was probed", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("admin: removing the stale socket: %w", err)
	}
	return nil
}

// close closes the listener (if still open) and removes the socket if the
// path still names it.
func (a *adminSocket) close() {
	a.ln.Close()
	a.remove()
}

// remove removes the socket if the path still names the one created.
func (a *adminSocket) remove() {
	if now, err := os.Lstat(a.path); err == nil && os.SameFile(a.made, now) {
		os.Remove(a.path)
	}
}

func kind(m fs.FileMode) string {
	switch m.Type() {
	case 0:
		return "a regular file"
	case fs.ModeDir:
		return "a directory"
	case fs.ModeSymlink:
		return "a symlink"
	}
	return "a " + m.Type().String()
}
