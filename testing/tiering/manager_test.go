package tiering

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

// S2.1: the lookup table, one case per way an answer is reached.
func TestLookup(t *testing.T) {
	ks := keys(1, 3)
	tests := []struct {
		name  string
		slots int
		setup func(h *harness)
		want  offload.Result
		// asked is how many lookups each fake tier saw.
		asked []int
	}{
		{name: "cpu ready is a hit", slots: 4, setup: func(h *harness) {
			req := h.newRequest("w")
			h.m.Do(func(s *offload.Step) { h.store(s, req, ks[:1]) })
		}, want: offload.Hit, asked: []int{0, 0}},
		{name: "cpu writing is hit_pending", slots: 4, setup: func(h *harness) {
			req := h.newRequest("w")
			h.m.Do(func(s *offload.Step) { s.PrepareStore(ks[:1], req) })
		}, want: offload.HitPending, asked: []int{0, 0}},
		{name: "secondary hit promotes", slots: 4, setup: func(h *harness) {
			h.tiers[1].Put(ks[0], h.block(ks[0]))
		}, want: offload.HitPending, asked: []int{1, 1}},
		{name: "first secondary hit ends the walk", slots: 4, setup: func(h *harness) {
			h.tiers[0].Put(ks[0], h.block(ks[0]))
			h.tiers[1].Put(ks[0], h.block(ks[0]))
		}, want: offload.HitPending, asked: []int{1, 0}},
		{name: "retry then hit in a later tier promotes", slots: 4, setup: func(h *harness) {
			h.tiers[0].Answer(ks[0], offload.Retry)
			h.tiers[1].Put(ks[0], h.block(ks[0]))
		}, want: offload.HitPending, asked: []int{1, 1}},
		{name: "retry anywhere without a hit is retry", slots: 4, setup: func(h *harness) {
			h.tiers[1].Answer(ks[0], offload.Retry)
		}, want: offload.Retry, asked: []int{1, 1}},
		{name: "nobody has it", slots: 4, want: offload.Miss, asked: []int{1, 1}},
		{name: "hit with no slot to evict is a miss and later tiers are not asked", slots: 1, setup: func(h *harness) {
			req := h.newRequest("w")
			h.m.Do(func(s *offload.Step) { s.PrepareStore(ks[1:2], req) }) // the only slot is writing
			h.tiers[0].Put(ks[0], h.block(ks[0]))
			h.tiers[1].Put(ks[0], h.block(ks[0]))
		}, want: offload.Miss, asked: []int{1, 0}},
		{name: "a tier answering hit_pending is treated as retry", slots: 4, setup: func(h *harness) {
			h.tiers[0].Answer(ks[0], offload.HitPending)
		}, want: offload.Retry, asked: []int{1, 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, tt.slots, nil, fake.NewTier(offload.ChunkLevel), fake.NewTier(offload.ChunkLevel))
			if tt.setup != nil {
				tt.setup(h)
			}
			before := []int{h.tiers[0].Calls().Lookups, h.tiers[1].Calls().Lookups}
			got := h.lookups(h.newRequest("r"), ks[:1])[0]
			if got != tt.want {
				t.Errorf("Lookup = %v, want %v", got, tt.want)
			}
			asked := []int{h.tiers[0].Calls().Lookups - before[0], h.tiers[1].Calls().Lookups - before[1]}
			if diff := cmp.Diff(tt.asked, asked); diff != "" {
				t.Errorf("tier lookups (-want +got):\n%s", diff)
			}
		})
	}
}

