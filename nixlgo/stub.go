//go:build !nixl

package nixlgo

// Agent is a NIXL agent; this build has none.
type Agent struct{}

// Dlist is a prepared descriptor list.
type Dlist struct{}

// Req is a transfer request.
type Req struct{}

// Notif is a notification from a remote agent.
type Notif struct {
	From string
	Msg  []byte
}

// NewAgent returns ErrNotBuilt: this binary was built without NIXL.
func NewAgent(string, AgentConfig) (*Agent, error) { return nil, ErrNotBuilt }

func (*Agent) Close() error                                        { return nil }
func (*Agent) CreateUCX(map[string]string) error                   { return ErrNotBuilt }
func (*Agent) Register(uintptr, int) error                         { return ErrNotBuilt }
func (*Agent) Deregister(uintptr, int) error                       { return ErrNotBuilt }
func (*Agent) LocalMetadata() ([]byte, error)                      { return nil, ErrNotBuilt }
func (*Agent) LoadRemote([]byte) (string, error)                   { return "", ErrNotBuilt }
func (*Agent) InvalidateRemote(string) error                       { return ErrNotBuilt }
func (*Agent) Prep(string, uintptr, int, int, int) (*Dlist, error) { return nil, ErrNotBuilt }
func (*Dlist) Release() error                                      { return ErrNotBuilt }
func (*Agent) MakeXfer(Op, *Dlist, []int32, *Dlist, []int32, []byte) (*Req, error) {
	return nil, ErrNotBuilt
}
func (*Req) Post() (bool, error)        { return false, ErrNotBuilt }
func (*Req) Status() (bool, error)      { return false, ErrNotBuilt }
func (*Req) Release() error             { return ErrNotBuilt }
func (*Agent) Notifs() ([]Notif, error) { return nil, ErrNotBuilt }
