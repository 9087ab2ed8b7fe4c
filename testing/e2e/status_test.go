package e2e

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/kvtier/kvtier/ctl"
	p2pnode "github.com/kvtier/kvtier/p2pd/node"
)

// ctl keeps its own copy of GET /v0/status's shape (it imports nothing of
// p2pd); every field p2pd sends must survive the round trip through it.
func TestStatusShapesAgree(t *testing.T) {
	var s p2pnode.Status
	s.Node, s.State, s.Peers, s.HasPendingWork = "n1", "paused", 2, true
	s.Requests.Running, s.Requests.Waiting = 3, 4
	s.CPUTier.Slots, s.CPUTier.Used, s.CPUTier.Pinned = 5, 6, 7
	s.Poll, s.P2P, s.Copies = "poll", "p2p", "copies"
	sent, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(sent))
	dec.DisallowUnknownFields()
	var c ctl.Status
	if err := dec.Decode(&c); err != nil {
		t.Fatalf("ctl.Status cannot hold p2pd's status: %v", err)
	}
	back, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, sent) {
		t.Errorf("status round trip through ctl:\n got %s\nwant %s", back, sent)
	}
}