// S2.1, S2.2: a promotion lands at the end of the step and the key is then
// a hit with the tier's bytes; the load source names the tier.
func TestPromotionLands(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, nil, tier)
	ks := keys(1, 2)
	for _, k := range ks {
		tier.Put(k, h.block(k))
	}
	req := h.newRequest("r")
	if diff := cmp.Diff(repeat(offload.HitPending, 2), h.lookups(req, ks)); diff != "" {
		t.Fatalf("first lookups (-want +got):\n%s", diff)
	}
	if n := len(tier.Calls().Loads); n != 1 {
		t.Fatalf("%d load jobs after the step, want 1", n)
	}
	if diff := cmp.Diff(repeat(offload.Hit, 2), h.lookups(req, ks)); diff != "" {
		t.Fatalf("lookups after the promotion (-want +got):\n%s", diff)
	}
	h.load(req, ks)
	h.m.Do(func(s *offload.Step) {
		if got := s.LoadSource(ks[0], req); got != "t0" {
			t.Errorf("LoadSource = %q, want t0", got)
		}
	})
	if got := h.m.Metrics().Tiers[1].ReadBytes; got != uint64(2*h.m.BlockBytes()) {
		t.Errorf("tier read bytes = %d, want %d", got, 2*h.m.BlockBytes())
	}
}

// S2.2: exactly one load job per (tier, request) per step, none before the
// step ends, and a key reserved by one request is hit_pending for another
// without a second promotion.
func TestPromotionBatching(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 8, nil, tier)
	a, b := keys(1, 2), keys(2, 2)
	for _, k := range append(slices.Clone(a), b...) {
		tier.Put(k, h.block(k))
	}
	ra, rb, rc := h.newRequest("a"), h.newRequest("b"), h.newRequest("c")
	s := h.m.Begin()
	var got []offload.Result
	for _, k := range a {
		got = append(got, s.Lookup(k, ra))
	}
	for _, k := range b {
		got = append(got, s.Lookup(k, rb))
	}
	got = append(got, s.Lookup(a[0], rc)) // reserved by a: no second promotion
	if n := len(tier.Calls().Loads); n != 0 {
		t.Errorf("%d loads submitted during lookups, want 0", n)
	}
	s.OnScheduleEnd()
	if diff := cmp.Diff(repeat(offload.HitPending, 5), got); diff != "" {
		t.Errorf("answers (-want +got):\n%s", diff)
	}
	loads := tier.Calls().Loads
	if len(loads) != 2 {
		t.Fatalf("%d load jobs, want 2", len(loads))
	}
	if loads[0].Req != ra || loads[1].Req != rb {
		t.Errorf("load jobs are for %s, %s; want a, b in that order with the callers' request objects", loads[0].Req.ID, loads[1].Req.ID)
	}
	if diff := cmp.Diff([][]offload.Key{a, b}, [][]offload.Key{loads[0].Keys, loads[1].Keys}); diff != "" {
		t.Errorf("job keys (-want +got):\n%s", diff)
	}
}

// S2.2: promotions queued by a Do call (outside a step) are submitted when
// it returns.
func TestPromotionFromDo(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, nil, tier)
	k := keys(1, 1)[0]
	tier.Put(k, h.block(k))
	h.m.Do(func(s *offload.Step) { s.Lookup(k, h.newRequestIn(s, "r")) })
	if n := len(tier.Calls().Loads); n != 1 {
		t.Errorf("%d loads after Do, want 1", n)
	}
}

// S2.1: promotion failures: total failure frees the slots (miss), partial
// success keeps exactly the keys that arrived.
func TestPromotionFailure(t *testing.T) {
	ks := keys(1, 3)
	tests := []struct {
		name    string
		release func(tier *fake.Tier, id uint64)
		want    []offload.Result
	}{
		{"total", func(tier *fake.Tier, id uint64) { tier.Release(id, false) }, repeat(offload.Miss, 3)},
		{"partial", func(tier *fake.Tier, id uint64) { tier.ReleasePartial(id, []offload.Key{ks[0], ks[2]}) },
			[]offload.Result{offload.Hit, offload.Miss, offload.Hit}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tier := fake.NewTier(offload.ChunkLevel)
			h := newHarness(t, 4, nil, tier)
			for _, k := range ks {
				tier.Put(k, h.block(k))
			}
			tier.Hold(true)
			req := h.newRequest("r")
			h.lookups(req, ks)
			held := tier.Held()
			if len(held) != 1 {
				t.Fatalf("held %v, want one job", held)
			}
			tt.release(tier, held[0])
			for _, k := range ks {
				tier.Answer(k, offload.Miss) // no second promotion
			}
			if diff := cmp.Diff(tt.want, h.lookups(req, ks)); diff != "" {
				t.Errorf("lookups after the result (-want +got):\n%s", diff)
			}
			if got := h.m.Metrics().Tiers[1].PromotionFailures; got != 1 {
				t.Errorf("promotion failures = %d, want 1", got)
			}
		})
	}
}

