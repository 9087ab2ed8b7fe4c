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

// S6.10, each lookup's bound runs from when it left (found in review): a
// lookup asked while the session still dials is held until the handshake
// ends. With a 2.5 s handshake and lookup_timeout 3 s (lookup_hold 1 s)
// it leaves at 2.5 s; its bound ran from the step that asked it, so it
// missed at 3 s though the producer answered within its lookup_hold.
func TestHeldLookupBoundFromWhenItLeft(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := newMemNet()
		cons := newNode(t, mn, func(c *Config) { c.LookupHold = offload.Duration(time.Second) }, 16) // lookup_timeout 3 s
		l, err := mn.Listen("fp:1")
		if err != nil {
			t.Fatal(err)
		}
		req := &offload.Request{ID: "r", TransferParams: source("kv", "fp:1")}
		cons.m.Do(func(s *offload.Step) { s.OnNewRequest(req) })
		keys := testKeys(1, 1)
		t0 := time.Now()
		step(cons, req, keys) // asked while dialling: held
		fc := make(chan *fakePeer, 1)
		go func() {
			c, err := l.Accept()
			if err != nil {
				t.Error(err)
				return
			}
			f := newFake(t, "fp", "")
			f.c = c
			h, _ := f.read().(wire.Hello)
			time.Sleep(2500 * time.Millisecond) // a slow (but in-time) handshake
			if _, err := f.shaker().acceptControl(c, h); err != nil {
				t.Errorf("handshake: %v", err)
			}
			f.serve()
			fc <- f
		}()
		f := <-fc
		lk := expect[wire.Lookup](t, f)
		left := time.Since(t0)
		time.Sleep(time.Second) // the producer's full lookup_hold
		f.send(wire.LookupResp{ReqID: lk.ReqID, Round: lk.Round, Keys: lk.Keys, Hits: []bool{true}})
		synctest.Wait()
		got := step(cons, req, keys)
		if got[0] == offload.Miss || stat(cons, "kv_offload_p2p_lookup_timeouts_total") != 0 {
			t.Errorf("the lookup left at %v and was answered %v later: %v, %v lookup timeouts; want not timed out (its bound runs from when it left)",
				left, time.Since(t0)-left, got[0], stat(cons, "kv_offload_p2p_lookup_timeouts_total"))
		}
		cons.m.Do(func(s *offload.Step) { s.OnRequestFinished(req) })
	})
}
