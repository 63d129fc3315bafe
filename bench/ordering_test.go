package main

import (
	"os"
	"path/filepath"
	"testing"
)

// TestOrderingPlotWithoutHotKey draws the ordering plot of a run without
// the hot key (-ordering-modes keys): the empty CDF's log axis once
// panicked for want of a positive range.
func TestOrderingPlotWithoutHotKey(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "ordering.png")
	r := &OrderingResults{Keys: 10, PerKey: 10, Runs: []OrderingRun{{Mode: "ordered, many keys", Events: 100, Seconds: 1, PerSecond: 100}}}
	if err := orderingPlot(r, path); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() == 0 {
		t.Fatal("empty plot")
	}
}