// S2.1 filter: a request's tier filter skips tiers but never the CPU tier.
func TestLoadTierFilter(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, nil, tier)
	ks := keys(1, 2)
	tier.Put(ks[1], h.block(ks[1]))
	w := h.newRequest("w")
	h.m.Do(func(s *offload.Step) { h.store(s, w, ks[:1]) })
	tests := []struct {
		name   string
		filter []offload.TierMatcher
		want   []offload.Result
	}{
		{"storage only", []offload.TierMatcher{{Medium: offload.MediumStorage}}, []offload.Result{offload.Hit, offload.Miss}},
		{"empty", []offload.TierMatcher{}, []offload.Result{offload.Hit, offload.Miss}},
		{"remote only", []offload.TierMatcher{{Locality: offload.Remote}}, []offload.Result{offload.Hit, offload.Miss}},
		{"cpu medium", []offload.TierMatcher{{Medium: offload.MediumCPU}}, []offload.Result{offload.Hit, offload.HitPending}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := tier.Calls().Lookups
			req := &offload.Request{ID: tt.name, LoadTiers: tt.filter}
			h.m.Do(func(s *offload.Step) {
				s.OnNewRequest(req)
				got := []offload.Result{s.Lookup(ks[0], req), s.Lookup(ks[1], req)}
				if diff := cmp.Diff(tt.want, got); diff != "" {
					t.Errorf("(-want +got):\n%s", diff)
				}
				s.Abort(req) // drop the promotion
			})
			asked := tier.Calls().Lookups - before
			if wantAsked := map[bool]int{true: 1, false: 0}[tt.want[1] != offload.Miss]; asked != wantAsked {
				t.Errorf("tier asked %d times, want %d", asked, wantAsked)
			}
		})
	}
}

// S2.3: PrepareLoad needs every key ready and pins atomically; CompleteLoad
// unpins; an unpinned release is an error, not a panic.
func TestPrepareLoad(t *testing.T) {
	h := newHarness(t, 4, nil)
	ks := keys(1, 2)
	req := h.newRequest("r")
	h.m.Do(func(s *offload.Step) {
		h.store(s, req, ks[:1])
		if _, err := s.PrepareStore(ks[1:], req); err != nil {
			t.Fatal(err)
		}
		if _, err := s.PrepareLoad(ks, req); !errors.Is(err, offload.ErrNotReady) {
			t.Errorf("PrepareLoad of a writing key: err %v, want ErrNotReady", err)
		}
	})
	if pins := h.m.Audit(0); len(pins) != 0 {
		t.Errorf("a failed PrepareLoad left pins: %v", pins)
	}
	h.m.Do(func(s *offload.Step) {
		if _, err := s.PrepareLoad(ks[:1], req); err != nil {
			t.Fatal(err)
		}
	})
	if pins := h.m.Audit(0); len(pins) != 1 || pins[0].Owner != offload.RequestOwner("r") {
		t.Errorf("pins after PrepareLoad = %v, want one owned by request r", pins)
	}
	h.m.Do(func(s *offload.Step) {
		if err := s.CompleteLoad(ks[:1], req); err != nil {
			t.Errorf("CompleteLoad: %v", err)
		}
		if err := s.CompleteLoad(ks[:1], req); !errors.Is(err, offload.ErrNotPinned) {
			t.Errorf("second CompleteLoad: err %v, want ErrNotPinned", err)
		}
	})
	if got := h.m.Metrics().Errors; got["not_ready"] != 1 || got["not_pinned"] != 1 {
		t.Errorf("errors counted %v, want not_ready 1 and not_pinned 1", got)
	}
}

