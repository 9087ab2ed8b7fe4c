package p2p

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/script"
	"github.com/kvtier/kvtier/p2pd/wire"
)

// TestScenarios runs the protocol scripts of testdata/ (offload/script):
// real nodes against hand-driven fake peers over in-memory connections,
// each script in a synctest bubble, so every timeout runs in fake time.
// `go test -run TestScenarios -update` rewrites the expected outputs.
//
// Commands (keys k1, k2, … of one chain):
//
//	store N K… | write N K…           blocks ready in N's CPU tier, or being written (never completed)
//	listen F                          F's data port, which the node dials to write blocks
//	connect F N [as=ID] [nonce=X]     fake peer F (node id ID, F's by default; dialler nonce X) connects to node N and completes the handshake
//	send F lookup|fetch|abort|lookup_resp|transfer_done|ping|pong|disconnect req=R round=N [keys=K,…] [slots=S,…] [hits=1,0,…] [ok=true] [seq=N] [code=C]
//	recv F                            the next message the node sent F
//	idle F                            whether nothing waits for F
//	blocks F n=N                      F accepts the data connections and reads N blocks
//	sleep D | wait                    advance the fake clock by D; wait for the bubble
//	pins N | stat N NAME | errors N REASON
//	node N [slots=16] [token=T] [max_sessions=K]  a node with a P2P tier (a cluster token, a session cap)
//	handshake F N [token=T] [hash_seed=S]  F dials N and runs the handshake by hand; how it ended
//	sessions N                        N's sessions, and the consumers it can find a session for
//	complete N K…                     the store that "write" began finishes
//	reset N | reset-done N            a cache reset starts (it may wait on transfers); its end
//	close F | mute F | pings F        F's control connection drops; F stops answering pings; pings F got
//
// The consumer side: the node's request r fetches from a fake producer.
//
//	consumer N F [lookup_hold=D]      node N whose request r names fake producer F, which accepts N's connection
//	progress N                        whether N's manager signalled progress since the last look (drains it)
//	lookup N K…                       one engine step of r's lookups on N; prints the answers
//	reply F hits=1,0,…                F answers the last lookup it received
//	ack F                             F acknowledges the last abort it received
//	finish N                          r finishes on N
//	cpu N                             N's CPU slots being written, and P2P promotion failures
//	probes N                          r's keys asked and unanswered, the keys it tracks, whether the peer is busy
func TestScenarios(t *testing.T) {
	script.RunDir(t, "testdata", func(*testing.T) func(*testing.T, *script.Cmd) string {
		s := &protoScenario{mn: newMemNet(), nodes: map[string]*node{}, fakes: map[string]*fakePeer{},
			data: map[string]net.Listener{}, keys: testKeys(1, 32), start: time.Now(), last: map[string]wire.Msg{}}
		return s.do
	})
}

type protoScenario struct {
	mn    *memNet
	nodes map[string]*node
	fakes map[string]*fakePeer
	data  map[string]net.Listener
	keys  []offload.Key
	start time.Time
	req   *offload.Request    // the consumer's request (consumer)
	last  map[string]wire.Msg // per fake, the last lookup or abort it received
	reset chan error          // a reset in progress (reset, reset-done)
}

