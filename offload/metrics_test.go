package offload

import (
	"bytes"
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
	"unicode/utf8"
)

func testManager(t *testing.T, slots int, specs ...TierSpec) *Manager {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Geometry = Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = int64(slots * cfg.slotStride())
	m, err := New(cfg, specs...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// nullTier has nothing and completes nothing.
type nullTier struct{}

func (nullTier) Lookup(Key, *Request) Result { return Miss }
func (nullTier) SubmitLoad(*Job)             {}
func (nullTier) SubmitStore(*Job)            {}
func (nullTier) Finished() []JobResult       { return nil }

func nullSpec(name string, loc Locality) TierSpec {
	return TierSpec{Name: name, Locality: loc, New: func(TierEnv) (Tier, error) { return nullTier{}, nil }}
}

// The Prometheus text passes promtool's lint, and names follow §9.
func TestWritePrometheus(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Geometry = Geometries["tiny"]
	cfg.CPUHugePages = false
	cfg.CPUBytes = 1 << 20
	cfg.Admission = "backpressure"
	m, err := New(cfg, nullSpec("disk", Local), nullSpec(`p"2\p`, Remote))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	req := &Request{ID: "r"}
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		s.Lookup(testKeys(1)[0], req)
	})
	var buf bytes.Buffer
	if err := m.Metrics().WritePrometheus(&buf); err != nil {
		t.Fatal(err)
	}
	text := buf.String()
	for _, want := range []string{
		`kv_offload_tiering_lookups_total{tier="cpu",result="miss"} 1`,
		`kv_offload_tiering_lookups_total{tier="disk",result="miss"} 1`,
		`kv_offload_tiering_lookups_total{tier="p\"2\\p",result="miss"} 1`,
		`kv_offload_tiering_backpressure_active{tier="disk"} 0`,
		"kv_offload_cpu_slots 128",
		"kv_offload_tiering_requests 1",
		`kv_offload_tiering_errors_total{reason="unknown_job"} 0`,
		`kv_offload_tiering_hit_pending_timeouts_total{reason="hit_pending"} 0`, // S4.7
		`kv_offload_tiering_hit_pending_timeouts_total{reason="retry"} 0`,
		`kv_offload_tiering_tier_panics_total{tier="disk"} 0`, // S2.11
	} {
		if !strings.Contains(text, want+"\n") {
			t.Errorf("missing line %q", want)
		}
	}
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "# TYPE ") {
			f := strings.Fields(line)
			if !strings.HasPrefix(f[2], "kv_offload_") || (f[3] == "counter") != strings.HasSuffix(f[2], "_total") {
				t.Errorf("bad family %s %s: want the kv_offload_ prefix and _total exactly on counters", f[2], f[3])
			}
		}
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not installed (Debian package prometheus; .ci/run installs it): lint not run")
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = &buf
	if out, err := cmd.CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
}

// The expvar helper publishes the same snapshot as JSON.
func TestExpvarFunc(t *testing.T) {
	m := testManager(t, 4)
	var got Metrics
	if err := json.Unmarshal([]byte(ExpvarFunc(m).String()), &got); err != nil {
		t.Fatal(err)
	}
	if got.CPU.Slots != 4 || len(got.Tiers) != 1 || got.Tiers[0].Name != "cpu" {
		t.Errorf("expvar snapshot %+v", got)
	}
}

// Lookup allocates nothing for hits and misses (B5).
func TestLookupAllocs(t *testing.T) {
	m := testManager(t, 4, nullSpec("null", Local))
	ks := testKeys(2)
	req := &Request{ID: "r"}
	m.Do(func(s *Step) {
		s.OnNewRequest(req)
		p, _ := s.PrepareStore(ks[:1], req)
		s.CompleteStore(p.Keys, req, true)
	})
	s := m.Begin()
	defer s.OnScheduleEnd()
	for _, k := range ks {
		if a := testing.AllocsPerRun(100, func() { s.Lookup(k, req) }); a != 0 {
			t.Errorf("Lookup(%v) = %v allocates %v times, want 0", k, s.Lookup(k, req), a)
		}
	}
}

// B5, issue 13: a step ends with the service pass; a good pass allocates
// nothing beyond the Step itself.
func TestStepAllocs(t *testing.T) {
	m := testManager(t, 4, nullSpec("null", Local))
	if a := testing.AllocsPerRun(100, func() { m.Begin().OnScheduleEnd() }); a > 1 {
		t.Errorf("an empty step allocates %v times, want at most 1 (the Step)", a)
	}
}

// Review (issue 14): a label value that is not UTF-8 (a peer's node id)
// is written as valid UTF-8, so one bad value cannot make the whole
// scrape unreadable.
func TestLabelValuesUTF8(t *testing.T) {
	var buf strings.Builder
	if err := WriteStats(&buf, []Stat{{Name: "kv_x_total", Type: "counter", Help: "x.", Value: 1, Labels: []string{"peer", "node-\xff\xfe\"\n"}}}); err != nil {
		t.Fatal(err)
	}
	if !utf8.ValidString(buf.String()) || !strings.Contains(buf.String(), "kv_x_total{peer=\"node-\uFFFD\\\"\\n\"} 1") {
		t.Errorf("text %q: want valid UTF-8 with the bad bytes replaced and the rest escaped", buf.String())
	}
}