// S2.4: cascades — every tier gets one store job pinning the slots until it
// completes; a failed store cascades nothing and frees its slots.
func TestCascade(t *testing.T) {
	t0, t1 := fake.NewTier(offload.ChunkLevel), fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 5, nil, t0, t1)
	ks := keys(1, 3)
	req := h.newRequest("r")
	s := h.m.Begin()
	h.store(s, req, ks)
	for i, ft := range []*fake.Tier{t0, t1} {
		if st := ft.Calls().Stores; len(st) != 1 || !slices.Equal(st[0].Keys, ks) || st[0].Req != req {
			t.Errorf("tier %d store jobs %v, want one with all keys and the request object", i, st)
		}
	}
	s.OnScheduleEnd()
	if p := h.m.Audit(0); len(p) != 0 {
		t.Errorf("cascade pins still held after the step: %v", p)
	}
	for _, k := range ks {
		if !t0.Has(k) || !t1.Has(k) {
			t.Errorf("key %v not cascaded to both tiers", k)
		}
	}

	failed := keys(2, 2)
	h.m.Do(func(s *offload.Step) {
		plan, _ := s.PrepareStore(failed, req)
		if err := s.CompleteStore(plan.Keys, req, false); err != nil {
			t.Fatal(err)
		}
	})
	if n := len(t0.Calls().Stores); n != 1 {
		t.Errorf("a failed store cascaded: %d store jobs", n)
	}
	if diff := cmp.Diff(repeat(offload.Miss, 2), h.lookups(req, failed)); diff != "" {
		t.Errorf("failed keys (-want +got):\n%s", diff)
	}
}

// S2.4: while cascades are in flight each block holds one pin per tier, so
// it cannot be evicted; PrepareStore answers nil when nothing is evictable
// and evicts least recently used blocks otherwise.
func TestStoreEviction(t *testing.T) {
	t0, t1 := fake.NewTier(offload.ChunkLevel), fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 3, nil, t0, t1)
	t0.Hold(true)
	t1.Hold(true)
	req := h.newRequest("r")
	old, next := keys(1, 3), keys(2, 2)
	h.m.Do(func(s *offload.Step) { h.store(s, req, old) })
	if p := h.m.Audit(0); len(p) != 6 {
		t.Fatalf("%d pins during cascades, want 6 (3 blocks × 2 tiers)", len(p))
	}
	h.m.Do(func(s *offload.Step) {
		if plan, err := s.PrepareStore(next, req); plan != nil || err != nil {
			t.Errorf("PrepareStore with every block pinned = %v, %v; want nil, nil", plan, err)
		}
	})
	for _, ft := range []*fake.Tier{t0, t1} {
		for _, id := range ft.Held() {
			ft.Release(id, true)
		}
	}
	h.step(func(s *offload.Step) {})                        // collect the cascades
	h.m.Do(func(s *offload.Step) { s.Touch(old[:1], req) }) // old[0] most recent
	var plan *offload.StorePlan
	h.m.Do(func(s *offload.Step) { plan = h.store(s, req, next) })
	if diff := cmp.Diff(old[1:], plan.Evicted); diff != "" {
		t.Errorf("evicted (-want +got):\n%s", diff)
	}
	if got := h.m.Metrics().CPU.Evictions; got != 2 {
		t.Errorf("evictions = %d, want 2", got)
	}
}

