package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Peers: other job queues run beside the outbox in the rates scenario.
const (
	peerGraphile = "graphile"
	modeGraphile = "graphile-worker"
	// graphileConcurrency is the peer's worker concurrency (its jobs run at
	// once; graphile-worker's default is 1).
	graphileConcurrency = 16
)

// graphilePeer runs bench/peers/graphile/bench.js with Node.
type graphilePeer struct {
	dir  string
	node string
}

// prepareGraphile installs the peer (scripts/install-node-peer.sh: Node
// from Debian's packages when missing, then npm ci). When it cannot, it
// returns nil and a note saying why: the peer is skipped, the suite goes
// on.
func prepareGraphile(ctx context.Context, o *Options) (*graphilePeer, string) {
	repo, err := filepath.Abs(o.Repo)
	if err != nil {
		return nil, "graphile-worker skipped: " + err.Error()
	}
	script := filepath.Join(repo, "scripts", "install-node-peer.sh")
	logf("peer graphile: %s", script)
	cmd := exec.CommandContext(ctx, "bash", script)
	var stderr bytes.Buffer
	cmd.Stdout = os.Stderr
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		note := fmt.Sprintf("graphile-worker skipped: %s failed (%v): %s", script, err, msg)
		logf("SKIP %s", note)
		return nil, note
	}
	_, _ = os.Stderr.Write(stderr.Bytes())
	node, err := exec.LookPath("node")
	if err != nil {
		note := "graphile-worker skipped: node is not on PATH"
		logf("SKIP %s", note)
		return nil, note
	}
	return &graphilePeer{dir: filepath.Join(repo, "bench", "peers", "graphile"), node: node}, ""
}

// graphileOut is what bench.js prints.
type graphileOut struct {
	Version      string  `json:"version"`
	Node         string  `json:"node"`
	Events       int     `json:"events"`
	Published    int     `json:"published"`
	Worked       int     `json:"worked"`
	Achieved     float64 `json:"achieved_rate"`
	NotSent      int     `json:"not_sent"`
	DrainSeconds float64 `json:"drain_seconds"`
	Clamped      int     `json:"clamped_negative"`
	WarmupEvents int     `json:"warmup_events"`
	WarmupE2E    []int64 `json:"warmup_end_to_end_us"`
	EndToEnd     []int64 `json:"end_to_end_us"`
	Fetch        []int64 `json:"commit_to_fetch_us"`
	Work         []int64 `json:"fetch_to_work_us"`
	Tx           []int64 `json:"producer_tx_us"`
	Lag          []int64 `json:"producer_lag_us"`
}

// run offers rate to Graphile Worker in its own schema of the bench
// database for warmup and then d, like latencyMode does to the outbox's
// modes (the warmup's events are kept out of the percentiles).
func (g *graphilePeer) run(ctx context.Context, e *env, schema string, rate int, d, warmup, drainWait time.Duration) (LatencyResult, error) {
	res := LatencyResult{Mode: modeGraphile, Rate: rate, Duration: d.String()}
	rctx, cancel := context.WithTimeout(ctx, warmup+d+drainWait+2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(rctx, g.node, "bench.js",
		"--url", withParams(e.dbURL, map[string]string{"application_name": "bench-graphile"}),
		"--schema", schema,
		"--rate", strconv.Itoa(rate),
		"--duration-ms", strconv.FormatInt(d.Milliseconds(), 10),
		"--warmup-ms", strconv.FormatInt(warmup.Milliseconds(), 10),
		"--producers", strconv.Itoa(rateProducers(rate)),
		"--concurrency", strconv.Itoa(graphileConcurrency),
		"--drain-ms", strconv.FormatInt(drainWait.Milliseconds(), 10),
		"--cutoff-ms", strconv.FormatInt(producerCutoff(d).Milliseconds(), 10),
	)
	cmd.Dir = g.dir
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = os.Stderr
	// Its producers and workers share one application_name: one role.
	sampler := startRoleSampler(ctx, e.admin, 20*time.Millisecond, map[string]string{"bench-graphile": "graphile"})
	err := cmd.Run()
	res.Waits = sampler.stop()
	if err != nil {
		return res, fmt.Errorf("node bench.js: %w", err)
	}
	var out graphileOut
	if err := json.Unmarshal(stdout.Bytes(), &out); err != nil {
		return res, fmt.Errorf("node bench.js output: %w", err)
	}
	res.Events, res.Published, res.Worked = out.Events, out.Published, out.Worked
	res.Achieved, res.DrainSeconds, res.Clamped, res.NotSent = out.Achieved, out.DrainSeconds, out.Clamped, out.NotSent
	res.Peer = fmt.Sprintf("graphile-worker %s on Node %s, concurrency %d", out.Version, out.Node, graphileConcurrency)
	res.EndToEnd = summarizeUS(out.EndToEnd)
	if out.WarmupEvents > 0 {
		res.Warmup, res.WarmupEvents = warmup.String(), out.WarmupEvents
		if res.WarmupEndToEnd = summarizeUS(out.WarmupE2E); res.WarmupEndToEnd != nil {
			res.WarmupEndToEnd.CDF = nil
		}
	}
	res.Commit = summarizeUS(out.Tx)
	res.ProducerLag = summarizeUS(out.Lag)
	for _, s := range []struct {
		name, from, to string
		v              []int64
	}{
		{segFetch, "producer commit", "job locked_at (fetch)", out.Fetch},
		{segWork, "job locked_at", "task start", out.Work},
	} {
		if sum := summarizeUS(s.v); sum != nil {
			res.Segments = append(res.Segments, Segment{Name: s.name, From: s.from, To: s.to, Count: sum.Count, P50: sum.P50, P99: sum.P99, Wall: true})
		}
	}
	return res, nil
}

// summarizeUS summarizes microsecond samples (without the CDF).
func summarizeUS(v []int64) *Summary {
	h := newHist()
	for _, us := range v {
		record(h, time.Duration(us)*time.Microsecond)
	}
	s := summarize(h)
	if s != nil {
		s.CDF = nil
	}
	return s
}
