package p2p

import (
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/p2p/protocol"
)

// applyProd carries out what a session's producer (protocol.Producer, the
// state machine of the serving side) asked for: frames to the peer,
// writes on the data plane (whose end comes back as WriteDone), lease
// results for the manager, finished outside requests.
func (t *Tier) applyProd(s *session) {
	for _, a := range s.prod.Take() {
		switch a := a.(type) {
		case protocol.SendFrame:
			t.send(s, a.Msg)
		case protocol.StartWrite:
			id := a.Round
			t.dp.Write(s.peer, t.writeID(s, id), a.Pairs, func(err error) { t.post(writeDone{s, id, err}) })
		case protocol.CancelWrite:
			t.dp.Cancel(s.peer, t.writeOf(s, a.Round))
		case protocol.JobDone:
			t.results = append(t.results, a.Result)
		case protocol.FinishRequest:
			t.finishOutside(a.Req)
		}
	}
}

var (
	_ offload.Tier          = (*Tier)(nil)
	_ offload.RequestHooks  = (*Tier)(nil)
	_ offload.Server        = (*Tier)(nil)
	_ offload.StepEnder     = (*Tier)(nil)
	_ offload.Prober        = (*Tier)(nil)
	_ offload.Pender        = (*Tier)(nil)
	_ offload.Resetter      = (*Tier)(nil)
	_ offload.StatsReporter = (*Tier)(nil)
)
