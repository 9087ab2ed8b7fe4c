package offload

import (
	"bufio"
	"expvar"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"
)

// Transfer directions, relative to the tier in the label: read takes blocks
// out of the tier (a CPU → GPU load, a promotion from a secondary tier),
// write puts them in (a GPU → CPU store, a cascade to a secondary tier).
const (
	dirRead = iota
	dirWrite
)

var dirNames = [2]string{"read", "write"}

// Reasons counted in Metrics.Errors: a caller's or a tier's mistake that was
// refused and logged instead of crashing the daemon.
var errorReasons = []string{"not_ready", "not_pinned", "unknown_request", "request_exists",
	"no_store", "unknown_job", "wrong_tier", "tier_hit_pending", "step_ended"}

type xferCounter struct {
	bytes   uint64
	seconds float64
}

func (x *xferCounter) add(bytes int, took time.Duration) {
	x.bytes += uint64(bytes)
	x.seconds += took.Seconds()
}

type counters struct {
	lookups                [][4]uint64      // [0] cpu, [i+1] secondary tier i; by Result
	xfer                   [][2]xferCounter // same index; by direction
	jobFailures            [][2]uint64      // secondary tier i; [dirRead] promotions, [dirWrite] cascades
	promotionAllocFailures uint64
	timeouts               [2]uint64 // by reason: timeoutHitPending, timeoutRetry
	tierPanics             []uint64  // secondary tier i (S2.11)
	pollErrors             uint64
	pollBackoffs           uint64
	resets                 uint64
	errors                 map[string]uint64
}

func newCounters(tiers int) counters {
	c := counters{
		lookups:     make([][4]uint64, tiers+1),
		xfer:        make([][2]xferCounter, tiers+1),
		jobFailures: make([][2]uint64, tiers),
		tierPanics:  make([]uint64, tiers),
		errors:      make(map[string]uint64),
	}
	for _, r := range errorReasons {
		c.errors[r] = 0
	}
	return c
}

// Metrics is a snapshot of the manager's counters and gauges. Counters
// count from the manager's start.
type Metrics struct {
	CPU CPUMetrics `json:"cpu"`
	// Tiers holds the CPU tier first, then the secondary tiers in order.
	Tiers []TierMetrics `json:"tiers"`
	// Requests is the number of requests the manager tracks.
	Requests int `json:"requests"`
	// PromotionAllocFailures counts secondary hits that found no CPU slot.
	PromotionAllocFailures uint64 `json:"promotion_alloc_failures"`
	// Errors counts refused misuse by reason (unknown_job, not_ready, …).
	Errors map[string]uint64 `json:"errors"`
	// HitPendingTimeouts counts (request, key) pairs whose deadline expired
	// while they answered HitPending (S4.4); RetryTimeouts those whose
	// deadline expired while they answered Retry (S4.7).
	HitPendingTimeouts uint64 `json:"hit_pending_timeouts"`
	RetryTimeouts      uint64 `json:"retry_timeouts"`
	// Poll is the poll goroutine's state: running, stopped or disabled.
	Poll string `json:"poll"`
	// PollErrors counts failed poll passes (errors or panics from tiers);
	// PollBackoffs the backoff waits they caused (S3.3).
	PollErrors   uint64 `json:"poll_errors"`
	PollBackoffs uint64 `json:"poll_backoffs"`
	// Resets counts completed cache resets.
	Resets uint64 `json:"resets"`
	// BlockTokens is the tokens of one block, for lookups in tokens.
	BlockTokens int `json:"block_tokens"`
}

// CPUMetrics describes the CPU tier and its arena.
type CPUMetrics struct {
	CPUStats
	// OldestPinAge is the age of the oldest pin (S1.3), zero without one.
	OldestPinAge       time.Duration `json:"oldest_pin_age"`
	ArenaBytes         int64         `json:"arena_bytes"`
	LockRequestedBytes int64         `json:"lock_requested_bytes"`
	LockedBytes        int64         `json:"locked_bytes"`
}

