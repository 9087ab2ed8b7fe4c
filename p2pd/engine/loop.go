package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvtier/kvtier/offload"
	"github.com/kvtier/kvtier/p2pd/api"
)

// Run is the scheduler loop; it returns after Shutdown, or once ctx
// ended and the requests it aborted were released.
func (e *Engine) Run(ctx context.Context) {
	defer close(e.done)
	e.stopped = ctx.Done()
	for {
		e.step()
		if e.finishCommands() {
			return
		}
		e.sleep()
	}
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// sleep blocks until something may have changed: a message, a finished
// copy, the manager's progress, or a deadline. It does not block while a
// request can be stepped now.
func (e *Engine) sleep() {
	if e.schedulable() {
		e.drain()
		return
	}
	var timer <-chan time.Time
	var deadline time.Time
	if e.pause != nil {
		deadline = e.pause.deadline
	}
	if e.shutdown != nil && time.Now().Before(e.shutdown.deadline) && (deadline.IsZero() || e.shutdown.deadline.Before(deadline)) {
		deadline = e.shutdown.deadline // once past, a copy or digest still running wakes the loop itself
	}
	if e.m.HasPendingWork() {
		// The manager needs steps (S3.4): step at most every millisecond.
		deadline = minTime(deadline, time.Now().Add(time.Millisecond))
	}
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		timer = t.C
	}
	select {
	case msg := <-e.inbox:
		e.handle(msg)
	case <-e.wake:
	case <-e.m.Progress():
	case <-timer:
	case <-e.stopped:
		e.stopped = nil
		e.handle(&shutdownCmd{deadline: time.Now(), reply: make(chan error, 1)})
	}
	e.drain()
}

func minTime(a, b time.Time) time.Time {
	if a.IsZero() || b.Before(a) {
		return b
	}
	return a
}

// drain handles every queued message without blocking.
func (e *Engine) drain() {
	for {
		select {
		case msg := <-e.inbox:
			e.handle(msg)
		default:
			return
		}
	}
}

// schedulable reports whether a step would make progress without waiting:
// a waiting request fits, or a finished copy is unprocessed.
func (e *Engine) schedulable() bool {
	if !e.stepping() {
		return false
	}
	if len(e.waiting) > 0 && !e.stopAdmit && e.State() == Running && len(e.waiting[0].keys) <= len(e.free) {
		return true
	}
	for _, j := range e.active {
		if j.copying {
			if done, _ := j.copyDone(); done {
				return true
			}
		}
	}
	return false
}

// stepping says whether requests advance: not while paused, nor while a
// keep-mode pause freezes them.
func (e *Engine) stepping() bool {
	switch e.State() {
	case Paused:
		return false
	case Pausing:
		return e.pause == nil || e.pause.mode != PauseKeep
	}
	return true
}

func (e *Engine) handle(msg any) {
	switch c := msg.(type) {
	case *job:
		if e.State() == ShuttingDown {
			c.reply <- jobReply{err: ErrShuttingDown}
			return
		}
		c.start = time.Now()             // elapsed_ms leaves out the wait for the loop (a paused node)
		e.waiting = append(e.waiting, c) // sized and keyed by Submit
	case *pauseCmd:
		if e.State() != Running {
			c.reply <- fmt.Errorf("%w: pause while %v", ErrBadState, e.State())
			return
		}
		e.pause = c
		e.state.Store(int32(Pausing))
		if c.mode == PauseAbort {
			e.abortAll(ErrAborted)
		}
	case resumeCmd:
		switch e.State() {
		case Paused:
			e.state.Store(int32(Running))
			c.reply <- nil
		case Pausing:
			e.pause.reply <- fmt.Errorf("%w: resumed before the pause completed", ErrBadState)
			e.pause = nil
			e.state.Store(int32(Running))
			c.reply <- nil
		default:
			c.reply <- fmt.Errorf("%w: resume while %v", ErrBadState, e.State())
		}
	case cancelCmd:
		if i := slices.Index(e.waiting, c.j); i >= 0 {
			e.waiting = slices.Delete(e.waiting, i, i+1)
			c.j.reply <- jobReply{err: c.err} // unread: the channel holds one
		} else if slices.Contains(e.active, c.j) {
			e.abort(c.j, c.err) // a no-op once answered (a digest runs on)
		}
	case *shutdownCmd:
		if e.shutdown != nil { // a second one may only bring the deadline forward
			if c.deadline.Before(e.shutdown.deadline) {
				e.shutdown.deadline = c.deadline
			}
			c.reply <- nil
			return
		}
		if e.pause != nil {
			e.pause.reply <- ErrShuttingDown
			e.pause = nil
		}
		e.shutdown = c
		e.state.Store(int32(ShuttingDown))
		for _, j := range e.waiting {
			j.reply <- jobReply{err: ErrShuttingDown}
		}
		e.waiting = nil
	}
	e.counts()
}

