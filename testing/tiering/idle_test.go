package tiering

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

// Timing tests run under testing/synctest: time is fake and advances only
// when every goroutine of the bubble is durably blocked, so nothing sleeps
// for real and nothing is flaky.

func polledTier() *fake.Tier {
	t := fake.NewTier(offload.ChunkLevel)
	t.SetPolled(true)
	return t
}

func withPoll(d time.Duration) func(*offload.Config) {
	return func(c *offload.Config) { c.TierPollInterval = offload.Duration(d) }
}

// logBuffer collects a manager's logs.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Count(l.buf.String(), s)
}

func drainProgress(m *offload.Manager) {
	select {
	case <-m.Progress():
	default:
	}
}

func progressed(m *offload.Manager) bool {
	select {
	case <-m.Progress():
		return true
	default:
		return false
	}
}

// S3.1, S3.5, S2.10: a polled tier's completion is applied by the poll
// goroutine as soon as the tier wakes it — no engine step — and signals
// progress.
func TestPollAppliesCompletions(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tier := polledTier()
		h := newHarness(t, 4, nil, tier)
		k := keys(1, 1)[0]
		tier.Put(k, h.block(k))
		tier.Hold(true)
		req := h.newRequest("r")
		h.lookups(req, []offload.Key{k})
		drainProgress(h.m)
		tier.Release(tier.Held()[0], true) // from the test goroutine, like a worker
		synctest.Wait()
		if n := h.m.Metrics().Tiers[1].ActivePromotions; n != 0 {
			t.Errorf("%d promotions still active without a step", n)
		}
		if !progressed(h.m) {
			t.Error("no progress signal after the poll goroutine applied a completion")
		}
		if r := h.lookups(req, []offload.Key{k}); r[0] != offload.Hit {
			t.Errorf("lookup after the completion = %v, want hit", r[0])
		}
	})
}

// S3.1: while a polled tier has pending work the goroutine services it
// every tier_poll_interval; once idle it blocks with no timer: an hour of
// (fake) time passes without a single service.
func TestPollIdleMakesNoWakeups(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tier := polledTier()
		h := newHarness(t, 4, withPoll(time.Millisecond), tier)
		k := keys(1, 1)[0]
		tier.Put(k, h.block(k))
		tier.Hold(true)
		h.lookups(h.newRequest("r"), []offload.Key{k}) // a held promotion: pending work
		tier.Answer(k, offload.Miss)
		before := tier.Calls().Serves
		time.Sleep(10*time.Millisecond + time.Microsecond)
		synctest.Wait()
		if got := tier.Calls().Serves - before; got < 9 || got > 11 {
			t.Errorf("%d services in 10 intervals with pending work, want 10", got)
		}
		tier.Release(tier.Held()[0], true)
		synctest.Wait()
		idle := tier.Calls().Serves
		time.Sleep(time.Hour)
		synctest.Wait()
		if got := tier.Calls().Serves - idle; got != 0 {
			t.Errorf("an idle manager serviced its tier %d times in an hour, want 0", got)
		}
		if got := h.m.Metrics().Poll; got != "running" {
			t.Errorf("poll state %q, want running", got)
		}
	})
}

// S2.2: a peer's lookup served by the poll goroutine while the engine
// idles promotes from a secondary tier; the promotion is submitted at the
// end of that poll pass.
func TestPollPassSubmitsPromotions(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		peer, disk := polledTier(), polledTier()
		h := newHarness(t, 4, nil, peer, disk)
		k := keys(1, 1)[0]
		disk.Put(k, h.block(k))
		remote := &offload.Request{ID: "peer:1"}
		var got offload.Result
		peer.OnServe(func(p offload.Parent) error {
			peer.OnServe(nil)
			p.OnNewRequest(remote)
			got = p.Lookup(k, remote)
			return nil
		})
		wakeTier(peer) // a peer's lookup arrived; the engine idles
		synctest.Wait()
		if got != offload.HitPending {
			t.Fatalf("peer lookup = %v, want hit_pending", got)
		}
		if n := len(disk.Calls().Loads); n != 1 {
			t.Errorf("%d promotions submitted by the poll pass, want 1", n)
		}
	})
}

