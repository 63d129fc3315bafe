package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestSoakClocks checks the per-event bookkeeping of the soak: reads that
// come before the producer recorded the commit count once it does, an
// event is forgotten once handed off and worked, and the handoff read
// starts at the lowest id not yet seen handed off.
func TestSoakClocks(t *testing.T) {
	t.Parallel()
	c := newSoakClocks()
	t0 := time.Now()
	c.committed(1, t0)
	c.committed(2, t0)
	if !c.done(workedRead, 3, t0.Add(4*time.Millisecond)) {
		t.Fatal("an early read was refused")
	}
	c.committed(3, t0)
	if got := c.firstUnhanded(0); got != 1 {
		t.Errorf("firstUnhanded = %d, want 1", got)
	}
	c.done(handedRead, 1, t0.Add(time.Millisecond))
	c.done(workedRead, 1, t0.Add(2*time.Millisecond))
	if c.done(workedRead, 1, t0.Add(3*time.Millisecond)) {
		t.Error("a second run of a job counted")
	}
	if got := c.firstUnhanded(1); got != 2 {
		t.Errorf("firstUnhanded = %d, want 2", got)
	}
	c.done(handedRead, 2, t0.Add(time.Millisecond))
	c.done(handedRead, 3, t0.Add(time.Millisecond))
	if got := c.firstUnhanded(3); got != 4 {
		t.Errorf("firstUnhanded with everything handed = %d, want 4", got)
	}
	if len(c.commit) != 1 || c.handed != 3 || c.workH.TotalCount() != 2 {
		t.Errorf("left %d commits (want event 2's), %d handed, %d worked", len(c.commit), c.handed, c.workH.TotalCount())
	}
	if p := c.workH.ValueAtQuantile(100); p < 3900 || p > 4100 {
		t.Errorf("the early worker read counts %d µs, want 4000", p)
	}
}

// TestSoakReport renders a soak's table and plot from made-up samples.
func TestSoakReport(t *testing.T) {
	t.Parallel()
	tb := func(mb int64) map[string]SoakTable {
		return map[string]SoakTable{
			"outbox_event": {TotalBytes: mb << 20, HeapBytes: mb << 19, IndexBytes: map[string]int64{"outbox_event_pkey": 1 << 20}, DeadTuples: 10},
			"river_job":    {TotalBytes: 2 * mb << 20, IndexBytes: map[string]int64{"river_job_pkey": 2 << 20}, Autovacuum: 1},
		}
	}
	s := &SoakResults{Rate: 800, Duration: "20s", Interval: "10s", Indexes: []string{"outbox_event_pkey", "river_job_pkey"},
		Samples: []SoakSample{{At: 10, HandoffP99: 3, EndToEndP99: 5, Tables: tb(1)}, {At: 20, HandoffP99: 4, EndToEndP99: 6, Tables: tb(2)}}}
	var b strings.Builder
	soakMarkdown(&b, s)
	for _, want := range []string{"| 20 |", "| outbox_event_pkey | 1.00 | 1.00 | 1.00 |", "| river_job_pkey | 2.00 |"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, b.String())
		}
	}
	path := filepath.Join(t.TempDir(), "soak.png")
	if err := soakPlot(s, path); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
		t.Fatalf("no plot: %v", err)
	}
}
