//go:build nixl

package nixlgo

/*
#cgo CXXFLAGS: -std=c++20
#cgo LDFLAGS: -lnixl -lnixl_build -lstdc++
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"encoding/binary"
	"os"
	"sync"
	"unsafe"
)

// Agent is a NIXL agent. Its methods are safe for concurrent use: one
// mutex serialises them (NIXL's SYNC_NONE mode).
type Agent struct {
	mu     sync.Mutex
	a      *C.nx_agent
	closed bool
}

// Dlist is a prepared descriptor list: n blocks of one size, local or of a
// remote agent; transfers pick blocks by index.
type Dlist struct {
	agent *Agent
	h     unsafe.Pointer
}

// Req is a transfer request.
type Req struct {
	agent *Agent
	h     unsafe.Pointer
}

func lastErr(op string, s C.int) error {
	msg := ""
	if Status(s) == StatusUnknown {
		msg = C.GoString(C.nx_last_error())
	}
	return statusErr(op, Status(s), msg)
}

var envOnce sync.Once

// NewAgent creates an agent; name must be unique among the peers. UCX
// reads its environment when the first agent is created: UCX_TLS and
// UCX_NET_DEVICES choose the transports, and UCX_RCACHE_MAX_UNRELEASED is
// set to 1024 unless already set (a UCX memory leak otherwise).
func NewAgent(name string, cfg AgentConfig) (*Agent, error) {
	envOnce.Do(func() {
		if os.Getenv("UCX_RCACHE_MAX_UNRELEASED") == "" {
			os.Setenv("UCX_RCACHE_MAX_UNRELEASED", "1024")
		}
	})
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	prog := C.int(0)
	if cfg.ProgressThread {
		prog = 1
	}
	var a *C.nx_agent
	if s := C.nx_agent_new(cname, prog, &a); s != 0 {
		return nil, lastErr("create agent", s)
	}
	return &Agent{a: a}, nil
}

// Close destroys the agent. It is idempotent.
func (a *Agent) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.closed {
		a.closed = true
		C.nx_agent_free(a.a)
	}
	return nil
}

func (a *Agent) lock(op string) error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return &Error{Op: op, Status: StatusNotAllowed, Msg: "agent closed"}
	}
	return nil
}

// CreateUCX creates the UCX backend with NIXL's defaults overridden by
// params (e.g. "ucx_error_handling_mode": "peer").
func (a *Agent) CreateUCX(params map[string]string) error {
	if err := a.lock("create UCX backend"); err != nil {
		return err
	}
	defer a.mu.Unlock()
	n := len(params)
	keys := C.malloc(C.size_t(max(n, 1)) * C.size_t(unsafe.Sizeof(uintptr(0))))
	vals := C.malloc(C.size_t(max(n, 1)) * C.size_t(unsafe.Sizeof(uintptr(0))))
	defer C.free(keys)
	defer C.free(vals)
	ks := unsafe.Slice((**C.char)(keys), max(n, 1))
	vs := unsafe.Slice((**C.char)(vals), max(n, 1))
	i := 0
	for k, v := range params {
		ks[i], vs[i] = C.CString(k), C.CString(v)
		defer C.free(unsafe.Pointer(ks[i]))
		defer C.free(unsafe.Pointer(vs[i]))
		i++
	}
	return lastErr("create UCX backend", C.nx_create_ucx(a.a, (**C.char)(keys), (**C.char)(vals), C.int(n)))
}

// Register registers n bytes at base (DRAM, outside the Go heap: NIXL
// keeps the address).
func (a *Agent) Register(base uintptr, n int) error {
	if err := a.lock("register memory"); err != nil {
		return err
	}
	defer a.mu.Unlock()
	return lastErr("register memory", C.nx_register(a.a, C.uintptr_t(base), C.size_t(n)))
}

// Deregister undoes Register.
func (a *Agent) Deregister(base uintptr, n int) error {
	if err := a.lock("deregister memory"); err != nil {
		return err
	}
	defer a.mu.Unlock()
	return lastErr("deregister memory", C.nx_deregister(a.a, C.uintptr_t(base), C.size_t(n)))
}

// LocalMetadata returns what a peer needs to reach this agent's
// registered memory.
func (a *Agent) LocalMetadata() ([]byte, error) {
	if err := a.lock("get local metadata"); err != nil {
		return nil, err
	}
	defer a.mu.Unlock()
	var p *C.char
	var n C.size_t
	if s := C.nx_local_md(a.a, &p, &n); s != 0 {
		return nil, lastErr("get local metadata", s)
	}
	defer C.free(unsafe.Pointer(p))
	return C.GoBytes(unsafe.Pointer(p), C.int(n)), nil
}

// LoadRemote loads a peer's metadata and returns its agent name.
func (a *Agent) LoadRemote(md []byte) (string, error) {
	if err := a.lock("load remote metadata"); err != nil {
		return "", err
	}
	defer a.mu.Unlock()
	if len(md) == 0 {
		return "", &Error{Op: "load remote metadata", Status: StatusInvalidParam, Msg: "empty metadata"}
	}
	cmd := C.CBytes(md)
	defer C.free(cmd)
	var name *C.char
	if s := C.nx_load_md(a.a, (*C.char)(cmd), C.size_t(len(md)), &name); s != 0 {
		return "", lastErr("load remote metadata", s)
	}
	defer C.free(unsafe.Pointer(name))
	return C.GoString(name), nil
}

// InvalidateRemote forgets a peer (and disconnects from it).
func (a *Agent) InvalidateRemote(name string) error {
	if err := a.lock("invalidate remote metadata"); err != nil {
		return err
	}
	defer a.mu.Unlock()
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	return lastErr("invalidate remote metadata", C.nx_invalidate(a.a, cname))
}

// Prep prepares n blocks of size bytes, the i-th at base + i×stride: on
// this agent (remote "") or on a loaded remote agent.
func (a *Agent) Prep(remote string, base uintptr, stride, size, n int) (*Dlist, error) {
	if err := a.lock("prepare descriptor list"); err != nil {
		return nil, err
	}
	defer a.mu.Unlock()
	var cname *C.char
	if remote != "" {
		cname = C.CString(remote)
		defer C.free(unsafe.Pointer(cname))
	}
	var h unsafe.Pointer
	if s := C.nx_prep(a.a, cname, C.uintptr_t(base), C.size_t(stride), C.size_t(size), C.int(n), &h); s != 0 {
		return nil, lastErr("prepare descriptor list", s)
	}
	return &Dlist{agent: a, h: h}, nil
}

// Release releases a prepared list.
func (d *Dlist) Release() error {
	if err := d.agent.lock("release descriptor list"); err != nil {
		return err
	}
	defer d.agent.mu.Unlock()
	return lastErr("release descriptor list", C.nx_release_dlist(d.agent.a, d.h))
}

// MakeXfer builds a transfer of local blocks lidx to (Write) or from
// (Read) remote blocks ridx; notif, when not nil, reaches the remote agent
// after the data.
func (a *Agent) MakeXfer(op Op, local *Dlist, lidx []int32, remote *Dlist, ridx []int32, notif []byte) (*Req, error) {
	if err := a.lock("make transfer request"); err != nil {
		return nil, err
	}
	defer a.mu.Unlock()
	if len(lidx) != len(ridx) || len(lidx) == 0 {
		return nil, &Error{Op: "make transfer request", Status: StatusInvalidParam, Msg: "index lists differ in length or are empty"}
	}
	size := C.size_t(len(lidx)) * C.size_t(unsafe.Sizeof(C.int(0)))
	lp, rp := C.malloc(size), C.malloc(size)
	defer C.free(lp)
	defer C.free(rp)
	ls, rs := unsafe.Slice((*C.int)(lp), len(lidx)), unsafe.Slice((*C.int)(rp), len(ridx))
	for i := range lidx {
		ls[i], rs[i] = C.int(lidx[i]), C.int(ridx[i])
	}
	var cn *C.char
	if notif != nil {
		cn = (*C.char)(C.CBytes(append(notif, 0)))
		defer C.free(unsafe.Pointer(cn))
	}
	var h unsafe.Pointer
	s := C.nx_make_xfer(a.a, C.int(op), local.h, (*C.int)(lp), remote.h, (*C.int)(rp), C.int(len(lidx)), cn, C.size_t(len(notif)), &h)
	if s != 0 {
		return nil, lastErr("make transfer request", s)
	}
	return &Req{agent: a, h: h}, nil
}

// Post starts the transfer and reports whether it already completed.
func (r *Req) Post() (bool, error) {
	if err := r.agent.lock("post transfer"); err != nil {
		return false, err
	}
	defer r.agent.mu.Unlock()
	s := C.nx_post(r.agent.a, r.h)
	return Status(s) == StatusSuccess, lastErr("post transfer", s)
}

// Status polls the transfer: true once complete. The initiator must keep
// calling it until then.
func (r *Req) Status() (bool, error) {
	if err := r.agent.lock("transfer status"); err != nil {
		return false, err
	}
	defer r.agent.mu.Unlock()
	s := C.nx_status(r.agent.a, r.h)
	return Status(s) == StatusSuccess, lastErr("transfer status", s)
}

// Release releases the request; releasing one in flight cancels it.
func (r *Req) Release() error {
	if err := r.agent.lock("release transfer"); err != nil {
		return err
	}
	defer r.agent.mu.Unlock()
	return lastErr("release transfer", C.nx_release_req(r.agent.a, r.h))
}

// Notif is a notification from a remote agent.
type Notif struct {
	From string
	Msg  []byte
}

// Notifs drains the notifications received so far. On the target side it
// is also what drives progress without a progress thread: call it while
// transfers into this agent's memory run.
func (a *Agent) Notifs() ([]Notif, error) {
	if err := a.lock("get notifications"); err != nil {
		return nil, err
	}
	defer a.mu.Unlock()
	var p *C.char
	var n C.size_t
	if s := C.nx_notifs(a.a, &p, &n); s != 0 {
		return nil, lastErr("get notifications", s)
	}
	defer C.free(unsafe.Pointer(p))
	b := C.GoBytes(unsafe.Pointer(p), C.int(n))
	var out []Notif
	for len(b) >= 8 {
		fl := int(binary.LittleEndian.Uint32(b))
		from := string(b[4 : 4+fl])
		b = b[4+fl:]
		ml := int(binary.LittleEndian.Uint32(b))
		out = append(out, Notif{From: from, Msg: append([]byte(nil), b[4:4+ml]...)})
		b = b[4+ml:]
	}
	return out, nil
}