// TierMetrics describes one tier's traffic.
type TierMetrics struct {
	Name string `json:"name"`
	// Lookups counts answers by result name (hit, miss, hit_pending, retry).
	Lookups      map[string]uint64 `json:"lookups"`
	ReadBytes    uint64            `json:"read_bytes"`
	ReadSeconds  float64           `json:"read_seconds"`
	WriteBytes   uint64            `json:"write_bytes"`
	WriteSeconds float64           `json:"write_seconds"`
	// Secondary tiers only.
	PromotionFailures uint64 `json:"promotion_failures"`
	CascadeFailures   uint64 `json:"cascade_failures"`
	ActivePromotions  int    `json:"active_promotions"`
	ActiveCascades    int    `json:"active_cascades"`
	// ActiveLeases counts the pins the tier holds for peers (S6.5).
	ActiveLeases int             `json:"active_leases"`
	Backpressure *AdmissionStats `json:"backpressure,omitempty"`
	// Panics counts calls into the tier that panicked and were recovered
	// (S2.11).
	Panics uint64 `json:"panics"`
	// Stats are the tier's own metrics (StatsReporter).
	Stats []Stat `json:"stats,omitempty"`
}

// Metrics returns a snapshot of the manager's metrics.
func (m *Manager) Metrics() Metrics {
	m.lock()
	defer m.mu.Unlock()
	c := &m.mu.counters
	a := m.mu.cpu.Arena()
	out := Metrics{
		CPU: CPUMetrics{CPUStats: m.mu.cpu.Stats(), ArenaBytes: int64(a.Len()),
			LockRequestedBytes: a.RequestedLockBytes(), LockedBytes: a.LockedBytes},
		Requests:               len(m.mu.reqs),
		PromotionAllocFailures: c.promotionAllocFailures,
		Errors:                 maps.Clone(c.errors),
		HitPendingTimeouts:     c.timeouts[timeoutHitPending],
		RetryTimeouts:          c.timeouts[timeoutRetry],
		Poll:                   m.pollState(),
		PollErrors:             c.pollErrors,
		PollBackoffs:           c.pollBackoffs,
		Resets:                 c.resets,
		BlockTokens:            m.cfg.Geometry.BlockTokens,
	}
	out.CPU.OldestPinAge = m.mu.cpu.oldestPin(m.nowLocked())
	for i := range c.lookups {
		t := TierMetrics{Name: "cpu", Lookups: make(map[string]uint64, 4)}
		for r, n := range c.lookups[i] {
			t.Lookups[Result(r).String()] = n
		}
		x := c.xfer[i]
		t.ReadBytes, t.ReadSeconds = x[dirRead].bytes, x[dirRead].seconds
		t.WriteBytes, t.WriteSeconds = x[dirWrite].bytes, x[dirWrite].seconds
		if i > 0 {
			t.Name = m.specs[i-1].Name
			t.PromotionFailures, t.CascadeFailures = c.jobFailures[i-1][dirRead], c.jobFailures[i-1][dirWrite]
			if st, ok := m.mu.admission.Stats(i-1, m.nowLocked()); ok {
				t.Backpressure = &st
			}
			if r, ok := m.mu.tiers[i-1].(StatsReporter); ok {
				m.tierCall(i-1, "stats", func() { t.Stats = r.Stats() })
			}
			t.Panics = c.tierPanics[i-1]
		}
		out.Tiers = append(out.Tiers, t)
	}
	for _, j := range m.mu.jobs {
		switch {
		case j.Promotion:
			out.Tiers[j.Tier+1].ActivePromotions++
		case j.Lease:
			out.Tiers[j.Tier+1].ActiveLeases++
		default:
			out.Tiers[j.Tier+1].ActiveCascades++
		}
	}
	return out
}

// pollState says whether the poll goroutine runs.
func (m *Manager) pollState() string {
	switch {
	case !m.polling:
		return "disabled"
	case m.pollAlive.Load():
		return "running"
	}
	return "stopped"
}

// ExpvarFunc publishes the manager's metrics through expvar, for main:
// expvar.Publish("kv_offload", offload.ExpvarFunc(m)).
func ExpvarFunc(m *Manager) expvar.Func { return func() any { return m.Metrics() } }