// wakeTier makes a fake tier call its Wake, as a socket reader would when
// a message arrives.
func wakeTier(tier *fake.Tier) { tier.Wake() }

// S3.2, S3.6: with tier_poll_interval ≤ 0 there is no poll goroutine; a
// polled tier is serviced only by engine steps, and HasPendingWork keeps
// the engine stepping for a tier that serves peers.
func TestNoPollGoroutine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tier := polledTier()
		tier.OnServe(func(offload.Parent) error { return nil })
		h := newHarness(t, 4, withPoll(0), tier)
		wakeTier(tier)
		time.Sleep(time.Second)
		synctest.Wait()
		if n := tier.Calls().Serves; n != 0 {
			t.Errorf("served %d times without a poll goroutine or a step", n)
		}
		h.step(func(s *offload.Step) {})
		if n := tier.Calls().Serves; n != 1 {
			t.Errorf("served %d times after one step, want 1", n)
		}
		if !h.m.HasPendingWork() {
			t.Error("HasPendingWork false for a peer-serving tier with no poll goroutine")
		}
		if got := h.m.Metrics().Poll; got != "disabled" {
			t.Errorf("poll state %q, want disabled", got)
		}
	})
}

// S3.3: the poll goroutine survives a tier that keeps failing or panics:
// it backs off to max(interval, 1 s), logs the first error at once, then at
// most one summary per 30 s, logs recovery, and counts it all.
func TestPollSurvivesFailures(t *testing.T) {
	for _, mode := range []string{"error", "panic"} {
		t.Run(mode, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var logs logBuffer
				tier := polledTier()
				failing := true
				var mu sync.Mutex
				tier.OnServe(func(offload.Parent) error {
					mu.Lock()
					defer mu.Unlock()
					if !failing {
						return nil
					}
					if mode == "panic" {
						panic("tier bug")
					}
					return errors.New("socket broke")
				})
				h := newHarness(t, 4, func(c *offload.Config) {
					c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
				}, tier)
				wakeTier(tier)
				synctest.Wait()
				time.Sleep(65 * time.Second)
				synctest.Wait()
				serves := tier.Calls().Serves
				if serves < 60 || serves > 67 {
					t.Errorf("%d attempts in 65 s of failures, want about 66 (one a second)", serves)
				}
				if n := logs.count("tier servicing failed"); n != 1 {
					t.Errorf("first failure logged %d times, want 1", n)
				}
				if n := logs.count("still failing"); n != 2 {
					t.Errorf("%d summaries in 65 s, want 2 (one per 30 s)", n)
				}
				mu.Lock()
				failing = false
				mu.Unlock()
				time.Sleep(time.Second)
				synctest.Wait()
				if n := logs.count("recovered"); n != 1 {
					t.Errorf("recovery logged %d times, want 1", n)
				}
				m := h.m.Metrics()
				if m.PollErrors < 60 || m.PollBackoffs != m.PollErrors || m.Poll != "running" {
					t.Errorf("poll errors %d, backoffs %d, state %s", m.PollErrors, m.PollBackoffs, m.Poll)
				}
				after := tier.Calls().Serves
				time.Sleep(time.Minute)
				synctest.Wait()
				if tier.Calls().Serves != after {
					t.Error("the goroutine kept polling after recovering with nothing pending")
				}
			})
		})
	}
}

