package offload_test

import (
	"context"
	"fmt"
	"strings"

	"github.com/kvtier/kvtier/offload"
)

// An engine step: look a prompt's blocks up, store the ones that missed,
// and find them on the next request with the same prefix.
func Example() {
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["tiny"]
	cfg.CPUBytes = 64 * int64(cfg.Geometry.BlockBytes())
	m, err := offload.New(cfg)
	if err != nil {
		panic(err)
	}
	defer m.Close()

	tokens := make([]uint32, 48) // three 16-token blocks
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys := offload.BlockKeys(cfg.HashSeed, cfg.Geometry.BlockTokens, tokens)

	req := &offload.Request{ID: "first"}
	s := m.Begin()
	s.OnNewRequest(req)
	fmt.Println("first lookup:", s.Lookup(keys[0], req))
	plan, _ := s.PrepareStore(keys, req)
	s.OnScheduleEnd()
	for i := range plan.Keys {
		copy(m.Arena().Slot(int(plan.Slots[i])), "KV bytes from the GPU")
	}
	m.Do(func(s *offload.Step) {
		s.CompleteStore(plan.Keys, req, true)
		s.OnRequestFinished(req)
	})

	again := &offload.Request{ID: "second"}
	s = m.Begin()
	s.OnNewRequest(again)
	fmt.Println("second lookup:", s.Lookup(keys[0], again))
	slots, _ := s.PrepareLoad(keys[:1], again)
	s.OnScheduleEnd()
	fmt.Println("loaded:", strings.TrimRight(string(m.Arena().Slot(int(slots[0]))[:21]), "\x00"))
	m.Do(func(s *offload.Step) { s.CompleteLoad(keys[:1], again) })
	// Output:
	// first lookup: miss
	// second lookup: hit
	// loaded: KV bytes from the GPU
}

// A subscriber reads the manager's events: stored and removed blocks per
// tier, and one "cleared" per cache reset.
func ExampleManager_Subscribe() {
	cfg := offload.DefaultConfig()
	cfg.Geometry = offload.Geometries["tiny"]
	cfg.CPUBytes = 64 * int64(cfg.Geometry.BlockBytes())
	m, err := offload.New(cfg)
	if err != nil {
		panic(err)
	}
	defer m.Close()
	sub := m.Subscribe(1024)
	defer sub.Close()

	keys := offload.BlockKeys(cfg.HashSeed, cfg.Geometry.BlockTokens, make([]uint32, 32))
	req := &offload.Request{ID: "r"}
	m.Do(func(s *offload.Step) {
		s.OnNewRequest(req)
		plan, _ := s.PrepareStore(keys, req)
		s.CompleteStore(plan.Keys, req, true)
		s.OnRequestFinished(req)
	})
	m.ResetCache(context.Background())

	ev, _ := sub.Next(context.Background()) // blocks until something happened
	for _, e := range ev {
		fmt.Println(e.Seq, e.Kind, e.Tier, len(e.Keys), e.Epoch)
	}
	// Output:
	// 1 stored cpu 2 0
	// 2 cleared cpu 0 1
}
