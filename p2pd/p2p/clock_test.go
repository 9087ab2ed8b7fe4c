package p2p

import (
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/wire"
)

type countingTier struct {
	*Tier
	serves *atomic.Int64
}

func (c countingTier) Serve(p offload.Parent) error { c.serves.Add(1); return c.Tier.Serve(p) }

// S3.1, issue 13 (found in review): once a round ended, the deadlines the
// tier asked the manager's clock for during it (pin hold, keep-alive, …)
// are forgotten when its Serve asks for none: an idle node makes no
// service pass in an hour.
func TestIdleAfterRoundNoPasses(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		pc := DefaultConfig()
		pc.Listen = "127.0.0.1:0"
		pc.DataConns = 2
		cfg := tinyConfig(16)
		prod := &node{}
		var serves atomic.Int64
		spec := Spec(pc, cfg, mn)
		inner := spec.New
		spec.New = func(env offload.TierEnv) (offload.Tier, error) {
			tr, err := inner(env)
			if err != nil {
				return tr, err
			}
			prod.tier = tr.(*Tier)
			return countingTier{prod.tier, &serves}, nil
		}
		m, err := offload.New(cfg, spec)
		if err != nil {
			t.Fatal(err)
		}
		prod.m = m
		t.Cleanup(func() { m.Close() })

		keys := testKeys(1, 2)
		prod.store(t, keys)
		dataL, _ := mn.Listen("fake:1")
		f := connectFake(t, mn, prod, "fake")
		f.send(wire.Lookup{ReqID: "kv", Round: 1, Keys: wkeys(keys)})
		expect[wire.LookupResp](t, f)
		synctest.Wait()
		f.send(wire.Fetch{ReqID: "kv", Round: 1, Keys: wkeys(keys), Slots: []uint32{7, 3}})
		readBlocks(t, f, dataL, 2, prod.m.BlockBytes())
		expect[wire.TransferDone](t, f)
		synctest.Wait()
		if n := pins(prod); n != 0 {
			t.Fatalf("%d pins after transfer_done", n)
		}
		before := serves.Load()
		start := time.Now()
		var at []time.Duration
		for range 3600 {
			time.Sleep(time.Second)
			synctest.Wait()
			if n := serves.Load(); n != before {
				at = append(at, time.Since(start))
				before = n
			}
		}
		if len(at) > 0 {
			t.Errorf("idle node (round over, nothing outstanding): service passes at %v", at)
		}
	})
}
