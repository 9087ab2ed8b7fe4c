package tiering

import (
	"math"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/testing/fake"
)

func withBackpressure(c *offload.Config) { c.Admission = "backpressure" }

// storeTook stores ks for req and completes the cascade the tier holds as
// if it took took.
func storeTook(h *harness, tier *fake.Tier, req *offload.Request, ks []offload.Key, took time.Duration) {
	h.m.Do(func(s *offload.Step) { h.store(s, req, ks) })
	for _, id := range tier.Held() {
		tier.ReleaseTook(id, took)
	}
	h.step(func(s *offload.Step) {})
}

// lease takes a lease on ks through tier's Parent in one step, as a P2P
// producer does for a peer's lookup, and has the tier hold it.
func lease(t *testing.T, h *harness, tier *fake.Tier, ks []offload.Key) *offload.Job {
	t.Helper()
	var job *offload.Job
	tier.OnServe(func(p offload.Parent) error {
		tier.OnServe(nil)
		remote := &offload.Request{ID: "peer:" + ks[0].String()}
		if err := p.OnNewRequest(remote); err != nil {
			return err
		}
		var err error
		if job, err = p.Lease(ks, remote); err != nil {
			t.Errorf("Lease: %v", err)
		}
		if job != nil {
			tier.Run(job)
		}
		return p.OnRequestFinished(remote)
	})
	h.step(func(s *offload.Step) {})
	return job
}

func backpressureOf(h *harness) offload.AdmissionStats { return *h.m.Metrics().Tiers[1].Backpressure }

// S2.7: a pressured tier is refused its stores, so it gets no new samples;
// its estimate decays and the tier is admitted again once
// log2(EstimateCap × high / low) half-lives have passed (≈ 5.6 s with the
// local marks), not before.
func TestBackpressureRecovers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tier := fake.NewTier(offload.ChunkLevel)
		h := newHarness(t, 16, withBackpressure, tier)
		tier.Hold(true)
		req := h.newRequest("r")
		for i := range 4 { // three warm-up samples and one more, all slow
			storeTook(h, tier, req, keys(10+i, 1), time.Second)
		}
		capped := offload.EstimateCap * offload.LocalHighWater
		if bp := backpressureOf(h); !bp.Pressured || math.Abs(bp.EMA-capped) > 1e-12 {
			t.Fatalf("after slow stores: %+v; want pressured at the cap %g", bp, capped)
		}
		recovery := time.Duration(math.Log2(capped/offload.LocalLowWater) * float64(offload.DecayHalfLife))
		stores := len(tier.Calls().Stores)

		time.Sleep(recovery - 50*time.Millisecond)
		h.m.Do(func(s *offload.Step) { h.store(s, req, keys(20, 1)) })
		if n := len(tier.Calls().Stores); n != stores {
			t.Errorf("a store reached the tier %v after pressure began, before the documented %v", recovery-50*time.Millisecond, recovery)
		}
		if bp := backpressureOf(h); !bp.Pressured || bp.DroppedStores != 1 {
			t.Errorf("just before recovery: %+v; want pressured, one store dropped", bp)
		}

		time.Sleep(100 * time.Millisecond)
		if bp := backpressureOf(h); bp.Pressured || bp.EMA >= offload.LocalLowWater {
			t.Errorf("%v after pressure began, with no new sample: %+v; want recovered below the low mark", recovery+50*time.Millisecond, bp)
		}
		h.m.Do(func(s *offload.Step) { h.store(s, req, keys(21, 1)) })
		if n := len(tier.Calls().Stores); n != stores+1 {
			t.Errorf("after recovery %d stores reached the tier, want 1", n-stores)
		}
	})
}

// S2.7, S6.5: pins held for a peer are leases, not stores: however long
// the peer takes to fetch, a lease's end changes neither the estimate nor
// the store metrics, and a lease is granted while the tier is pressured
// (before, a producer under backpressure answered every peer with a miss
// from the third round on).
func TestLeaseOutsideAdmission(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		peer := fake.NewTier(offload.ChunkLevel)
		h := newHarness(t, 16, withBackpressure, peer)
		peer.Hold(true)
		req := h.newRequest("r")
		// 15.625 µs per 8 KiB block is 0.002 s/MiB: between the marks.
		for i := range 4 {
			storeTook(h, peer, req, keys(10+i, 1), 15625*time.Nanosecond)
		}
		before := h.m.Metrics().Tiers[1]
		if bp := *before.Backpressure; bp.Pressured || math.Abs(bp.EMA-0.002) > 1e-9 {
			t.Fatalf("after the warm-up: %+v; want an estimate of 0.002, not pressured", bp)
		}

		// A lease held for 3 s and ended with no duration (the tier does not
		// time a peer's fetch): the estimate only decays.
		j := lease(t, h, peer, keys(10, 1))
		if j == nil || !j.Lease {
			t.Fatalf("lease = %+v, want a lease", j)
		}
		if m := h.m.Metrics().Tiers[1]; m.ActiveLeases != 1 || m.ActiveCascades != 0 {
			t.Errorf("while the lease is held: %d leases, %d cascades; want 1, 0", m.ActiveLeases, m.ActiveCascades)
		}
		time.Sleep(3 * time.Second)
		peer.Release(j.ID, true)
		h.step(func(s *offload.Step) {})
		after := h.m.Metrics().Tiers[1]
		if want := before.Backpressure.EMA / 8; math.Abs(after.Backpressure.EMA-want) > 1e-12 {
			t.Errorf("estimate after a 3 s lease: %g, want %g (the warm-up's, decayed 3 half-lives)", after.Backpressure.EMA, want)
		}
		if after.WriteBytes != before.WriteBytes || after.WriteSeconds != before.WriteSeconds || after.CascadeFailures != before.CascadeFailures || after.ActiveLeases != 0 {
			t.Errorf("a lease changed the store metrics: before %+v, after %+v", before, after)
		}
		if p := h.m.Audit(0); len(p) != 0 {
			t.Errorf("pins after the lease ended: %v", p)
		}

		// A lease whose end reports a long duration: no change at all.
		ema := after.Backpressure.EMA
		j = lease(t, h, peer, keys(11, 1))
		peer.ReleaseTook(j.ID, 10*time.Second)
		h.step(func(s *offload.Step) {})
		if got := backpressureOf(h).EMA; got != ema {
			t.Errorf("estimate after a lease reporting 10 s: %g, want %g", got, ema)
		}

		// Pressure from a real slow store, then a lease: granted, and no
		// store counted as dropped for it.
		storeTook(h, peer, req, keys(14, 1), time.Second)
		if bp := backpressureOf(h); !bp.Pressured {
			t.Fatalf("after a slow store: %+v, want pressured", bp)
		}
		if j = lease(t, h, peer, keys(12, 1)); j == nil || !j.Lease {
			t.Errorf("lease on a pressured tier = %+v, want granted", j)
		}
		if bp := backpressureOf(h); bp.DroppedStores != 0 {
			t.Errorf("a lease counted as a dropped store: %+v", bp)
		}
	})
}