// S2.4, S2.5: a request-level tier gets the blocks already in the CPU tier
// (also when nothing is new); blocks still writing are parked until they
// resolve, and the request is not finalised while any is parked.
func TestRequestLevelCascade(t *testing.T) {
	chunk, whole := fake.NewTier(offload.ChunkLevel), fake.NewTier(offload.RequestLevel)
	h := newHarness(t, 8, nil, chunk, whole)
	ks := keys(1, 4)
	w := h.newRequest("writer")
	h.m.Do(func(s *offload.Step) {
		h.store(s, w, ks[:2])                                 // ready
		if _, err := s.PrepareStore(ks[2:3], w); err != nil { // writing
			t.Fatal(err)
		}
	})
	req := newReq("r")
	h.m.Do(func(s *offload.Step) {
		lvl, err := s.OnNewRequest(req)
		if err != nil || lvl != offload.RequestLevel {
			t.Fatalf("OnNewRequest = %v, %v; want RequestLevel", lvl, err)
		}
		plan, err := s.PrepareStore(ks[:3], req) // fully warm: nothing new
		if err != nil || plan == nil || len(plan.Keys) != 0 {
			t.Fatalf("PrepareStore = %+v, %v; want an empty plan", plan, err)
		}
		if err := s.OnRequestFinished(req); err != nil {
			t.Fatal(err)
		}
	})
	st := whole.Calls().Stores
	if len(st) != 2 || !slices.Equal(st[1].Keys, ks[:2]) {
		t.Fatalf("request-level tier stores %v, want the writer's cascade then one with the 2 ready keys", st)
	}
	if n := len(chunk.Calls().Stores); n != 1 {
		t.Errorf("chunk-level tier got %d stores, want only the writer's", n)
	}
	if !h.m.HasPendingWork() {
		t.Error("HasPendingWork false with a parked cascade")
	}
	if fin := whole.Calls().Finished; slices.Contains(fin, req) {
		t.Error("request finalised while a key is parked")
	}
	h.step(func(s *offload.Step) {}) // still writing: parked again
	h.m.Do(func(s *offload.Step) { s.CompleteStore(ks[2:3], w, true) })
	h.step(func(s *offload.Step) {})
	st = whole.Calls().Stores
	last := st[len(st)-1]
	if last.Req != req || !slices.Equal(last.Keys, ks[2:3]) {
		t.Errorf("last request-level store %v for %s, want the parked key for r", last.Keys, last.Req.ID)
	}
	if fin := whole.Calls().Finished; !slices.Contains(fin, req) {
		t.Error("request not finalised after its parked key resolved")
	}
}

// S2.4: a parked key whose write fails resolves to a miss and is dropped.
func TestParkedKeyWriteFails(t *testing.T) {
	whole := fake.NewTier(offload.RequestLevel)
	h := newHarness(t, 4, nil, whole)
	k := keys(1, 1)
	w := h.newRequest("w")
	req := h.newRequest("r")
	h.m.Do(func(s *offload.Step) {
		s.PrepareStore(k, w)
		s.PrepareStore(k, req) // parks k
		s.OnRequestFinished(req)
	})
	h.m.Do(func(s *offload.Step) { s.CompleteStore(k, w, false) })
	h.step(func(s *offload.Step) {})
	if h.m.HasPendingWork() {
		t.Error("HasPendingWork true after the parked key resolved")
	}
	if !slices.Contains(whole.Calls().Finished, req) {
		t.Error("request not finalised")
	}
}

// S2.5: tiers see OnRequestFinished only after the request's stores
// completed, after their store submits.
func TestFinalizeOrder(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, nil, tier)
	ks := keys(1, 2)
	req := h.newRequest("r")
	var plan *offload.StorePlan
	h.m.Do(func(s *offload.Step) {
		plan, _ = s.PrepareStore(ks, req)
		s.OnRequestFinished(req)
	})
	if n := len(tier.Calls().Finished); n != 0 {
		t.Fatalf("finalised with a store in flight")
	}
	h.m.Do(func(s *offload.Step) { s.CompleteStore(plan.Keys, req, true) })
	c := tier.Calls()
	if len(c.Stores) != 1 || len(c.Finished) != 1 || c.Finished[0] != req {
		t.Errorf("after the store: %d stores, finished %v; want 1 store then the request finished", len(c.Stores), c.Finished)
	}
	h.m.Do(func(s *offload.Step) {
		if err := s.OnRequestFinished(req); !errors.Is(err, offload.ErrUnknownRequest) {
			t.Errorf("finishing twice: err %v, want ErrUnknownRequest", err)
		}
	})
}