func (e *Engine) counts() {
	e.running.Store(int32(len(e.active)))
	e.queued.Store(int32(len(e.waiting)))
}

// abortAll aborts waiting and running requests; running ones are cleaned
// up once their copies in flight finished.
func (e *Engine) abortAll(err error) {
	for _, j := range e.waiting {
		j.reply <- jobReply{err: err}
	}
	e.waiting = nil
	for _, j := range e.active {
		e.abort(j, err)
	}
}

func (e *Engine) abort(j *job, err error) {
	if j.reply == nil {
		return
	}
	e.m.Do(func(s *offload.Step) { e.abortIn(s, j, err) })
}

// abortIn is abort inside a step the loop already holds (a load the
// executor refuses is failed from the scheduling step): the manager lock
// is not reentrant.
func (e *Engine) abortIn(s *offload.Step, j *job, err error) {
	if j.reply == nil {
		return
	}
	j.reply <- jobReply{err: err}
	j.reply = nil
	s.Abort(j.req)
}

// finishCommands completes a pause or a shutdown whose condition holds,
// or whose deadline passed. It reports whether the loop must return.
func (e *Engine) finishCommands() bool {
	now := time.Now()
	e.reap()
	e.counts() // current before any answer below: a caller reads them when it returns
	if c := e.pause; c != nil {
		quiet := !e.copying() && !e.m.HasPendingWork()
		if c.mode != PauseKeep {
			quiet = quiet && len(e.active) == 0
		}
		switch {
		case quiet:
			var err error
			if c.clear {
				ctx, cancel := context.WithDeadline(context.Background(), c.deadline)
				err = e.m.ResetCache(ctx)
				cancel()
			}
			e.pause = nil
			if err != nil { // the pause asked for a cleared cache: without one the node goes on running, as after a timeout
				e.state.Store(int32(Running))
				c.reply <- clearFailed(err)
				break
			}
			e.state.Store(int32(Paused))
			c.reply <- nil
		case !now.Before(c.deadline):
			run, wait := len(e.active), len(e.waiting)
			e.pause = nil
			e.state.Store(int32(Running))
			c.reply <- fmt.Errorf("%w: %d requests still running, %d waiting, copies in flight: %v", ErrPauseTimeout, run, wait, e.copying())
		}
	}
	if c := e.shutdown; c != nil {
		if !now.Before(c.deadline) {
			for _, j := range e.active {
				e.abort(j, ErrShuttingDown)
			}
			e.reap()
		}
		if len(e.active) == 0 {
			e.counts()
			c.reply <- nil
			return true
		}
	}
	e.counts()
	return false
}

// clearFailed is a pause's answer when its cache reset failed: another
// reset runs (a conflict, ErrBadState) or the manager closed
// (ErrShuttingDown).
func clearFailed(err error) error {
	if errors.Is(err, offload.ErrResetting) {
		return fmt.Errorf("%w: clear_cache: %w; not paused", ErrBadState, err)
	}
	if errors.Is(err, offload.ErrClosed) {
		return fmt.Errorf("%w: clear_cache: %w; not paused", ErrShuttingDown, err)
	}
	return fmt.Errorf("engine: clear_cache: %w; not paused", err)
}

func (e *Engine) copying() bool {
	for _, j := range e.active {
		if j.digesting() {
			return true
		}
		if j.copying {
			if done, _ := j.copyDone(); !done {
				return true
			}
		}
	}
	return false
}

// reap drops aborted requests whose copies finished, freeing their GPU
// blocks.
func (e *Engine) reap() {
	kept := e.active[:0]
	for _, j := range e.active {
		if j.reply == nil {
			if j.digesting() {
				kept = append(kept, j)
				continue
			}
			if j.copying {
				done, err := j.copyDone()
				if !done {
					kept = append(kept, j)
					continue
				}
				if j.phase == phaseStoring { // a failed copy's slots hold no block: freed (S7.2)
					e.m.Do(func(s *offload.Step) { s.CompleteStore(j.plan.Keys, j.req, err == nil) })
				}
			}
			e.release(j)
			continue
		}
		kept = append(kept, j)
	}
	clear(e.active[len(kept):])
	e.active = kept
}

