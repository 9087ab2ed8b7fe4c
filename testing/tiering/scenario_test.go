package tiering

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/offload/script"
	"github.com/kvtier/kvtier/testing/fake"
)

// TestScenarios runs the scripts of testdata/ (package script), each in
// a synctest bubble: time is fake, so "sleep 5s" takes no real time and a
// deadline fires exactly when due. `go test -run TestScenarios -update`
// rewrites their expected outputs.
//
// Commands (keys are k1, k2, … of one chain; tiers t0, t1, … are fakes):
//
//	manager slots=N [poll=D] [tiers=N] [polled=t0,…] [hit_timeout=D]
//	request R | finish R | abort R
//	put T K… | answer T K… hit|miss|retry|hit_pending|clear | hold T on|off
//	release T [fail]          the tier ends its oldest held job
//	wake T | wakeat T D       the tier wakes the manager now, or asks for D from the start
//	lookup R K…               one step of lookups; prints each answer
//	load R K… | store R K…    a load of hits, a store of computed blocks (one Do)
//	step                      an empty engine step
//	sleep D                   advance the fake clock by D, then wait for the bubble
//	deadline                  when the manager's clock fires next (NextDeadline), from the start
//	progress                  whether progress was signalled since the last look (drains it)
//	await-progress            block until progress; prints the time from the start
//	metrics                   timeouts, requests, the tiers' active jobs
//	prom NAME                 the Prometheus lines of kv_offload_NAME…
//	calls T                   what the manager asked of tier T
//	reset                     ResetCache
func TestScenarios(t *testing.T) {
	script.RunDir(t, "testdata", func(*testing.T) func(*testing.T, *script.Cmd) string {
		s := &scenario{reqs: map[string]*offload.Request{}, start: time.Now()}
		return s.do
	})
}

type scenario struct {
	h     *harness
	tiers []*fake.Tier
	reqs  map[string]*offload.Request
	keys  []offload.Key
	start time.Time
}

func (s *scenario) do(t *testing.T, c *script.Cmd) string {
	t.Helper()
	if c.Name != "manager" && s.h == nil {
		t.Fatalf("%s: the first command must be manager", c.Pos)
	}
	words := c.Words()
	switch c.Name {
	case "manager":
		return s.manager(t, c)
	case "request":
		s.reqs[words[0]] = s.h.newRequest(words[0])
	case "finish":
		s.h.m.Do(func(st *offload.Step) { st.OnRequestFinished(s.req(t, c, words[0])) })
	case "abort":
		s.h.m.Do(func(st *offload.Step) { st.Abort(s.req(t, c, words[0])) })
	case "put":
		tier := s.tier(t, c, words[0])
		for _, k := range s.keysOf(t, c, words[1:]) {
			tier.Put(k, s.h.block(k))
		}
	case "answer":
		tier := s.tier(t, c, words[0])
		r := words[len(words)-1]
		for _, k := range s.keysOf(t, c, words[1:len(words)-1]) {
			if r == "clear" {
				tier.ClearAnswer(k)
			} else {
				tier.Answer(k, result(t, c, r))
			}
		}
	case "hold":
		s.tier(t, c, words[0]).Hold(words[1] == "on")
	case "release":
		tier := s.tier(t, c, words[0])
		held := tier.Held()
		if len(held) == 0 {
			t.Fatalf("%s: %s holds no job", c.Pos, words[0])
		}
		tier.Release(held[0], !c.Has("fail"))
		synctest.Wait()
	case "wake":
		s.tier(t, c, words[0]).Wake()
		synctest.Wait()
	case "wakeat":
		s.tier(t, c, words[0]).WakeAt(s.start.Add(duration(t, c, words[1])))
		synctest.Wait()
	case "lookup":
		req := s.req(t, c, words[0])
		ks := s.keysOf(t, c, words[1:])
		var out []string
		for i, r := range s.h.lookups(req, ks) {
			out = append(out, words[1+i]+" "+r.String())
		}
		return strings.Join(out, "\n")
	case "load":
		s.h.load(s.req(t, c, words[0]), s.keysOf(t, c, words[1:]))
	case "store":
		req, ks := s.req(t, c, words[0]), s.keysOf(t, c, words[1:])
		s.h.m.Do(func(st *offload.Step) { s.h.store(st, req, ks) })
		synctest.Wait()
	case "step":
		s.h.step(func(*offload.Step) {})
		synctest.Wait()
	case "sleep":
		time.Sleep(duration(t, c, words[0]))
		synctest.Wait()
	case "deadline":
		if d := s.h.m.NextDeadline(); !d.IsZero() {
			return "next deadline at " + d.Sub(s.start).String()
		}
		return "no deadline"
	case "progress":
		if progressed(s.h.m) {
			drainProgress(s.h.m)
			return "progress"
		}
		return "no progress"
	case "await-progress":
		<-s.h.m.Progress()
		return "progress at " + time.Since(s.start).String()
	case "metrics":
		return s.metrics()
	case "prom":
		var text strings.Builder
		if err := s.h.m.Metrics().WritePrometheus(&text); err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, l := range strings.Split(text.String(), "\n") {
			if strings.HasPrefix(l, "kv_offload_"+words[0]) {
				out = append(out, l)
			}
		}
		return strings.Join(out, "\n")
	case "calls":
		cl := s.tier(t, c, words[0]).Calls()
		return fmt.Sprintf("lookups %d, loads %d, stores %d, serves %d, resets %d", cl.Lookups, len(cl.Loads), len(cl.Stores), cl.Serves, cl.Resets)
	case "reset":
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := s.h.m.ResetCache(ctx); err != nil {
			return "reset: " + err.Error()
		}
	default:
		t.Fatalf("%s: unknown command %q", c.Pos, c.Name)
	}
	return ""
}