// S2.6: results for unknown jobs, duplicates and jobs of another tier are
// counted errors; the real result still lands.
func TestBadJobResults(t *testing.T) {
	t0, t1 := fake.NewTier(offload.ChunkLevel), fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, nil, t0, t1)
	k := keys(1, 1)[0]
	t0.Put(k, h.block(k))
	t0.Hold(true)
	req := h.newRequest("r")
	h.lookups(req, []offload.Key{k})
	id := t0.Held()[0]
	t1.Inject(offload.JobResult{ID: id, OK: true}) // wrong tier
	t0.Inject(offload.JobResult{ID: 999, OK: true})
	h.step(func(s *offload.Step) {})
	t0.Release(id, true)
	t0.Inject(offload.JobResult{ID: id, OK: true}) // completed twice
	if got := h.lookups(req, []offload.Key{k}); got[0] != offload.Hit {
		t.Errorf("lookup after the real result = %v, want hit", got[0])
	}
	e := h.m.Metrics().Errors
	if e["wrong_tier"] != 1 || e["unknown_job"] != 2 {
		t.Errorf("errors %v, want wrong_tier 1, unknown_job 2", e)
	}
}

// Bad use by the engine is an error, not a panic.
func TestMisuse(t *testing.T) {
	h := newHarness(t, 2, nil)
	req := newReq("stranger")
	h.m.Do(func(s *offload.Step) {
		if _, err := s.PrepareStore(keys(1, 1), req); !errors.Is(err, offload.ErrUnknownRequest) {
			t.Errorf("PrepareStore of an unknown request: %v", err)
		}
		if err := s.CompleteStore(keys(1, 1), req, true); !errors.Is(err, offload.ErrUnknownRequest) {
			t.Errorf("CompleteStore of an unknown request: %v", err)
		}
		if _, err := s.OnNewRequest(&offload.Request{}); err == nil {
			t.Error("OnNewRequest without an id succeeded")
		}
	})
	known := h.newRequest("known")
	h.m.Do(func(s *offload.Step) {
		if _, err := s.OnNewRequest(known); !errors.Is(err, offload.ErrRequestExists) {
			t.Errorf("OnNewRequest twice: %v", err)
		}
		if err := s.CompleteStore(keys(1, 1), known, true); !errors.Is(err, offload.ErrNoStore) {
			t.Errorf("CompleteStore without PrepareStore: %v", err)
		}
	})
	s := h.m.Begin()
	s.OnScheduleEnd()
	if err := s.CompleteLoad(nil, known); !errors.Is(err, offload.ErrStepEnded) {
		t.Errorf("using an ended step: %v", err)
	}
}

// S2.7: backpressure drops cascades to a slow tier, never promotions, and
// consumes no pin or job id when it refuses.
func TestBackpressure(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 16, func(c *offload.Config) { c.Admission = "backpressure" }, tier)
	tier.Hold(true)
	req := h.newRequest("r")
	// Three warm-up stores and one more, each held long enough to be slow.
	for i := range 4 {
		h.m.Do(func(s *offload.Step) { h.store(s, req, keys(10+i, 1)) })
		slowDown(tier)
		h.step(func(s *offload.Step) {})
	}
	m := h.m.Metrics().Tiers[1].Backpressure
	if m == nil || !m.Pressured {
		t.Fatalf("backpressure after slow stores = %+v, want pressured", m)
	}
	jobs := len(tier.Calls().Stores)
	h.m.Do(func(s *offload.Step) { h.store(s, req, keys(20, 2)) })
	if n := len(tier.Calls().Stores); n != jobs {
		t.Errorf("a store reached a pressured tier")
	}
	if p := h.m.Audit(0); len(p) != 0 {
		t.Errorf("a refused cascade left pins: %v", p)
	}
	if m := h.m.Metrics().Tiers[1].Backpressure; m.DroppedStores != 1 || m.DroppedBlocks != 2 {
		t.Errorf("dropped %d stores, %d blocks; want 1, 2", m.DroppedStores, m.DroppedBlocks)
	}
	k := keys(30, 1)[0]
	tier.Put(k, h.block(k))
	if got := h.lookups(h.newRequest("p"), []offload.Key{k}); got[0] != offload.HitPending {
		t.Errorf("promotion under pressure: %v, want hit_pending", got[0])
	}
}

// slowDown completes every held job of tier reporting one second per job,
// far above the high-water mark for a tiny block.
func slowDown(tier *fake.Tier) {
	for _, id := range tier.Held() {
		tier.ReleaseTook(id, time.Second)
	}
}

