package e2e

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/kvtier/kvtier/ctl"
	"github.com/kvtier/kvtier/p2pd/engine"
	p2pnode "github.com/kvtier/kvtier/p2pd/node"
	"github.com/kvtier/kvtier/p2pd/p2p"
)

// ctl keeps its own copies of the admin API's answers (it imports nothing
// of p2pd); every field p2pd sends must survive the round trip through
// them.
func TestAnswerShapesAgree(t *testing.T) {
	var s p2pnode.Status
	s.Node, s.State, s.Peers, s.HasPendingWork = "n1", "paused", 2, true
	s.Requests.Running, s.Requests.Waiting = 3, 4
	s.CPUTier.Slots, s.CPUTier.Used, s.CPUTier.Pinned = 5, 6, 7
	s.Poll, s.P2P, s.Copies, s.P2PAuth = "poll", "p2p", "copies", "token"
	s.P2PHealth = p2p.Health{OK: false, Accepting: true, AcceptErrors: 3, LastAcceptError: "accept: too many open files",
		LastErrorAt: time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)}
	roundTrip(t, s, &ctl.Status{})

	r := engine.Result{RequestID: "r1", Blocks: 8, KVDigest: "ab", ElapsedMS: 1.5,
		Sources: engine.Sources{CPU: 1, Disk: 2, Peer: 3, Computed: 2}}
	roundTrip(t, r, &ctl.Result{})

	ps := p2pnode.Peers{Node: "n1", P2P: "127.0.0.1:1", Peers: []p2p.PeerInfo{
		{Node: "n2", Addr: "127.0.0.1:2", Ready: true, Dialed: true, Requests: 1, Rounds: 2}}}
	roundTrip(t, ps, &ctl.Peers{})
}

// roundTrip sends v as p2pd would, decodes it into ctl's mirror (no unknown
// fields allowed) and checks that encoding the mirror gives the same JSON.
func roundTrip(t *testing.T, v, mirror any) {
	t.Helper()
	sent, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(sent))
	dec.DisallowUnknownFields()
	if err := dec.Decode(mirror); err != nil {
		t.Fatalf("%T cannot hold p2pd's %T: %v", mirror, v, err)
	}
	back, err := json.Marshal(mirror)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, sent) {
		t.Errorf("%T round trip through %T:\n got %s\nwant %s", v, mirror, back, sent)
	}
}