// S3.4: HasPendingWork reports only work that needs an engine step.
func TestHasPendingWork(t *testing.T) {
	tests := []struct {
		name  string
		poll  time.Duration
		tiers func() []*fake.Tier
		setup func(t *testing.T, h *harness)
		want  bool
	}{
		{name: "idle", poll: time.Millisecond, tiers: func() []*fake.Tier { return []*fake.Tier{polledTier()} }, want: false},
		{name: "polled tier pending while the goroutine lives", poll: time.Millisecond,
			tiers: func() []*fake.Tier { return []*fake.Tier{polledTier()} },
			setup: heldPromotion, want: false},
		{name: "polled tier pending without a goroutine", poll: 0,
			tiers: func() []*fake.Tier { return []*fake.Tier{polledTier()} },
			setup: heldPromotion, want: true},
		{name: "job of a tier that is not polled", poll: time.Millisecond,
			tiers: func() []*fake.Tier { return []*fake.Tier{fake.NewTier(offload.ChunkLevel)} },
			setup: heldPromotion, want: true},
		{name: "parked cascade", poll: time.Millisecond,
			tiers: func() []*fake.Tier {
				tt := fake.NewTier(offload.RequestLevel)
				tt.SetPolled(true)
				return []*fake.Tier{tt}
			},
			setup: func(t *testing.T, h *harness) {
				k := keys(5, 1)
				w, r := h.newRequest("w"), h.newRequest("r")
				h.m.Do(func(s *offload.Step) {
					s.PrepareStore(k, w)
					s.PrepareStore(k, r)
				})
			}, want: true},
		{name: "two tiers, one not polled (keep-alive)", poll: time.Millisecond,
			tiers: func() []*fake.Tier { return []*fake.Tier{polledTier(), fake.NewTier(offload.ChunkLevel)} }, want: true},
		{name: "two polled tiers", poll: time.Millisecond,
			tiers: func() []*fake.Tier { return []*fake.Tier{polledTier(), polledTier()} }, want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				h := newHarness(t, 4, withPoll(tt.poll), tt.tiers()...)
				if tt.setup != nil {
					tt.setup(t, h)
				}
				synctest.Wait()
				if got := h.m.HasPendingWork(); got != tt.want {
					t.Errorf("HasPendingWork = %v, want %v", got, tt.want)
				}
			})
		})
	}
}

// heldPromotion leaves one promotion held by the first tier.
func heldPromotion(t *testing.T, h *harness) {
	k := keys(9, 1)[0]
	h.tiers[0].Put(k, h.block(k))
	h.tiers[0].Hold(true)
	h.lookups(h.newRequest("r"), []offload.Key{k})
	if len(h.tiers[0].Held()) != 1 {
		t.Fatal("no held promotion")
	}
}

// S3.4, S3.5: a polled tier holding a HIT pin for a peer's fetch leaves the
// engine idle; when the fetch completes, the poll goroutine releases the
// pin and empties the job table with no engine step.
func TestPeerPinKeepsEngineIdle(t *testing.T) {
	for _, poll := range []time.Duration{time.Millisecond, 0} {
		t.Run(time.Duration(poll).String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				peer := polledTier()
				h := newHarness(t, 4, withPoll(poll), peer)
				k := keys(1, 1)
				w := h.newRequest("w")
				h.m.Do(func(s *offload.Step) { h.store(s, w, k) })
				h.step(func(s *offload.Step) {})
				peer.Hold(true)
				var job *offload.Job
				peer.OnServe(func(p offload.Parent) error {
					peer.OnServe(nil)
					remote := &offload.Request{ID: "peer:1"}
					p.OnNewRequest(remote)
					if p.Lookup(k[0], remote) == offload.Hit {
						job, _ = p.Lease(k, remote)
						peer.Run(job)
					}
					p.OnRequestFinished(remote)
					return nil
				})
				if poll > 0 {
					wakeTier(peer)
					synctest.Wait()
				} else {
					h.step(func(s *offload.Step) {})
				}
				if job == nil {
					t.Fatal("no HIT pin created for the peer")
				}
				if got, want := h.m.HasPendingWork(), poll <= 0; got != want {
					t.Errorf("HasPendingWork with a peer pin held = %v, want %v", got, want)
				}
				peer.Release(job.ID, true) // the fetch completed
				synctest.Wait()
				if poll > 0 {
					if p, tm := h.m.Audit(0), h.m.Metrics().Tiers[1]; len(p) != 0 || tm.ActiveLeases+tm.ActiveCascades != 0 {
						t.Errorf("without a step: pins %v, active leases %d, cascades %d; want none", p, tm.ActiveLeases, tm.ActiveCascades)
					}
				}
			})
		})
	}
}