// WritePrometheus writes the snapshot in the Prometheus text format, with
// the names docs/metrics.md lists.
func (s Metrics) WritePrometheus(w io.Writer) error {
	p := promWriter{w: bufio.NewWriter(w)}
	p.family("kv_offload_tiering_lookups_total", "counter", "Lookup answers by tier and result.")
	for _, t := range s.Tiers {
		for _, r := range resultNames {
			p.sample(float64(t.Lookups[r]), "tier", t.Name, "result", r)
		}
	}
	p.family("kv_offload_tiering_transfer_bytes_total", "counter", "Bytes moved out of (read) and into (write) each tier.")
	for _, t := range s.Tiers {
		p.sample(float64(t.ReadBytes), "tier", t.Name, "direction", "read")
		p.sample(float64(t.WriteBytes), "tier", t.Name, "direction", "write")
	}
	p.family("kv_offload_tiering_transfer_seconds_total", "counter", "Time spent moving blocks out of (read) and into (write) each tier.")
	for _, t := range s.Tiers {
		p.sample(t.ReadSeconds, "tier", t.Name, "direction", "read")
		p.sample(t.WriteSeconds, "tier", t.Name, "direction", "write")
	}
	secondary := s.Tiers[min(1, len(s.Tiers)):]
	p.family("kv_offload_tiering_job_failures_total", "counter", "Failed promotion and cascade jobs by secondary tier.")
	for _, t := range secondary {
		p.sample(float64(t.PromotionFailures), "tier", t.Name, "kind", "promotion")
		p.sample(float64(t.CascadeFailures), "tier", t.Name, "kind", "cascade")
	}
	p.family("kv_offload_tiering_active_jobs", "gauge", "Promotion and cascade jobs and leases for peers in flight by secondary tier.")
	for _, t := range secondary {
		p.sample(float64(t.ActivePromotions), "tier", t.Name, "kind", "promotion")
		p.sample(float64(t.ActiveCascades), "tier", t.Name, "kind", "cascade")
		p.sample(float64(t.ActiveLeases), "tier", t.Name, "kind", "lease")
	}
	p.family("kv_offload_tiering_promotion_allocation_failures_total", "counter", "Secondary hits not promoted because no CPU slot could be freed.")
	p.sample(float64(s.PromotionAllocFailures))
	p.family("kv_offload_tiering_errors_total", "counter", "Refused misuse by callers or tiers, by reason.")
	for _, r := range slices.Sorted(maps.Keys(s.Errors)) {
		p.sample(float64(s.Errors[r]), "reason", r)
	}
	p.family("kv_offload_tiering_requests", "gauge", "Requests the manager tracks.")
	p.sample(float64(s.Requests))
	p.family("kv_offload_tiering_hit_pending_timeouts_total", "counter", "Request and key pairs that answered Miss because they had not settled within hit_pending_timeout, by their last answer.")
	p.sample(float64(s.HitPendingTimeouts), "reason", timeoutReasons[timeoutHitPending])
	p.sample(float64(s.RetryTimeouts), "reason", timeoutReasons[timeoutRetry])
	p.family("kv_offload_tiering_tier_panics_total", "counter", "Calls into a secondary tier that panicked and were recovered.")
	for _, t := range secondary {
		p.sample(float64(t.Panics), "tier", t.Name)
	}
	p.family("kv_offload_tiering_poll_running", "gauge", "1 while the tier-poll goroutine runs and services the polled tiers (0 with tier_poll_interval <= 0, where it keeps only the clock).")
	p.sample(map[bool]float64{true: 1}[s.Poll == "running"])
	p.family("kv_offload_tiering_poll_errors_total", "counter", "Failed tier-poll passes (errors or panics from tiers).")
	p.sample(float64(s.PollErrors))
	p.family("kv_offload_tiering_poll_backoffs_total", "counter", "Backoff waits of the tier-poll goroutine.")
	p.sample(float64(s.PollBackoffs))
	p.family("kv_offload_tiering_resets_total", "counter", "Completed cache resets.")
	p.sample(float64(s.Resets))
	var bp []TierMetrics
	for _, t := range secondary {
		if t.Backpressure != nil {
			bp = append(bp, t)
		}
	}
	if len(bp) > 0 {
		p.family("kv_offload_tiering_backpressure_active", "gauge", "1 while cascades to the tier are dropped for backpressure.")
		for _, t := range bp {
			v := 0.0
			if t.Backpressure.Pressured {
				v = 1
			}
			p.sample(v, "tier", t.Name)
		}
		p.family("kv_offload_tiering_backpressure_store_latency_seconds_per_mib", "gauge", "EMA of the tier's store latency in seconds per MiB.")
		for _, t := range bp {
			p.sample(t.Backpressure.EMA, "tier", t.Name)
		}
		p.family("kv_offload_tiering_backpressure_dropped_stores_total", "counter", "Cascades dropped for backpressure.")
		for _, t := range bp {
			p.sample(float64(t.Backpressure.DroppedStores), "tier", t.Name)
		}
		p.family("kv_offload_tiering_backpressure_dropped_blocks_total", "counter", "Blocks in cascades dropped for backpressure.")
		for _, t := range bp {
			p.sample(float64(t.Backpressure.DroppedBlocks), "tier", t.Name)
		}
	}
	var tierStats []Stat
	for _, t := range secondary {
		for _, st := range t.Stats {
			st.Labels = append([]string{"tier", t.Name}, st.Labels...)
			tierStats = append(tierStats, st)
		}
	}
	p.stats(tierStats)
	p.family("kv_offload_tiering_lookup_tokens_total", "counter", "Lookup answers by tier and result, in tokens (blocks × block tokens): the denominator of a token hit rate.")
	for _, t := range s.Tiers {
		for _, r := range resultNames {
			p.sample(float64(t.Lookups[r]*uint64(s.BlockTokens)), "tier", t.Name, "result", r)
		}
	}
	p.family("kv_offload_cpu_oldest_pin_age_seconds", "gauge", "Age of the CPU tier's oldest pin (0 with none): alert on a leak (S1.3).")
	p.sample(s.CPU.OldestPinAge.Seconds())
	c := s.CPU
	for _, g := range []struct {
		name, typ, help string
		v               float64
	}{
		{"kv_offload_cpu_slots", "gauge", "Slots in the CPU tier.", float64(c.Slots)},
		{"kv_offload_cpu_slots_used", "gauge", "CPU slots holding a block (writing or ready).", float64(c.Used)},
		{"kv_offload_cpu_slots_writing", "gauge", "CPU slots reserved for a write in flight.", float64(c.Writing)},
		{"kv_offload_cpu_slots_pinned", "gauge", "CPU slots with at least one pin.", float64(c.Pinned)},
		{"kv_offload_cpu_evictions_total", "counter", "Blocks evicted from the CPU tier.", float64(c.Evictions)},
		{"kv_offload_cpu_scrub_mismatches_total", "counter", "Blocks a scrub found disagreeing with their checksum and removed.", float64(c.ScrubMismatches)},
		{"kv_offload_cpu_forced_releases_total", "counter", "Pins released by an abort instead of their owner.", float64(c.ForcedReleases)},
		{"kv_offload_cpu_slots_detached", "gauge", "Slots a cache reset removed while a transfer still held them.", float64(c.Detached)},
		{"kv_offload_cpu_arena_bytes", "gauge", "Size of the CPU arena mapping.", float64(c.ArenaBytes)},
		{"kv_offload_cpu_lock_requested_bytes", "gauge", "Arena bytes asked to be locked in RAM.", float64(c.LockRequestedBytes)},
		{"kv_offload_cpu_locked_bytes", "gauge", "Arena bytes actually locked in RAM.", float64(c.LockedBytes)},
	} {
		p.family(g.name, g.typ, g.help)
		p.sample(g.v)
	}
	return p.flush()
}

