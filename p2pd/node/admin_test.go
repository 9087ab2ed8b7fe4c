package node

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/offload"
)

// S8.3: at start the admin socket path is never taken over: anything but
// a socket is refused and left as it was, a socket on which a daemon
// answers is refused, and only a stale socket is replaced. On close the
// socket is removed only while the path still names it.
func TestAdminSocketPath(t *testing.T) {
	answers := func(t *testing.T, path string) bool {
		t.Helper()
		c, err := net.Dial("unix", path)
		if err == nil {
			c.Close()
		}
		return err == nil
	}
	t.Run("regular file", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "a.sock")
		if err := os.WriteFile(path, []byte("keep"), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := listenAdmin(path)
		if !errors.Is(err, offload.ErrConfig) || !strings.Contains(err.Error(), "admin:") {
			t.Errorf("listenAdmin over a file: %v, want ErrConfig naming admin", err)
		}
		if b, err := os.ReadFile(path); err != nil || string(b) != "keep" {
			t.Errorf("the file is now %q, %v", b, err)
		}
	})
	t.Run("directory and symlink", func(t *testing.T) {
		dir := t.TempDir()
		sub, link := filepath.Join(dir, "d"), filepath.Join(dir, "l")
		stale := staleSocket(t, filepath.Join(dir, "s"))
		if err := os.Mkdir(sub, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(stale, link); err != nil {
			t.Fatal(err)
		}
		for _, p := range []string{sub, link} {
			if _, err := listenAdmin(p); !errors.Is(err, offload.ErrConfig) {
				t.Errorf("listenAdmin(%s): %v, want ErrConfig", p, err)
			}
			if _, err := os.Lstat(p); err != nil {
				t.Errorf("%s was removed: %v", p, err)
			}
		}
		if _, err := os.Lstat(stale); err != nil {
			t.Errorf("the symlink's target was removed: %v", err)
		}
	})
	t.Run("live daemon", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "a.sock")
		live, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		defer live.Close()
		if _, err := listenAdmin(path); !errors.Is(err, ErrAdminInUse) || !strings.Contains(err.Error(), "admin:") {
			t.Errorf("listenAdmin over a live socket: %v, want ErrAdminInUse naming admin", err)
		}
		if !answers(t, path) {
			t.Error("the live daemon's socket no longer answers")
		}
	})
	t.Run("stale socket", func(t *testing.T) {
		path := staleSocket(t, filepath.Join(t.TempDir(), "a.sock"))
		a, err := listenAdmin(path)
		if err != nil {
			t.Fatalf("listenAdmin over a stale socket: %v", err)
		}
		fi, err := os.Stat(path)
		if err != nil || fi.Mode().Perm() != 0o600 || !answers(t, path) {
			t.Errorf("new socket: %v, %v, want mode 0600 and answering", fi, err)
		}
		a.close()
		if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("our socket survived close: %v", err)
		}
	})
	t.Run("taken over before close", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "a.sock")
		a, err := listenAdmin(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		other, err := net.Listen("unix", path) // another daemon's socket now
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		a.close()
		if !answers(t, path) {
			t.Error("closing the first socket removed the second daemon's")
		}
	})
}

// staleSocket leaves a socket file at path that nobody listens on, as a
// crashed daemon does.
func staleSocket(t *testing.T, path string) string {
	t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	return path
}