// S4.1, S4.4, S2.10: a write that never completes answers HitPending until
// hit_pending_timeout, then a stable Miss; the expiry wakes a sleeping
// engine and is counted.
func TestHitPendingDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, 4, nil)
		k := keys(1, 1)
		w := h.newRequest("writer")
		h.m.Do(func(s *offload.Step) { s.PrepareStore(k, w) }) // stalls forever
		req := h.newRequest("r")
		start := time.Now()
		if r := h.lookups(req, k); r[0] != offload.HitPending {
			t.Fatalf("lookup = %v, want hit_pending", r[0])
		}
		drainProgress(h.m)
		<-h.m.Progress() // the engine sleeps until the deadline wakes it
		if waited := time.Since(start); waited != 5*time.Second {
			t.Errorf("woken after %v, want 5s", waited)
		}
		if r := h.lookups(req, k); r[0] != offload.Miss {
			t.Errorf("lookup after the deadline = %v, want miss", r[0])
		}
		h.m.Do(func(s *offload.Step) { s.CompleteStore(k, w, true) })
		if r := h.lookups(req, k); r[0] != offload.Miss {
			t.Errorf("lookup after the write finally completed = %v, want a stable miss", r[0])
		}
		if r := h.lookups(h.newRequest("other"), k); r[0] != offload.Hit {
			t.Errorf("another request = %v, want hit", r[0])
		}
		if n := h.m.Metrics().HitPendingTimeouts; n != 1 {
			t.Errorf("timeouts counted %d, want 1", n)
		}
	})
}

// S4.1, S4.2: a promotion that keeps failing and being retried gets no
// fresh window: Miss at the original deadline, and no promotion after it.
func TestHitPendingNotRefreshed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tier := polledTier()
		h := newHarness(t, 4, nil, tier)
		k := keys(1, 1)
		tier.Put(k[0], h.block(k[0]))
		tier.Hold(true)
		req := h.newRequest("r")
		start := time.Now()
		for {
			r := h.lookups(req, k)[0]
			if r == offload.Miss {
				break
			}
			if r != offload.HitPending {
				t.Fatalf("lookup = %v", r)
			}
			time.Sleep(time.Second)
			for _, id := range tier.Held() {
				tier.Release(id, false) // the promotion round fails
			}
			synctest.Wait()
		}
		if got := time.Since(start); got != 5*time.Second {
			t.Errorf("miss after %v, want the original 5s deadline", got)
		}
		loads := len(tier.Calls().Loads)
		if loads < 4 {
			t.Errorf("only %d promotion rounds", loads)
		}
		time.Sleep(time.Second)
		h.lookups(req, k)
		if n := len(tier.Calls().Loads); n != loads {
			t.Errorf("a promotion started after the deadline")
		}
	})
}

// S4.3, S4.5: deadlines are cleared when the lookup resolves, when the request
// finishes or aborts (Abort is the request-level escape hatch), and on
// cache reset: none of these later expires.
func TestHitPendingCleared(t *testing.T) {
	cases := map[string]func(h *harness, req *offload.Request, k []offload.Key, w *offload.Request){
		"resolved": func(h *harness, req *offload.Request, k []offload.Key, w *offload.Request) {
			h.m.Do(func(s *offload.Step) { s.CompleteStore(k, w, true) })
			if r := h.lookups(req, k); r[0] != offload.Hit {
				h.t.Fatalf("lookup = %v", r[0])
			}
		},
		"finished": func(h *harness, req *offload.Request, _ []offload.Key, _ *offload.Request) {
			h.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
		},
		"aborted": func(h *harness, req *offload.Request, _ []offload.Key, _ *offload.Request) {
			h.m.Do(func(s *offload.Step) { s.Abort(req) })
		},
		"reset": func(h *harness, _ *offload.Request, _ []offload.Key, _ *offload.Request) {
			h.m.ResetCache(context.Background())
		},
	}
	for name, clear := range cases {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				h := newHarness(t, 4, nil)
				k := keys(1, 1)
				w := h.newRequest("writer")
				h.m.Do(func(s *offload.Step) { s.PrepareStore(k, w) })
				req := h.newRequest("r")
				h.lookups(req, k)
				time.Sleep(time.Second)
				clear(h, req, k, w)
				time.Sleep(time.Minute)
				synctest.Wait()
				if n := h.m.Metrics().HitPendingTimeouts; n != 0 {
					t.Errorf("%d timeouts after the deadline was cleared", n)
				}
			})
		})
	}
}