func (s *protoScenario) do(t *testing.T, c *script.Cmd) string {
	t.Helper()
	w := c.Words()
	switch c.Name {
	case "node":
		slots, _ := strconv.Atoi(c.Val("slots", "16"))
		tok, withToken := c.Lookup("token")
		maxSessions, _ := strconv.Atoi(c.Val("max_sessions", "0"))
		edit := func(cfg *Config) {
			if withToken {
				cfg.ClusterToken = tok
			}
			if maxSessions > 0 {
				cfg.MaxSessions = maxSessions
			}
		}
		s.nodes[w[0]] = newNode(t, s.mn, edit, slots)
	case "handshake":
		// F dials N and runs the handshake by hand, with its own token and
		// hash seed; prints how it ended.
		n := s.node(t, c, w[1])
		conn, err := s.mn.Dial(context.Background(), n.tier.Addr())
		if err != nil {
			t.Fatal(err)
		}
		f := newFake(t, w[0], c.Val("token", ""))
		f.c = conn
		if seed, ok := c.Lookup("hash_seed"); ok {
			f.node.HashSeed = seed
		}
		_, err = f.shaker().dialControl(conn)
		if err == nil {
			f.serve() // a connected fake peer, like connect's
			s.fakes[w[0]] = f
			synctest.Wait()
			return "connected"
		}
		conn.Close()
		synctest.Wait()
		var re *rejectError
		switch {
		case errors.As(err, &re):
			return fmt.Sprintf("rejected code=%v by_peer=%v", re.Code, re.ByPeer)
		}
		return "failed: " + err.Error()
	case "store":
		s.node(t, c, w[0]).store(t, s.keysOf(t, c, w[1:]))
	case "write":
		n, req := s.node(t, c, w[0]), &offload.Request{ID: "w"}
		n.m.Do(func(st *offload.Step) {
			st.OnNewRequest(req)
			st.PrepareStore(s.keysOf(t, c, w[1:]), req)
		})
	case "listen":
		l, err := s.mn.Listen(w[0] + ":1")
		if err != nil {
			t.Fatal(err)
		}
		s.data[w[0]] = l
	case "connect":
		n := s.node(t, c, w[1])
		f := newFake(t, c.Val("as", w[0]), n.tier.cfg.ClusterToken)
		conn, err := s.mn.Dial(context.Background(), n.tier.Addr())
		if err != nil {
			t.Fatal(err)
		}
		f.c = conn
		hs := f.shaker()
		if v, ok := c.Lookup("nonce"); ok {
			x, err := strconv.ParseUint(v, 10, 8)
			if err != nil {
				t.Fatalf("%s: nonce %q", c.Pos, v)
			}
			hs.nonces = func() [32]byte { return [32]byte{byte(x)} }
		}
		if _, err := hs.dialControl(conn); err != nil {
			t.Fatalf("%s: fake peer handshake: %v", c.Pos, err)
		}
		f.serve()
		s.fakes[w[0]] = f
	case "send":
		f := s.fake(t, c, w[0])
		req := c.Val("req", "")
		round, _ := strconv.ParseUint(c.Val("round", "1"), 10, 64)
		keys := wkeys(s.keysOf(t, c, list(c.Val("keys", ""))))
		switch w[1] {
		case "lookup":
			f.send(wire.Lookup{ReqID: req, Round: round, Keys: keys})
		case "fetch":
			var slots []uint32
			for _, v := range list(c.Val("slots", "")) {
				n, err := strconv.ParseUint(v, 10, 32)
				if err != nil {
					t.Fatalf("%s: slot %q", c.Pos, v)
				}
				slots = append(slots, uint32(n))
			}
			f.send(wire.Fetch{ReqID: req, Round: round, Keys: keys, Slots: slots})
		case "abort":
			f.send(wire.AbortFetch{ReqID: req, Round: round})
		case "transfer_done":
			f.send(wire.TransferDone{ReqID: req, Round: round, OK: c.Val("ok", "false") == "true"})
			synctest.Wait()
		case "ping", "pong":
			seq, err := strconv.ParseUint(c.Val("seq", "1"), 10, 64)
			if err != nil {
				t.Fatalf("%s: seq: %v", c.Pos, err)
			}
			if w[1] == "ping" {
				f.send(wire.Ping{Seq: seq})
			} else {
				f.send(wire.Pong{Seq: seq})
			}
			synctest.Wait()
		case "lookup_resp": // any answer, asked for or not (reply answers the last lookup)
			var hits []bool
			for _, h := range list(c.Val("hits", "")) {
				hits = append(hits, h == "1")
			}
			f.send(wire.LookupResp{ReqID: req, Round: round, Keys: keys, Hits: hits})
			synctest.Wait()
		case "disconnect":
			code := -1
			for i := range wire.NumCodes {
				if i.String() == c.Val("code", "") {
					code = int(i)
				}
			}
			if code < 0 {
				t.Fatalf("%s: no code %q", c.Pos, c.Val("code", ""))
			}
			f.send(wire.Disconnect{Code: wire.Code(code)})
		default:
			t.Fatalf("%s: cannot send %q", c.Pos, w[1])
		}
	case "recv":
		m := s.fake(t, c, w[0]).next()
		if m == nil {
			return "closed"
		}
		switch m.(type) {
		case wire.Lookup, wire.AbortFetch:
			s.last[w[0]] = m
		}
		return s.format(m)
	case "consumer":
		var edit func(*Config)
		if v, ok := c.Lookup("lookup_hold"); ok {
			d, err := time.ParseDuration(v)
			if err != nil {
				t.Fatalf("%s: lookup_hold: %v", c.Pos, err)
			}
			edit = func(cfg *Config) { cfg.LookupHold = offload.Duration(d) }
		}
		n := newNode(t, s.mn, edit, 16)
		s.nodes[w[0]] = n
		l, err := s.mn.Listen(w[1] + ":1")
		if err != nil {
			t.Fatal(err)
		}
		s.req = &offload.Request{ID: "r", TransferParams: source("kv", w[1]+":1")}
		n.m.Do(func(st *offload.Step) { st.OnNewRequest(s.req) })
		s.fakes[w[1]] = acceptFake(t, l, w[1])
	case "lookup":
		var out []string
		for i, r := range step(s.node(t, c, w[0]), s.req, s.keysOf(t, c, w[1:])) {
			out = append(out, w[1+i]+" "+r.String())
		}
		synctest.Wait()
		return strings.Join(out, "\n")
	case "reply":
		lk, ok := s.last[w[0]].(wire.Lookup)
		if !ok {
			t.Fatalf("%s: %s received no lookup to answer", c.Pos, w[0])
		}
		var hits []bool
		for _, h := range list(c.Val("hits", "")) {
			hits = append(hits, h == "1")
		}
		s.fake(t, c, w[0]).send(wire.LookupResp{ReqID: lk.ReqID, Round: lk.Round, Keys: lk.Keys, Hits: hits})
		synctest.Wait()
	case "ack":
		a, ok := s.last[w[0]].(wire.AbortFetch)
		if !ok {
			t.Fatalf("%s: %s received no abort to acknowledge", c.Pos, w[0])
		}
		s.fake(t, c, w[0]).send(wire.AbortAck{ReqID: a.ReqID, Round: a.Round})
		synctest.Wait()
	case "finish":
		s.node(t, c, w[0]).m.Do(func(st *offload.Step) { st.OnRequestFinished(s.req) })
	case "cpu":
		m := s.node(t, c, w[0]).m.Metrics()
		return fmt.Sprintf("writing %d, promotion failures %d", m.CPU.Writing, m.Tiers[1].PromotionFailures)
	case "idle":
		synctest.Wait()
		if f := s.fake(t, c, w[0]); !f.idle() {
			return "not idle: " + s.format(f.next())
		}
		return "idle"
	case "blocks":
		n, _ := strconv.Atoi(c.Val("n", "1"))
		f, l := s.fake(t, c, w[0]), s.data[w[0]]
		if l == nil {
			t.Fatalf("%s: %s has no data port (listen)", c.Pos, w[0])
		}
		var size int
		for _, nd := range s.nodes {
			size = nd.m.BlockBytes()
		}
		got := readBlocks(t, f, l, n, size)
		var out []string
		for slot, b := range got {
			what := "unknown bytes"
			for i, k := range s.keys {
				if string(b) == string(blockOf(k, size)) {
					what = fmt.Sprintf("k%d", i+1)
				}
			}
			out = append(out, fmt.Sprintf("slot %d: %s", slot, what))
		}
		slices.Sort(out)
		return strings.Join(out, "\n")
	case "sleep":
		d, err := time.ParseDuration(w[0])
		if err != nil {
			t.Fatalf("%s: %v", c.Pos, err)
		}
		time.Sleep(d)
		synctest.Wait()
	case "wait":
		synctest.Wait()
	case "sessions":
		n := s.node(t, c, w[0])
		var out string
		n.m.Do(func(*offload.Step) {
			out = fmt.Sprintf("sessions %d, consumers %d", len(n.tier.sessions), len(n.tier.consOf))
		})
		return out
	case "complete":
		n := s.node(t, c, w[0])
		n.m.Do(func(st *offload.Step) { st.CompleteStore(s.keysOf(t, c, w[1:]), &offload.Request{ID: "w"}, true) })
		synctest.Wait()
	case "reset":
		n := s.node(t, c, w[0])
		s.reset = make(chan error, 1)
		go func() { s.reset <- n.m.ResetCache(context.Background()) }()
		synctest.Wait()
	case "reset-done":
		if err := <-s.reset; err != nil {
			return "reset: " + err.Error()
		}
		synctest.Wait()
		return "reset done"
	case "close":
		s.fake(t, c, w[0]).c.Close()
		synctest.Wait()
	case "mute":
		f := s.fake(t, c, w[0])
		f.mu.Lock()
		f.Mute = true
		f.mu.Unlock()
	case "pings":
		return strconv.Itoa(s.fake(t, c, w[0]).Pings())
	case "progress":
		n := s.node(t, c, w[0])
		if len(n.m.Progress()) == 0 {
			return "no progress"
		}
		for len(n.m.Progress()) > 0 {
			<-n.m.Progress()
		}
		return "progress"
	case "probes":
		n := s.node(t, c, w[0])
		var out string
		n.m.Do(func(*offload.Step) {
			asked, tracked := n.tier.creqOf(s.req).Probes()
			out = fmt.Sprintf("asked %d, tracked %d, busy %v", asked, tracked, n.tier.creqOf(s.req).Consumer().Busy())
		})
		return out
	case "pins":
		return strconv.Itoa(pins(s.node(t, c, w[0])))
	case "stat":
		return fmt.Sprint(stat(s.node(t, c, w[0]), w[1]))
	case "errors":
		return fmt.Sprint(s.node(t, c, w[0]).m.Metrics().Errors[w[1]])
	case "time":
		return time.Since(s.start).String()
	default:
		t.Fatalf("%s: unknown command %q", c.Pos, c.Name)
	}
	return ""
}

