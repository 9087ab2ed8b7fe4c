package node

import (
	"bytes"
	"encoding/binary"
	"strings"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/vllmwire"
	"github.com/kvtier/kvtier/p2pd/zmtp"
)

// vllmEvents publishes the node's event stream in vLLM's KV-events format
// (issue 15; p2pd/vllmwire): a ZMQ PUB socket on kv_events_endpoint, one
// batch per read of the event log, so a router that indexes vLLM
// instances indexes this node the same way. Its goroutine is stopped by
// close (Shutdown), or ends with the event log.
type vllmEvents struct {
	pub  *zmtp.Publisher
	stop chan struct{}
	done chan struct{}
}

// vllmEventsHWM bounds each subscriber's queue of batches (libzmq's PUB
// drops above its high-water mark too).
const vllmEventsHWM = 10000

func startVLLMEvents(n *Node) (*vllmEvents, error) {
	pub, err := zmtp.Listen(n.cfg.KVEventsEndpoint, vllmEventsHWM, n.log)
	if err != nil {
		return nil, err
	}
	v := &vllmEvents{pub: pub, stop: make(chan struct{}), done: make(chan struct{})}
	go v.run(n)
	return v, nil
}

func (v *vllmEvents) run(n *Node) {
	defer close(v.done)
	cfg := n.M.Config()
	root, topic := cfg.KeyScheme().Root(), []byte(n.cfg.KVEventsTopic)
	since, seq := uint64(0), uint64(0)
	for {
		ev, wait, ended := n.evlog.read(since, eventBatch)
		if len(ev) > 0 {
			since = ev[len(ev)-1].Seq
			batch := make([]vllmwire.KVEvent, 0, len(ev))
			for _, e := range ev {
				batch = append(batch, toVLLMEvent(e, root, cfg.Geometry.BlockTokens))
			}
			payload := vllmwire.EncodeEventBatch(nil, float64(time.Now().UnixNano())/1e9, batch, 0, !n.cfg.KVEventsByteHashes)
			v.pub.Publish(topic, binary.BigEndian.AppendUint64(nil, seq), payload)
			seq++
			continue
		}
		if ended {
			return
		}
		select {
		case <-wait:
		case <-v.stop:
			return
		}
	}
}

// toVLLMEvent converts one event. A cache reset is AllBlocksCleared (vLLM's
// has no tier: a router forgets this node's disk blocks too, which errs on
// the safe side), and so is a lost marker (the publisher fell behind the
// log: the router's view would be wrong otherwise).
func toVLLMEvent(e offload.Event, root offload.Key, blockTokens int) vllmwire.KVEvent {
	out := vllmwire.KVEvent{Medium: strings.ToUpper(e.Tier), BlockSize: blockTokens}
	for _, k := range e.Keys {
		out.Hashes = append(out.Hashes, bytes.Clone(k[:]))
	}
	switch e.Kind {
	case offload.EventStored:
		out.Kind = vllmwire.BlockStored
		if e.Parent != nil && *e.Parent != root {
			out.Parent = bytes.Clone(e.Parent[:])
		}
		out.TokenIDs = e.Tokens
	case offload.EventRemoved:
		out.Kind = vllmwire.BlockRemoved
	default:
		out.Kind = vllmwire.AllBlocksCleared
	}
	return out
}

// subscribers is the publisher's connected subscribers.
func (v *vllmEvents) subscribers() int {
	n, _ := v.pub.Subscribers()
	return n
}

func (v *vllmEvents) close() {
	close(v.stop)
	<-v.done
	v.pub.Close()
}