// S5.1, S2.8: a reset refuses new work at once, releases peer pins, waits
// for transfers in flight (they complete, never aborted; a warning after
// 5 s), then empties the CPU tier and emits one "cleared" event with the
// new epoch.
func TestResetCache(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var logs logBuffer
		tier := polledTier()
		h := newHarness(t, 8, func(c *offload.Config) { c.Logger = slog.New(slog.NewTextHandler(&logs, nil)) }, tier)
		ks := keys(1, 3)
		w := h.newRequest("w")
		tier.Hold(true)
		h.m.Do(func(s *offload.Step) { h.store(s, w, ks[:2]) }) // a held cascade
		cascade := tier.Held()[0]
		var peerJob *offload.Job
		tier.OnServe(func(p offload.Parent) error { // a peer's pin
			tier.OnServe(nil)
			remote := &offload.Request{ID: "peer"}
			p.OnNewRequest(remote)
			peerJob, _ = p.Lease(ks[:1], remote)
			tier.Run(peerJob)
			return nil
		})
		h.step(func(s *offload.Step) {})
		sub := h.m.Subscribe(0)
		defer sub.Close()
		done := make(chan error)
		go func() { done <- h.m.ResetCache(context.Background()) }()
		synctest.Wait()
		if tier.Calls().Resets != 1 {
			t.Error("tier not told the reset started")
		}
		h.m.Do(func(s *offload.Step) {
			if r := s.Lookup(ks[0], w); r != offload.Miss {
				t.Errorf("lookup during the reset = %v, want miss", r)
			}
			if plan, _ := s.PrepareStore(ks[2:], w); plan != nil {
				t.Error("a store started during the reset")
			}
		})
		time.Sleep(6 * time.Second)
		synctest.Wait()
		select {
		case <-done:
			t.Fatal("reset returned with a cascade in flight")
		default:
		}
		if logs.count("still waiting") != 1 {
			t.Error("no warning after 5 s of waiting")
		}
		tier.Release(cascade, true)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if !tier.Has(ks[0]) || !tier.Has(ks[1]) {
			t.Error("the in-flight cascade did not complete")
		}
		// S2.8: one "cleared" with the new epoch, no removal per key.
		if diff := cmp.Diff([]offload.Event{{Seq: 1, Kind: offload.EventCleared, Tier: "cpu", Epoch: 1}}, sub.Take()); diff != "" {
			t.Errorf("events of the reset (-want +got):\n%s", diff)
		}
		m := h.m.Metrics()
		if m.CPU.Used != 0 || m.Resets != 1 || len(h.m.Audit(0)) != 0 {
			t.Errorf("after the reset: used %d, resets %d, pins %v", m.CPU.Used, m.Resets, h.m.Audit(0))
		}
		// The secondary tier kept its data: the blocks promote again.
		if r := h.lookups(w, ks[:2]); r[0] != offload.HitPending || r[1] != offload.HitPending {
			t.Errorf("after the reset: %v, want promotions from the tier", r)
		}
	})
}

// S5.1: when the wait is cut short, a completion from before the reset
// never makes a block readable, and its slot is not reused until it ends.
func TestResetLateCompletion(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tier := polledTier()
		h := newHarness(t, 1, nil, tier)
		k := keys(1, 1)
		tier.Put(k[0], h.block(k[0]))
		tier.Hold(true)
		req := h.newRequest("r")
		h.lookups(req, k) // a promotion writing into the only slot
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if err := h.m.ResetCache(ctx); err != nil {
			t.Fatal(err)
		}
		if got := h.m.Metrics().CPU.Detached; got != 1 {
			t.Errorf("detached slots %d, want 1", got)
		}
		other := keys(2, 1)
		h.m.Do(func(s *offload.Step) {
			if plan, _ := s.PrepareStore(other, req); plan != nil {
				t.Error("the slot of an in-flight promotion was reused")
			}
		})
		tier.ClearAnswer(k[0])
		tier.Answer(k[0], offload.Miss)
		tier.Release(tier.Held()[0], true) // the late completion
		synctest.Wait()
		h.step(func(s *offload.Step) {})
		if r := h.lookups(h.newRequest("x"), k); r[0] != offload.Miss {
			t.Errorf("late completion made the block %v, want miss", r[0])
		}
		if got := h.m.Metrics().CPU.Detached; got != 0 {
			t.Errorf("detached slots %d after the transfer ended, want 0", got)
		}
		h.m.Do(func(s *offload.Step) { h.store(s, req, other) })
	})
}
