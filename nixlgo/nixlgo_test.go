package nixlgo

import (
	"errors"
	"testing"
)

// Statuses stay distinct through Go errors.
func TestErrors(t *testing.T) {
	err := statusErr("postXferReq", StatusRemoteDisconnect, "")
	if !errors.Is(err, ErrRemoteDisconnect) || errors.Is(err, ErrInvalidParam) {
		t.Errorf("%v: want ErrRemoteDisconnect only", err)
	}
	var ne *Error
	if !errors.As(err, &ne) || ne.Status != StatusRemoteDisconnect || ne.Op != "postXferReq" {
		t.Errorf("As: %+v", ne)
	}
	if statusErr("x", StatusSuccess, "") != nil || statusErr("x", StatusInProgress, "") != nil {
		t.Error("success and in-progress are not errors")
	}
	if e := statusErr("x", Status(-99), "boom"); e == nil || errors.Unwrap(e) != nil {
		t.Errorf("an unknown status: %v", e)
	}
}

// Without the nixl tag, the constructor says so; with it (and NIXL
// present), it makes an agent.
func TestNewAgent(t *testing.T) {
	a, err := NewAgent("kvtier-test", AgentConfig{})
	if errors.Is(err, ErrNotBuilt) {
		t.Skip("built without NIXL (-tags nixl): nothing to create")
	}
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
}
