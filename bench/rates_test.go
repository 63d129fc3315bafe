package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestKeptUp(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		r    LatencyResult
		want bool
	}{
		{"on rate, drained", LatencyResult{Rate: 1000, Achieved: 1000, DrainSeconds: 0.01}, true},
		{"95% of the rate", LatencyResult{Rate: 1000, Achieved: 950, DrainSeconds: 0}, true},
		{"producers lag", LatencyResult{Rate: 1000, Achieved: 900, DrainSeconds: 0}, false},
		{"slow drain", LatencyResult{Rate: 1000, Achieved: 1000, DrainSeconds: 2.5}, false},
		{"never drained", LatencyResult{Rate: 1000, Achieved: 1000, DrainSeconds: -1}, false},
	} {
		if got := keptUp(tc.r); got != tc.want {
			t.Errorf("%s: keptUp = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestAttribute checks the segments against hand-made reads, the database
// clock's ones without a monotonic reading as pgx returns them.
func TestAttribute(t *testing.T) {
	t.Parallel()
	c := newClocks()
	t0 := time.Now()
	wall := func(d time.Duration) time.Time { return t0.Add(d).Round(0) }
	for id := int64(1); id <= 100; id++ {
		c.commit[id] = t0
		c.created[id] = wall(1 * time.Millisecond)
		c.handoff[id] = t0.Add(3 * time.Millisecond)
		c.attempted[id] = wall(7 * time.Millisecond)
		c.work[id] = t0.Add(8 * time.Millisecond)
	}
	// One fetch read before the handoff: clamped, counted.
	c.attempted[100] = wall(2 * time.Millisecond)

	got := map[string]Segment{}
	for _, s := range attribute(c, true) {
		got[s.Name] = s
	}
	want := map[string]float64{segClaim: 1, segHandoff: 2, segFetch: 4, segWork: 1}
	if len(got) != len(want) {
		t.Fatalf("segments %v, want %v", got, want)
	}
	for name, ms := range want {
		s := got[name]
		if s.Count != 100 || s.P50 < ms*0.99 || s.P50 > ms*1.01 {
			t.Errorf("%s: count %d p50 %.3f ms, want 100 and %.0f ms", name, s.Count, s.P50, ms)
		}
	}
	if got[segFetch].Clamped != 1 {
		t.Errorf("handoff→fetch clamped %d, want 1", got[segFetch].Clamped)
	}

	direct := attribute(c, false)
	if len(direct) != 2 || direct[0].Name != segFetch || direct[0].From != "producer commit" {
		t.Fatalf("river-direct segments %+v, want handoff→fetch from the producer commit, then fetch→work", direct)
	}
	if d := direct[0].P50; d < 6.9 || d > 7.1 {
		t.Errorf("river-direct commit→fetch p50 %.3f ms, want 7", d)
	}
}

// TestPrepareGraphileSkips: when the peer cannot be installed the bench
// gets a note, not an error.
func TestPrepareGraphileSkips(t *testing.T) {
	t.Parallel()
	repo := t.TempDir()
	if err := os.MkdirAll(filepath.Join(repo, "scripts"), 0o755); err != nil {
		t.Fatal(err)
	}
	script := "#!/usr/bin/env bash\necho 'install-node-peer: node is missing' >&2\nexit 1\n"
	if err := os.WriteFile(filepath.Join(repo, "scripts", "install-node-peer.sh"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	peer, note := prepareGraphile(ctx, &Options{Repo: repo})
	if peer != nil {
		t.Fatalf("peer %+v, want nil", peer)
	}
	if !strings.Contains(note, "graphile-worker skipped") || !strings.Contains(note, "node is missing") {
		t.Errorf("note %q, want the skip and the script's reason", note)
	}
}

// TestRatesReport: the table marks the runs that did not keep up and the
// skipped ones, and the plot is written.
func TestRatesReport(t *testing.T) {
	t.Parallel()
	sum := func(p50, p99 float64) *Summary { return &Summary{Count: 10, P50: p50, P99: p99, P999: p99} }
	r := &RateResults{Rates: []int{200, 1000, 4000}, Duration: "2s", KeepUpRule: keepUpRule, Runs: []RateRun{
		{LatencyResult: LatencyResult{Mode: modeNotify, Rate: 200, Achieved: 200, Handoff: sum(0.8, 3), EndToEnd: sum(1.4, 4),
			Waits: map[string][]string{"workers": {"IO:WALSync 20%"}, "producers": {"CPU 50%"}}}, KeptUp: true},
		{LatencyResult: LatencyResult{Mode: modeRiverDirect, Rate: 200, Achieved: 200, EndToEnd: sum(0.6, 2),
			Warmup: "1s", WarmupEvents: 200, WarmupEndToEnd: &Summary{Count: 200, P50: 0.9, Max: 30}}, KeptUp: true},
		{LatencyResult: LatencyResult{Mode: modeFloor, Rate: 200, Achieved: 200, Handoff: sum(0.5, 1), EndToEnd: sum(1.1, 3)}, KeptUp: true},
		{LatencyResult: LatencyResult{Mode: modeNotify, Rate: 1000, Achieved: 700, NotSent: 12, DrainSeconds: -1, Handoff: sum(3, 90), EndToEnd: sum(4, 120),
			Segments: []Segment{{Name: segClaim, P50: 1, P99: 5}}}},
		{LatencyResult: LatencyResult{Mode: modeRiverDirect, Rate: 1000, Achieved: 1000, EndToEnd: sum(1.2, 8)}, KeptUp: true},
		{LatencyResult: LatencyResult{Mode: modeNotify, Rate: 4000}, Skipped: "did not keep up at 1000 ev/s"},
	}}
	if got := r.firstFailure(modeNotify); got != 1000 {
		t.Errorf("firstFailure(notify) = %d, want 1000", got)
	}
	if got := r.firstFailure(modeRiverDirect); got != 0 {
		t.Errorf("firstFailure(river-direct) = %d, want 0", got)
	}
	var b strings.Builder
	ratesMarkdown(&b, r)
	md := b.String()
	for _, want := range []string{
		"| 1000 | notify | 700 (12 not sent) | – | did not drain | **no** | 3.00 / 90.00 / 90.00 | 4.00 / 120.00 / 120.00 |",
		"| 4000 | notify | | | | not run: did not keep up at 1000 ev/s | | |",
		"| 1000 | notify | 1.00 / 5.00 | – | – | – |",
		"- 200 ev/s, notify: producers: CPU 50%; workers: IO:WALSync 20%",
		"| 200 | relay-floor | 200 |",
		"Percentiles leave out each run's first 1s",
		"river-direct at 200 ev/s: 200 events, p50 0.90, max 30.00",
		keepUpRule,
	} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}
	goals := map[string]Goal{}
	for _, g := range rateGoals(r) {
		goals[g.Name] = g
	}
	for name, want := range map[string]bool{
		"rates, 200 ev/s: end-to-end p99 vs river-direct":  true,  // 4 vs 2 ms: 2×
		"rates, 200 ev/s: end-to-end p50 vs river-direct":  true,  // +0.8 ms
		"rates, 1000 ev/s: end-to-end p99 vs river-direct": false, // 120 vs 8 ms
		"rates, 1000 ev/s: handoff p99":                    false, // 90 ms
		"rates, 4000 ev/s: end-to-end p99 vs river-direct": false, // not run
		"rates, 4000 ev/s: handoff p99":                    false,
	} {
		g, ok := goals[name]
		if !ok || g.Pass != want {
			t.Errorf("goal %q: %+v (present %v), want pass %v", name, g, ok, want)
		}
	}
	// The floor's figure beside the outbox's, where the floor ran.
	for name, want := range map[string]string{
		"rates, 200 ev/s: end-to-end p99 vs river-direct":  "2.0× (4.00 vs 2.00 ms); relay-floor 1.5×",
		"rates, 200 ev/s: end-to-end p50 vs river-direct":  "+0.80 ms (1.40 vs 0.60 ms); relay-floor +0.50 ms",
		"rates, 1000 ev/s: end-to-end p99 vs river-direct": "15.0× (120.00 vs 8.00 ms)",
	} {
		if got := goals[name].Measured; got != want {
			t.Errorf("goal %q measured %q, want %q", name, got, want)
		}
	}
	path := filepath.Join(t.TempDir(), "latency_vs_rate.png")
	if err := ratesPlot(r, path); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
		t.Fatalf("plot: %v", err)
	}
}