// S2.8: stored and removed events of the CPU tier, in order and numbered.
func TestEvents(t *testing.T) {
	h := newHarness(t, 2, nil)
	sub := h.m.Subscribe(0)
	defer sub.Close()
	req := h.newRequest("r")
	a, b := keys(1, 2), keys(2, 1)
	h.m.Do(func(s *offload.Step) { h.store(s, req, a) })
	h.m.Do(func(s *offload.Step) { h.store(s, req, b) })
	want := []offload.Event{
		{Seq: 1, Kind: offload.EventStored, Tier: "cpu", Keys: a},
		{Seq: 2, Kind: offload.EventRemoved, Tier: "cpu", Keys: a[:1], Removed: true},
		{Seq: 3, Kind: offload.EventStored, Tier: "cpu", Keys: b},
	}
	if diff := cmp.Diff(want, sub.Take()); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if ev := sub.Take(); len(ev) != 0 {
		t.Errorf("events taken twice: %v", ev)
	}
}

// S2.9: Abort releases pins, queued promotions and parked cascades at once,
// tells the tiers, and is idempotent.
func TestAbort(t *testing.T) {
	tier := fake.NewTier(offload.RequestLevel)
	h := newHarness(t, 4, nil, tier)
	ks := keys(1, 3)
	w := h.newRequest("w")
	h.m.Do(func(s *offload.Step) {
		h.store(s, w, ks[:1])
		s.PrepareStore(ks[1:2], w)
	})
	h.step(func(s *offload.Step) {}) // collect the writer's cascade
	remote := keys(2, 1)[0]
	tier.Put(remote, h.block(remote))
	req := h.newRequest("r")
	s := h.m.Begin()
	if _, err := s.PrepareLoad(ks[:1], req); err != nil {
		t.Fatal(err)
	}
	s.PrepareStore(ks[:2], req) // parks ks[1]
	if r := s.Lookup(remote, req); r != offload.HitPending {
		t.Fatalf("promotion lookup = %v", r)
	}
	s.Abort(req)
	s.Abort(req)
	s.OnScheduleEnd()
	if p := h.m.Audit(0); len(p) != 0 {
		t.Errorf("pins after abort: %v", p)
	}
	if n := len(tier.Calls().Loads); n != 0 {
		t.Errorf("an aborted request's promotion was submitted")
	}
	if got := h.lookups(h.newRequest("x"), []offload.Key{remote}); got[0] != offload.HitPending {
		t.Errorf("the aborted promotion's slot was not freed: lookup %v", got[0])
	}
	told := 0
	for _, r := range tier.Calls().Finished {
		if r == req {
			told++
		}
	}
	if told != 1 {
		t.Errorf("tier told %d times of the abort, want once", told)
	}
	if got := h.m.Metrics().CPU.ForcedReleases; got != 1 {
		t.Errorf("forced releases = %d, want 1", got)
	}
	h.step(func(s *offload.Step) {})
	if h.m.HasPendingWork() {
		t.Error("HasPendingWork after abort and promotion")
	}
}

// S2.10: a job completing on a tier's goroutine signals progress.
func TestProgress(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, nil, tier)
	k := keys(1, 1)[0]
	tier.Put(k, h.block(k))
	tier.Hold(true)
	h.lookups(h.newRequest("r"), []offload.Key{k})
	select { // drain whatever the step signalled
	case <-h.m.Progress():
	default:
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		tier.Release(tier.Held()[0], true)
	}()
	<-done
	select {
	case <-h.m.Progress():
	default:
		t.Error("no progress signal after a job completed")
	}
}