func list(v string) []string {
	if v == "" {
		return nil
	}
	return strings.Split(v, ",")
}

// format prints a message the node sent, keys by name.
func (s *protoScenario) format(m wire.Msg) string {
	switch m := m.(type) {
	case wire.LookupResp:
		var hits []string
		for i, k := range m.Keys {
			h := "miss"
			if m.Hits[i] {
				h = "hit"
			}
			hits = append(hits, s.keyName(k)+":"+h)
		}
		return fmt.Sprintf("lookup_resp req=%s round=%d %s", m.ReqID, m.Round, strings.Join(hits, " "))
	case wire.TransferDone:
		return fmt.Sprintf("transfer_done req=%s round=%d ok=%v", m.ReqID, m.Round, m.OK)
	case wire.AbortAck:
		return fmt.Sprintf("abort_ack req=%s round=%d", m.ReqID, m.Round)
	case wire.Disconnect:
		return fmt.Sprintf("disconnect code=%s reason=%q", m.Code, m.Reason)
	case wire.Lookup:
		return fmt.Sprintf("lookup req=%s round=%d keys=%s", m.ReqID, m.Round, s.keyNames(m.Keys))
	case wire.Fetch:
		var slots []string
		for _, sl := range m.Slots {
			slots = append(slots, strconv.Itoa(int(sl)))
		}
		return fmt.Sprintf("fetch req=%s round=%d keys=%s slots=%s", m.ReqID, m.Round, s.keyNames(m.Keys), strings.Join(slots, ","))
	case wire.AbortFetch:
		return fmt.Sprintf("abort_fetch req=%s round=%d", m.ReqID, m.Round)
	}
	return fmt.Sprintf("%s %+v", m.Type(), m)
}