func (s *scenario) manager(t *testing.T, c *script.Cmd) string {
	slots, err := strconv.Atoi(c.Val("slots", "4"))
	if err != nil {
		t.Fatalf("%s: slots: %v", c.Pos, err)
	}
	n, err := strconv.Atoi(c.Val("tiers", "1"))
	if err != nil {
		t.Fatalf("%s: tiers: %v", c.Pos, err)
	}
	polled := strings.Split(c.Val("polled", ""), ",")
	for i := range n {
		tier := fake.NewTier(offload.ChunkLevel)
		tier.SetPolled(slices.Contains(polled, fmt.Sprintf("t%d", i)))
		s.tiers = append(s.tiers, tier)
	}
	s.h = newHarness(t, slots, func(cfg *offload.Config) {
		if v, ok := c.Lookup("poll"); ok {
			cfg.TierPollInterval = offload.Duration(duration(t, c, v))
		}
		if v, ok := c.Lookup("hit_timeout"); ok {
			cfg.HitPendingTimeout = offload.Duration(duration(t, c, v))
		}
	}, s.tiers...)
	s.keys = keys(1, 64)
	return ""
}

func (s *scenario) metrics() string {
	m := s.h.m.Metrics()
	out := []string{fmt.Sprintf("timeouts: hit_pending %d, retry %d; requests %d; poll %s", m.HitPendingTimeouts, m.RetryTimeouts, m.Requests, m.Poll)}
	for i, tm := range m.Tiers[1:] {
		out = append(out, fmt.Sprintf("t%d: promotions %d, cascades %d, leases %d", i, tm.ActivePromotions, tm.ActiveCascades, tm.ActiveLeases))
	}
	return strings.Join(out, "\n")
}

func (s *scenario) req(t *testing.T, c *script.Cmd, name string) *offload.Request {
	r, ok := s.reqs[name]
	if !ok {
		t.Fatalf("%s: no request %q", c.Pos, name)
	}
	return r
}

func (s *scenario) tier(t *testing.T, c *script.Cmd, name string) *fake.Tier {
	i, err := strconv.Atoi(strings.TrimPrefix(name, "t"))
	if err != nil || !strings.HasPrefix(name, "t") || i < 0 || i >= len(s.tiers) {
		t.Fatalf("%s: no tier %q", c.Pos, name)
	}
	return s.tiers[i]
}

func (s *scenario) keysOf(t *testing.T, c *script.Cmd, names []string) []offload.Key {
	var out []offload.Key
	for _, n := range names {
		i, err := strconv.Atoi(strings.TrimPrefix(n, "k"))
		if err != nil || !strings.HasPrefix(n, "k") || i < 1 || i > len(s.keys) {
			t.Fatalf("%s: bad key %q (want k1 … k%d)", c.Pos, n, len(s.keys))
		}
		out = append(out, s.keys[i-1])
	}
	return out
}

func result(t *testing.T, c *script.Cmd, name string) offload.Result {
	for _, r := range []offload.Result{offload.Miss, offload.Hit, offload.HitPending, offload.Retry} {
		if r.String() == name {
			return r
		}
	}
	t.Fatalf("%s: bad answer %q", c.Pos, name)
	return 0
}

func duration(t *testing.T, c *script.Cmd, s string) time.Duration {
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatalf("%s: %v", c.Pos, err)
	}
	return d
}