// S2.0: a Hit stays valid until PrepareLoad in the same step: a promotion
// or a store in that step may not evict it, even as the only candidate.
func TestHitStaysValidInStep(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 1, nil, tier)
	local, remote := keys(1, 1)[0], keys(2, 1)[0]
	w := h.newRequest("w")
	h.m.Do(func(s *offload.Step) { h.store(s, w, []offload.Key{local}) })
	h.step(func(s *offload.Step) {})
	tier.Put(remote, h.block(remote))
	req := h.newRequest("r")
	h.step(func(s *offload.Step) {
		if r := s.Lookup(local, req); r != offload.Hit {
			t.Fatalf("lookup = %v, want hit", r)
		}
		if r := s.Lookup(remote, req); r != offload.Miss {
			t.Errorf("a promotion that could only evict this step's hit answered %v, want miss", r)
		}
		if plan, err := s.PrepareStore(keys(3, 1), req); plan != nil || err != nil {
			t.Errorf("a store that could only evict this step's hit got %+v, %v", plan, err)
		}
		if _, err := s.PrepareLoad([]offload.Key{local}, req); err != nil {
			t.Errorf("PrepareLoad after the hit: %v", err)
		}
		s.CompleteLoad([]offload.Key{local}, req)
	})
	if r := h.lookups(req, []offload.Key{remote}); r[0] != offload.HitPending {
		t.Errorf("in the next step the promotion answered %v, want hit_pending (evicting the old block)", r[0])
	}
}

// The Parent facade: inside Serve a tier registers an external request,
// looks keys up without reaching itself, takes leases it owns (pins
// released when it reports them) and finishes the request; the manager
// never calls the tier's own request hooks for it.
func TestParentFacade(t *testing.T) {
	peer, other := fake.NewTier(offload.ChunkLevel), fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, nil, peer, other)
	ks := keys(1, 2)
	w := h.newRequest("w")
	h.m.Do(func(s *offload.Step) { h.store(s, w, ks[:1]) })
	h.step(func(s *offload.Step) {})
	remote := &offload.Request{ID: "peer:1"}
	var answers []offload.Result
	var job *offload.Job
	peer.Hold(true)
	peer.OnServe(func(p offload.Parent) error {
		peer.OnServe(nil) // once
		if err := p.OnNewRequest(remote); err != nil {
			t.Errorf("parent OnNewRequest: %v", err)
		}
		for _, k := range ks {
			answers = append(answers, p.Lookup(k, remote))
		}
		var err error
		if job, err = p.Lease(ks[:1], remote); err != nil || job == nil || !job.Lease {
			t.Fatalf("Lease = %+v, %v; want a lease", job, err)
		}
		peer.Run(job)
		if err := p.OnRequestFinished(remote); err != nil {
			t.Errorf("parent OnRequestFinished: %v", err)
		}
		return nil
	})
	peerLookups := peer.Calls().Lookups
	h.step(func(s *offload.Step) {})
	if diff := cmp.Diff([]offload.Result{offload.Hit, offload.Miss}, answers); diff != "" {
		t.Errorf("parent lookups (-want +got):\n%s", diff)
	}
	if peer.Calls().Lookups != peerLookups {
		t.Error("the serving tier's parent lookups reached the tier itself")
	}
	if other.Calls().Lookups == 0 {
		t.Error("parent lookups did not ask the other tiers")
	}
	if job.Tier != 0 || slices.Contains(peer.Calls().New, remote) || slices.Contains(peer.Calls().Finished, remote) {
		t.Errorf("job tier %d; the peer tier saw its own request hooks: new %v finished %v", job.Tier, peer.Calls().New, peer.Calls().Finished)
	}
	if !slices.Contains(other.Calls().Finished, remote) {
		t.Error("other tiers were not told the external request finished")
	}
	if p := h.m.Audit(0); len(p) != 1 || p[0].Owner != offload.JobOwner(job.ID) {
		t.Errorf("pins while the peer job runs: %v, want one owned by job %d", p, job.ID)
	}
	peer.Release(job.ID, true)
	h.step(func(s *offload.Step) {})
	if p := h.m.Audit(0); len(p) != 0 {
		t.Errorf("pins after the peer job finished: %v", p)
	}
}

// Touch reaches the CPU tier's recency and every tier that keeps its own.
func TestTouch(t *testing.T) {
	tier := fake.NewTier(offload.ChunkLevel)
	h := newHarness(t, 4, nil, tier)
	ks := keys(1, 2)
	req := newReq("r")
	h.m.Do(func(s *offload.Step) { s.Touch(ks, req) })
	if diff := cmp.Diff([][]offload.Key{ks}, tier.Calls().Touches); diff != "" {
		t.Errorf("tier touches (-want +got):\n%s", diff)
	}
}