func (s *protoScenario) keyNames(ks []wire.Key) string {
	var out []string
	for _, k := range ks {
		out = append(out, s.keyName(k))
	}
	return strings.Join(out, ",")
}

func (s *protoScenario) keyName(k wire.Key) string {
	for i, x := range s.keys {
		if x == k {
			return fmt.Sprintf("k%d", i+1)
		}
	}
	return "?"
}

func (s *protoScenario) node(t *testing.T, c *script.Cmd, name string) *node {
	n, ok := s.nodes[name]
	if !ok {
		t.Fatalf("%s: no node %q", c.Pos, name)
	}
	return n
}

func (s *protoScenario) fake(t *testing.T, c *script.Cmd, name string) *fakePeer {
	f, ok := s.fakes[name]
	if !ok {
		t.Fatalf("%s: no fake peer %q", c.Pos, name)
	}
	return f
}

func (s *protoScenario) keysOf(t *testing.T, c *script.Cmd, names []string) []offload.Key {
	var out []offload.Key
	for _, n := range names {
		i, err := strconv.Atoi(strings.TrimPrefix(n, "k"))
		if err != nil || !strings.HasPrefix(n, "k") || i < 1 || i > len(s.keys) {
			t.Fatalf("%s: bad key %q", c.Pos, n)
		}
		out = append(out, s.keys[i-1])
	}
	return out
}