func (e *Engine) release(j *job) {
	e.free = append(e.free, j.gpu...)
	j.gpu = nil
}

// step admits requests, runs one scheduling phase under the manager lock,
// and advances requests whose copies finished.
func (e *Engine) step() {
	if !e.stepping() {
		// Frozen requests (a keep-mode pause, paused), but the tiers that
		// only steps service go on: their jobs end, and the pause can
		// complete (S5.3).
		if e.m.HasPendingWork() {
			e.m.Do(func(*offload.Step) {})
		}
		return
	}
	// Admit in order while GPU blocks last.
	var admitted []*job
	for e.State() == Running && len(e.waiting) > 0 && len(e.waiting[0].keys) <= len(e.free) {
		j := e.waiting[0]
		e.waiting = e.waiting[1:]
		n := len(j.keys)
		j.gpu = append([]int32(nil), e.free[len(e.free)-n:]...)
		e.free = e.free[:len(e.free)-n]
		j.req = &offload.Request{ID: j.r.ID, TransferParams: j.r.TransferParams, Chain: j.chain}
		admitted = append(admitted, j)
	}
	// Finished copies first: a load part that ended lets this step's
	// lookup start the next.
	for _, j := range e.active {
		if j.reply == nil || !j.copying {
			continue
		}
		if done, err := j.copyDone(); done {
			j.copying = false
			e.copied(j, err)
		}
	}
	lookups := len(admitted) > 0
	for _, j := range e.active {
		lookups = lookups || (j.phase == phaseLookup && j.reply != nil)
	}
	// One step a loop turn (issue 13): the new requests registered, every
	// lookup, then the step's end asks the peers at once.
	if lookups || e.m.HasPendingWork() {
		s := e.m.Begin()
		for _, j := range admitted {
			if _, err := s.OnNewRequest(j.req); err != nil {
				e.release(j)
				j.reply <- jobReply{err: err}
				continue
			}
			e.active = append(e.active, j)
		}
		for _, j := range e.active {
			if j.phase == phaseLookup && j.reply != nil {
				e.lookup(s, j)
			}
		}
		s.OnScheduleEnd()
	}
	e.reap()
	e.finishDone()
}

// lookup advances a request's prefix (offload.Step.LookupPrefix, in
// windows): from the first block not yet loading it scans past Retry and
// HitPending to the first Miss, as LookupPrefix does, but stops at the
// e.window-th block the tiers are still finding out about (Retry): a
// peer is asked about e.window blocks at a time, and about the next ones
// as soon as those are answered, while they are fetched (HitPending does
// not stop the scan). The leading ready blocks (Hit) start loading at once
// unless a part of the prefix is still copying: one part at a time, the
// next takes what became ready meanwhile. So a long prefix from a peer
// arrives in rounds fetched without a gap and loads part by part as they
// land. Without a window (0) the whole prefix is scanned and loads in one
// part once it is settled. Once every block up to the first Miss or the
// prompt's end loads, the request is in phaseLoading: its last part's end
// computes the rest.
func (e *Engine) lookup(s *offload.Step, j *job) {
	ready, unsettled, finding := 0, 0, 0
	for _, k := range j.keys[j.hits:] {
		r := s.Lookup(k, j.req)
		if r == offload.Miss {
			break
		}
		if r == offload.Hit {
			if unsettled == 0 {
				ready++
			}
			continue
		}
		unsettled++
		if r == offload.Retry {
			if finding++; finding == e.window {
				break
			}
		}
	}
	if j.copying {
		return // its end steps again
	}
	known := unsettled == 0 // the prefix ends at the first Miss or the prompt's end
	if e.window == 0 && !known {
		return // no window: the whole prefix loads at once, once settled (S2.10: progress wakes the loop)
	}
	if ready > 0 && !e.loadPart(s, j, ready) {
		return
	}
	if known {
		j.phase = phaseLoading
	}
}

// loadPart pins the next n blocks of j's prefix, ready in the CPU tier,
// and starts their CPU → GPU copy; false when the request failed.
func (e *Engine) loadPart(s *offload.Step, j *job, n int) bool {
	keys := j.keys[j.hits : j.hits+n]
	slots, err := s.PrepareLoad(keys, j.req)
	if err != nil {
		e.failIn(s, j, err)
		return false
	}
	for _, k := range keys {
		switch s.LoadSource(k, j.req) {
		case "cpu":
			j.src.CPU++
		case "disk":
			j.src.Disk++
		default:
			j.src.Peer++
		}
	}
	pairs := make([]Pair, n)
	for i := range pairs {
		pairs[i] = Pair{GPU: j.gpu[j.hits+i], CPU: slots[i]}
	}
	j.part, j.hits = j.hits, j.hits+n
	sums := j.r.Digest == DigestCRC32C // the digest's leaves, off the load
	if err := e.start(j, func() (Copy, error) { return e.x.Load(pairs, sums) }, nil); err != nil {
		e.failIn(s, j, err)
		return false
	}
	return true
}