// promWriter writes Prometheus text exposition format.
type promWriter struct {
	w    *bufio.Writer
	name string
}

func (p *promWriter) family(name, typ, help string) {
	p.name = name
	fmt.Fprintf(p.w, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
}

var labelEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)

// sample writes one sample of the current family; labels are name, value
// pairs.
func (p *promWriter) sample(v float64, labels ...string) {
	p.w.WriteString(p.name)
	for i := 0; i+1 < len(labels); i += 2 {
		sep := ","
		if i == 0 {
			sep = "{"
		}
		// A label value from a peer (its node id) need not be UTF-8; one
		// invalid value would make the whole scrape unreadable.
		fmt.Fprintf(p.w, `%s%s="%s"`, sep, labels[i], labelEscaper.Replace(strings.ToValidUTF8(labels[i+1], "\uFFFD")))
	}
	if len(labels) > 0 {
		p.w.WriteString("}")
	}
	fmt.Fprintf(p.w, " %v\n", v)
}

func (p *promWriter) flush() error { return p.w.Flush() }

// stats writes stats grouped into families by name, in name order.
func (p *promWriter) stats(stats []Stat) {
	byName := map[string][]Stat{}
	for _, st := range stats {
		byName[st.Name] = append(byName[st.Name], st)
	}
	for _, name := range slices.Sorted(maps.Keys(byName)) {
		f := byName[name]
		p.family(name, f[0].Type, f[0].Help)
		for _, st := range f {
			if st.Hist != nil {
				p.histogram(st.Hist, st.Labels...)
			} else {
				p.sample(st.Value, st.Labels...)
			}
		}
	}
}

// WriteStats writes stats (metrics of the daemon around the manager) in
// the Prometheus text format, grouped into families by name.
func WriteStats(w io.Writer, stats []Stat) error {
	p := promWriter{w: bufio.NewWriter(w)}
	p.stats(stats)
	return p.flush()
}
