package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
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

// TestChainFloor runs the ordering scenario's floor of one key against a
// real Postgres: every job of the chain runs once, in position order,
// each after the previous one ended, and ends completed in River's table.
func TestChainFloor(t *testing.T) {
	t.Parallel()
	ctx, e := testEnv(t)
	const n = 60
	r, runs, err := chainFloorRun(ctx, e, "chain_floor_test", n, 4)
	if err != nil {
		t.Fatal(err)
	}
	if r.Events != n || r.Seconds <= 0 || r.PerSecond <= 0 {
		t.Fatalf("run = %+v", r)
	}
	chain := runs["chain"]
	if len(chain) != n {
		t.Fatalf("%d runs, want %d", len(chain), n)
	}
	for i, run := range chain {
		if run.id != int64(i) {
			t.Fatalf("run %d was position %d", i, run.id)
		}
	}
	if v := violations(runs); v != 0 {
		t.Fatalf("%d order violations", v)
	}
	if g := gaps(runs, time.Time{}); g == nil || g.Count != n-1 {
		t.Fatalf("gaps = %+v, want %d", g, n-1)
	}
	p, err := e.pool(ctx, "chain_floor_test", 2, "chain-floor-test")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var completed, positions int
	if err := p.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'completed'), count(DISTINCT (args->>'pos')::int)
		FROM river_job WHERE kind = 'bench_chain_floor'`).Scan(&completed, &positions); err != nil {
		t.Fatal(err)
	}
	if completed != n || positions != n {
		t.Fatalf("%d completed jobs at %d positions, want %d", completed, positions, n)
	}
}

// TestOrderingMarkdownFloor renders the floor beside the hot key, with
// their difference.
func TestOrderingMarkdownFloor(t *testing.T) {
	t.Parallel()
	r := &OrderingResults{
		Keys: 10, PerKey: 10, Hot: 100, Workers: 4,
		HotPerEventMs: 1.5, Gap: &Summary{P50: 1.2, P99: 4, Count: 99},
		GapAfterHandoff: &Summary{P50: 1.1, P99: 3, Count: 50},
		FloorPerEventMs: 1.4, FloorGap: &Summary{P50: 1.1, P99: 2.5, Count: 99},
	}
	md := orderingMarkdown(r)
	for _, want := range []string{
		"Floor of one key (a River chain",
		"1.400 ms per event",
		"Hot key minus the floor: +0.100 ms per event; next job's start +0.10 ms at p50, +1.50 ms at p99 (+0.50 ms after the last handoff).",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}
}

// TestOrderingGoals checks issue 11's figures against a run: the ratio of
// many keys needs both drains, the hot key's goals carry the floor.
func TestOrderingGoals(t *testing.T) {
	t.Parallel()
	r := &OrderingResults{
		Keys: 10000, PerKey: 10,
		Runs: []OrderingRun{
			{Mode: ordUnordered, PerSecond: 6000, Ratio: 1},
			{Mode: ordKeys, PerSecond: 2880, Ratio: 0.48},
			{Mode: ordHot, PerSecond: 600, Ratio: 0.1, Violations: 0},
		},
		HotPerEventMs: 1.6, Gap: &Summary{P99: 5.2, Count: 10}, GapAfterHandoff: &Summary{P99: 3.1, Count: 5},
		FloorPerEventMs: 1.5, FloorGap: &Summary{P99: 2.6, Count: 10},
		UnorderedBase: 6000,
	}
	got := map[string]Goal{}
	for _, g := range orderingGoals(r) {
		got[g.Name] = g
	}
	want := map[string]struct {
		measured string
		pass     bool
	}{
		"ordering: order violations":              {"0", true},
		"ordering: 10000 keys × 10 vs unordered":  {"0.48× (2880 vs 6000 ev/s)", false},
		"ordering: hot key, per event":            {"1.60 ms; floor 1.50 ms", true},
		"ordering: hot key, next job's start p99": {"5.20 ms (3.10 ms after the last handoff); floor 2.60 ms", false},
	}
	if len(got) != len(want) {
		t.Fatalf("goals %v, want %d", got, len(want))
	}
	for name, w := range want {
		g, ok := got[name]
		if !ok || g.Measured != w.measured || g.Pass != w.pass {
			t.Errorf("%s = %+v, want measured %q pass %v", name, g, w.measured, w.pass)
		}
	}
	// The unordered drain again after the many-keys one: the ratio is
	// over the mean of both.
	two := *r
	two.Runs = slices.Insert(slices.Clone(r.Runs), 2, OrderingRun{Mode: ordUnorderedAgain, PerSecond: 5000})
	two.UnorderedBase = 5500
	two.Runs[1].Ratio = 2880.0 / 5500
	var keys Goal
	for _, g := range orderingGoals(&two) {
		if g.Name == "ordering: 10000 keys × 10 vs unordered" {
			keys = g
		}
	}
	if want := "0.52× (2880 vs 5500 ev/s; the mean of unordered 6000 before and 5000 after)"; keys.Measured != want || !keys.Pass {
		t.Errorf("many keys with the unordered drain on both sides = %+v, want measured %q, pass", keys, want)
	}

	r.Runs[2].Violations = 3
	r.Runs = r.Runs[1:] // no unordered drain: no ratio
	got = map[string]Goal{}
	for _, g := range orderingGoals(r) {
		got[g.Name] = g
	}
	if _, ok := got["ordering: 10000 keys × 10 vs unordered"]; ok {
		t.Error("a ratio without the unordered drain")
	}
	if v := got["ordering: order violations"]; v.Pass || v.Measured != "3" {
		t.Errorf("violations goal %+v, want 3, failed", v)
	}
}

// TestAdjacentUnordered: each ordered drain's ratio divides by the
// unordered drains next to it, the many-keys one by the mean of the one
// before and the one after; a run with none next to it, and an unordered
// drain itself, by the mean of all.
func TestAdjacentUnordered(t *testing.T) {
	t.Parallel()
	runs := []OrderingRun{
		{Mode: ordNoTriggers, PerSecond: 1},
		{Mode: ordUnordered, PerSecond: 6000},
		{Mode: ordKeys, PerSecond: 1},
		{Mode: ordUnorderedAgain, PerSecond: 4000},
		{Mode: ordHot, PerSecond: 1},
		{Mode: ordChainFloor, PerSecond: 1},
	}
	for i, want := range []float64{6000, 5000, 5000, 5000, 4000, 5000} {
		if got := adjacentUnordered(runs, i, 5000); got != want {
			t.Errorf("%s: baseline %v, want %v", runs[i].Mode, got, want)
		}
	}
}