// start runs a copy; stored, when not nil, are the pairs of a store, whose
// blocks' CRC32Cs are recorded with their slots once it ends (S7.2).
// It returns the executor's refusal, for the caller to fail the job in
// or out of a step.
func (e *Engine) start(j *job, begin func() (Copy, error), stored []Pair) error {
	t, err := begin()
	if err != nil {
		return err
	}
	j.copy, j.copying, j.sums = t, true, nil
	var sums chan struct{}
	if stored != nil {
		sums = make(chan struct{})
		j.sums = sums
	}
	e.wg.Go(func() {
		if t.Wait() == nil && stored != nil {
			e.recordSums(stored, t.Sums())
		}
		if sums != nil {
			close(sums) // only now may the store complete (copyDone)
		}
		signal(e.wake)
	})
	return nil
}

// copyDone says whether the job's copy ended (and its error), and for a
// store also whether its blocks' checksums are recorded: a block must not
// become ready before its checksum is kept (S7.2).
func (j *job) copyDone() (bool, error) {
	done, err := j.copy.Done()
	if done && j.sums != nil {
		select {
		case <-j.sums:
		default:
			return false, nil
		}
	}
	return done, err
}

// recordSums keeps each stored block's CRC32C with its CPU slot: the one
// the copy computed, else (a backend that does not, or sums of another
// length than the copy's: an executor's bug) computed here, off the
// engine loop, before the store completes.
func (e *Engine) recordSums(pairs []Pair, sums []uint32) {
	sums = e.checkSums("store", sums, len(pairs))
	a := e.m.Arena()
	for i, p := range pairs {
		if sums != nil {
			a.SetSum(int(p.CPU), sums[i])
		} else {
			a.ClearSum(int(p.CPU))
			a.SumOf(int(p.CPU))
		}
	}
}

func (e *Engine) fail(j *job, err error) {
	e.m.Do(func(s *offload.Step) { e.failIn(s, j, err) })
}

// failIn is fail inside a step the loop holds.
func (e *Engine) failIn(s *offload.Step, j *job, err error) {
	e.log.Warn("engine: request failed", "request", j.r.ID, "err", err)
	e.abortIn(s, j, err)
}

// finishDone advances requests whose prefix is known and loaded: the
// lookup that found its end started no part (the last had ended, or there
// was nothing to load).
func (e *Engine) finishDone() {
	for _, j := range e.active {
		if j.reply != nil && j.phase == phaseLoading && !j.copying {
			e.loaded(j)
		}
	}
}

// copied advances a request whose copy finished: after a load part,
// release its pins (and, after the last, go on as loaded); after the
// store, answer.
func (e *Engine) copied(j *job, err error) {
	switch j.phase {
	case phaseLookup, phaseLoading:
		var cerr error
		e.m.Do(func(s *offload.Step) { cerr = s.CompleteLoad(j.keys[j.part:j.hits], j.req) })
		if err == nil {
			err = cerr
		}
		if err != nil {
			e.fail(j, err)
			return
		}
		j.keepSums(e.checkSums("load", j.copy.Sums(), j.hits-j.part), func(i int) int { return j.part + i })
		if j.phase == phaseLoading {
			e.loaded(j)
		}
	case phaseStoring:
		e.m.Do(func(s *offload.Step) { s.CompleteStore(j.plan.Keys, j.req, err == nil) })
		if err != nil {
			e.fail(j, err)
			return
		}
		j.keepSums(e.checkSums("store", j.copy.Sums(), len(j.stored)), func(i int) int { return j.stored[i] })
		e.answer(j)
	}
}

// loaded advances a request whose prefix is loaded: compute the missing
// blocks and store them (a fetch_only request answers at once).
func (e *Engine) loaded(j *job) {
	if j.r.FetchOnly {
		j.src.Missed = len(j.keys) - j.hits
		j.phase = phaseStoring
		e.answer(j)
		return
	}
	for i := j.hits; i < len(j.keys); i++ {
		if err := e.x.Compute(j.gpu[i], j.keys[i]); err != nil {
			e.fail(j, err)
			return
		}
		j.src.Computed++
	}
	var plan *offload.StorePlan
	var err error
	e.m.Do(func(s *offload.Step) { plan, err = s.PrepareStore(j.keys[j.hits:], j.req) })
	if err != nil {
		e.fail(j, err)
		return
	}
	j.plan = plan
	j.phase = phaseStoring
	if plan == nil || len(plan.Keys) == 0 {
		e.answer(j)
		return
	}
	index := map[offload.Key]int{}
	for i, k := range j.keys {
		index[k] = i
	}
	pairs := make([]Pair, len(plan.Keys))
	j.stored = make([]int, len(plan.Keys))
	for i, k := range plan.Keys {
		j.stored[i] = index[k]
		pairs[i] = Pair{GPU: j.gpu[index[k]], CPU: plan.Slots[i]}
	}
	if err := e.start(j, func() (Copy, error) { return e.x.Store(pairs) }, pairs); err != nil {
		e.m.Do(func(s *offload.Step) {
			s.CompleteStore(plan.Keys, j.req, false)
			e.failIn(s, j, err)
		})
	}
}

// checkSums returns a copy's checksums of its n blocks, or nil when the
// copy returned another number of them (an executor's bug: logged, once
// per engine), so that the blocks are read instead.
func (e *Engine) checkSums(op string, sums []uint32, n int) []uint32 {
	if sums == nil || len(sums) == n {
		return sums
	}
	if e.sumsWarned.CompareAndSwap(false, true) {
		e.log.Warn("engine: a copy returned checksums of another number of blocks than it moved (an executor's bug); "+
			"they are not trusted, the blocks are read instead (logged once)", "copy", op, "checksums", len(sums), "blocks", n)
	}
	return nil
}

// keepSums keeps, for a crc32c digest, the CRC32Cs a finished copy
// computed of the blocks it moved, as checkSums passed them (nil: none to
// trust; the digest reads those blocks): sums[i] is the block of
// keys[key(i)]. The bytes a copy moved are the GPU block's: a load wrote
// them there, a store read them from there.
func (j *job) keepSums(sums []uint32, key func(i int) int) {
	if j.r.Digest != DigestCRC32C || sums == nil {
		return
	}
	if j.crcs == nil {
		j.crcs, j.crcKnown = make([]uint32, len(j.keys)), make([]bool, len(j.keys))
	}
	for i, c := range sums {
		j.crcs[key(i)], j.crcKnown[key(i)] = c, true
	}
}

// answer finishes a request with the manager and replies; the KV digest,
// when asked for, is computed on a goroutine of its own (a sha256 one
// reads every GPU block: up to a second a GiB; a crc32c one the blocks no
// copy of the request summed), which keeps the job's GPU blocks until it
// is done, so the engine loop goes on scheduling meanwhile.
func (e *Engine) answer(j *job) {
	elapsed := time.Since(j.start) // the prefill is done; the digest is extra
	res := api.Result{RequestID: j.r.ID, Blocks: len(j.keys), Sources: j.src, ElapsedMS: float64(elapsed.Microseconds()) / 1000}
	e.m.Do(func(s *offload.Step) { s.OnRequestFinished(j.req) })
	reply, kind := j.reply, j.r.Digest
	j.reply, j.req, j.chain = nil, nil, nil
	if kind == DigestNone {
		reply <- jobReply{res: res}
		return
	}
	gpu := slices.Clone(j.gpu)
	if j.r.FetchOnly {
		gpu = gpu[:j.hits] // the rest holds nothing of this prompt
	}
	var crcs []uint32
	var known []bool
	if j.crcs != nil {
		crcs, known = j.crcs[:len(gpu)], j.crcKnown[:len(gpu)]
	}
	done := make(chan struct{})
	j.digest = done
	e.wg.Go(func() {
		defer func() {
			close(done)
			signal(e.wake) // reap frees the GPU blocks
		}()
		d, err := e.digestOf(kind, gpu, crcs, known)
		if err != nil {
			e.log.Warn("engine: request failed", "request", res.RequestID, "err", err)
			reply <- jobReply{err: err}
			return
		}
		res.KVDigest = d
		reply <- jobReply{res: res}
	})
}

// digesting says whether the job's digest goroutine still reads its GPU
// blocks.
func (j *job) digesting() bool {
	if j.digest == nil {
		return false
	}
	select {
	case <-j.digest:
		return false
	default:
		return true
	}
}
