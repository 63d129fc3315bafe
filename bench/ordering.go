package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/dispatcher"
	outboxriver "github.com/outboxhq/outbox/river"
)

// OrderingResults is the per-key ordering scenario (issue 11): backlogs of
// the same size drained by the same dispatcher and River workers, with
// and without ordering keys, and one hot key.
type OrderingResults struct {
	Keys    int `json:"keys"`
	PerKey  int `json:"events_per_key"`
	Hot     int `json:"hot_key_events"`
	Workers int `json:"river_workers"`
	// Runs are the drains, in the order they ran: the unordered baseline
	// before the ordered modes and, when the many-keys drain ran, again
	// right after it.
	Runs []OrderingRun `json:"runs"`
	// UnorderedBase is the mean rate of the unordered drains (one, or the
	// two around the many-keys drain). Each Ratio divides by the unordered
	// drains next to its run (adjacentUnordered): the many-keys one by the
	// mean of the drain before it and the one after it. The machine's speed
	// drifts within a run (this 2-core virtual machine's unordered drain ran
	// anywhere from 4,300 to 7,300 events/s on one morning), and a baseline
	// taken only before the ordered drain carries that drift into the
	// ratio; the mean of one before and one after cancels a steady drift.
	UnorderedBase float64 `json:"unordered_base_events_per_second"`
	// Gap is, for the hot key, the time from the end of one job's Work to
	// the start of the next job's Work (the release path: completion
	// transaction, trigger, NOTIFY, River's fetch).
	Gap *Summary `json:"hot_key_next_job_start"`
	// GapAfterHandoff is Gap for the jobs that ended after the last event
	// was handed off: without the handoff's transactions, which lock the
	// key's row to queue its jobs, beside the releases.
	GapAfterHandoff *Summary `json:"hot_key_next_job_start_after_handoff"`
	// HotPerEventMs is the hot key's drain time per event (its jobs do
	// nothing, so this is the whole cost of one event's turn).
	HotPerEventMs float64 `json:"hot_key_ms_per_event"`
	// FloorPerEventMs and FloorGap are HotPerEventMs and Gap of the floor
	// of one key (ordChainFloor): a River chain of Hot jobs,
	// each inserting its successor as it completes.
	FloorPerEventMs float64  `json:"floor_ms_per_event,omitempty"`
	FloorGap        *Summary `json:"floor_next_job_start,omitempty"`
}

// OrderingRun is one backlog, from the start of the dispatcher and the
// workers to the last job's Work.
type OrderingRun struct {
	Mode      string  `json:"mode"`
	Events    int     `json:"events"`
	Seconds   float64 `json:"seconds"`
	PerSecond float64 `json:"events_per_second"`
	// Ratio is PerSecond over the unordered baseline's.
	Ratio float64 `json:"ratio_to_unordered"`
	// ServerCPUms and BenchCPUms are the CPU time per 1,000 events of the
	// backends connected to the bench's database and of this process (the
	// dispatcher, the River workers and the bench's own sampling), over the
	// drain: a cost that the machine's other load changes far less than
	// the seconds. The process's idle cost grows with the seconds.
	ServerCPUms float64 `json:"server_cpu_ms_per_1k"`
	BenchCPUms  float64 `json:"bench_cpu_ms_per_1k"`
	// HandoffSeconds is the time to the commit of the batch that handed off
	// the last event (the dispatcher's OnBatch).
	HandoffSeconds float64 `json:"handoff_seconds"`
	// Violations counts jobs of one key that started out of order or
	// before the previous one ended (must be 0 for ordered modes).
	Violations int `json:"order_violations"`
	// started is when the dispatcher and the workers started.
	started time.Time
}

// Ordering modes.
const (
	ordNoTriggers = "unordered, ordering triggers dropped"
	ordUnordered  = "unordered"
	// ordUnorderedAgain is the unordered drain run again right after the
	// many-keys one, for the baseline's mean (UnorderedBase).
	ordUnorderedAgain = "unordered, again after many keys"
	ordKeys           = "ordered, many keys"
	ordHot            = "ordered, one hot key"
)

// orderWorker records when each job's Work starts and ends, by key and
// position.
type orderWorker struct {
	river.WorkerDefaults[outboxriver.EventArgs]
	runLog
}

type orderRun struct {
	id         int64
	start, end time.Time
}

// runLog is what the ordering scenario's workers record: each job's Work,
// by key, in the order they began, and how many jobs were worked.
type runLog struct {
	mu     sync.Mutex
	runs   map[string][]orderRun
	worked atomic.Int64
}

func (l *runLog) add(key string, run orderRun) {
	l.mu.Lock()
	if l.runs == nil {
		l.runs = map[string][]orderRun{}
	}
	l.runs[key] = append(l.runs[key], run)
	l.mu.Unlock()
}

// finish sets r's CPU per 1,000 events since srv0 and self0 (backendCPU
// of p, selfCPUSeconds) and its time from start to the last job's start,
// and returns the runs.
func (l *runLog) finish(ctx context.Context, p *pgxpool.Pool, r *OrderingRun, srv0 map[int]float64, self0 float64, start time.Time) map[string][]orderRun {
	srv1, self1 := backendCPU(ctx, p), selfCPUSeconds()
	r.ServerCPUms = backendCPUSince(srv0, srv1) * 1e6 / float64(r.Events)
	r.BenchCPUms = (self1 - self0) * 1e6 / float64(r.Events)
	l.mu.Lock()
	defer l.mu.Unlock()
	var last time.Time
	for _, runs := range l.runs {
		for _, run := range runs {
			if run.start.After(last) {
				last = run.start
			}
		}
	}
	r.Seconds = last.Sub(start).Seconds()
	r.PerSecond = float64(r.Events) / r.Seconds
	return l.runs
}

// orderingModeNames are the modes -ordering-modes selects from, in the
// order the scenario runs them.
var orderingModeNames = []string{"notriggers", "unordered", "keys", "hot", "floor"}

func (w *orderWorker) Work(_ context.Context, job *river.Job[outboxriver.EventArgs]) error {
	start := time.Now()
	key := ""
	if job.Args.OrderingKey != nil {
		key = *job.Args.OrderingKey
	}
	w.add(key, orderRun{id: job.Args.EventID, start: start, end: time.Now()})
	w.worked.Add(1)
	return nil
}

func runOrdering(ctx context.Context, e *env, o *Options) (*OrderingResults, error) {
	res := &OrderingResults{Keys: 10_000, PerKey: 10, Hot: 10_000, Workers: 50}
	if o.Quick {
		res.Keys, res.Hot = 1_000, 1_000
	}
	if o.OrderingKeys > 0 {
		res.Keys, res.Hot = o.OrderingKeys, o.OrderingKeys
	}
	n := res.Keys * res.PerKey
	type spec struct {
		name       string // for -ordering-modes
		mode       string
		events     int
		keys       int // 0: no ordering key
		noTriggers bool
	}
	// The order of orderingModeNames.
	specs := []spec{
		{"notriggers", ordNoTriggers, n, 0, true},
		{"unordered", ordUnordered, n, 0, false},
		{"keys", ordKeys, n, res.Keys, false},
		{"hot", ordHot, res.Hot, 1, false},
		{"floor", ordChainFloor, res.Hot, 1, false},
	}
	selected := func(name string) bool { return len(o.OrderingModes) == 0 || slices.Contains(o.OrderingModes, name) }
	if selected("unordered") && selected("keys") {
		// The unordered drain again, right after the many-keys one: the
		// baseline is the mean of the two (UnorderedBase).
		u := slices.IndexFunc(specs, func(s spec) bool { return s.name == "unordered" })
		k := slices.IndexFunc(specs, func(s spec) bool { return s.name == "keys" })
		again := specs[u]
		again.mode = ordUnorderedAgain
		specs = slices.Insert(specs, k+1, again)
	}
	var unordered []float64
	prev := ""
	for i, s := range specs {
		if !selected(s.name) {
			continue
		}
		// Each drain starts from the same state: without the previous
		// drain's tables, their autovacuum or its dirty buffers.
		if err := settle(ctx, e, prev); err != nil {
			return nil, err
		}
		schema := fmt.Sprintf("ordering_%d", i)
		prev = schema
		var (
			r    OrderingRun
			runs map[string][]orderRun
			err  error
		)
		if s.mode == ordChainFloor {
			r, runs, err = chainFloorRun(ctx, e, schema, s.events, res.Workers)
		} else {
			r, runs, err = orderingRun(ctx, e, schema, s.events, s.keys, s.noTriggers, res.Workers)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.mode, err)
		}
		r.Mode = s.mode
		if isUnorderedMode(s.mode) {
			unordered = append(unordered, r.PerSecond)
		}
		if s.keys > 0 {
			r.Violations = violations(runs)
		}
		switch s.mode {
		case ordHot:
			res.HotPerEventMs = r.Seconds * 1000 / float64(r.Events)
			res.Gap = gaps(runs, time.Time{})
			res.GapAfterHandoff = gaps(runs, r.started.Add(time.Duration(r.HandoffSeconds*float64(time.Second))))
		case ordChainFloor:
			res.FloorPerEventMs = r.Seconds * 1000 / float64(r.Events)
			res.FloorGap = gaps(runs, time.Time{})
		}
		logf("ordering: %s: %d events in %.2f s (handed off in %.2f s) = %.0f ev/s, %d order violations; CPU per 1k events: postgres %.0f ms, dispatcher+workers %.0f ms",
			s.mode, r.Events, r.Seconds, r.HandoffSeconds, r.PerSecond, r.Violations, r.ServerCPUms, r.BenchCPUms)
		res.Runs = append(res.Runs, r)
	}
	if len(unordered) > 0 {
		var sum float64
		for _, v := range unordered {
			sum += v
		}
		res.UnorderedBase = sum / float64(len(unordered))
		for i := range res.Runs {
			res.Runs[i].Ratio = res.Runs[i].PerSecond / adjacentUnordered(res.Runs, i, res.UnorderedBase)
		}
		for _, run := range res.Runs {
			of := "the unordered drains next to it"
			if isUnorderedMode(run.Mode) {
				of = "the unordered drains' mean"
			}
			logf("ordering: %s: %.2f× %s (the mean: %.0f ev/s)", run.Mode, run.Ratio, of, res.UnorderedBase)
		}
	}
	if res.Gap != nil {
		logf("ordering: hot key: %.3f ms per event; next job starts p50 %.2f ms p99 %.2f ms after the previous one ends",
			res.HotPerEventMs, res.Gap.P50, res.Gap.P99)
	}
	if res.FloorGap != nil {
		logf("ordering: floor of one key: %.3f ms per event; next job starts p50 %.2f ms p99 %.2f ms after the previous one ends",
			res.FloorPerEventMs, res.FloorGap.P50, res.FloorGap.P99)
	}
	return res, nil
}

// isUnorderedMode reports whether mode is one of the unordered drains, the
// baseline of the ratios.
func isUnorderedMode(mode string) bool {
	return mode == ordUnordered || mode == ordUnorderedAgain
}

// adjacentUnordered is the baseline of runs[i]'s ratio: the mean of the
// unordered drains run right before and right after it (the many-keys
// drain has one on each side, the drain without triggers one after it, the
// hot key one before it), else base (the mean of all of them; for an
// unordered drain itself, so that its ratio shows the spread).
func adjacentUnordered(runs []OrderingRun, i int, base float64) float64 {
	isUnordered := func(j int) bool {
		return j >= 0 && j < len(runs) && isUnorderedMode(runs[j].Mode)
	}
	if isUnordered(i) {
		return base
	}
	var sum float64
	n := 0
	for _, j := range []int{i - 1, i + 1} {
		if isUnordered(j) {
			sum += runs[j].PerSecond
			n++
		}
	}
	if n == 0 {
		return base
	}
	return sum / float64(n)
}

// settle drops the schema of the drain before, if any (its backlog's
// tables, and with them any autovacuum of theirs), vacuums the catalogs
// the drop left dead rows in, then checkpoints and waits, for up to a
// minute, until no autovacuum worker runs in the cluster: so that every
// drain of the scenario starts from the same state. Measured on
// 2026-12-03 without it, the unordered drain run right after the many-keys
// drain was slower than the one before it in five runs of seven, by up to
// 45 %, and used more Postgres CPU per event. Dropping a migrated schema
// deletes thousands of catalog rows (its tables, columns, indexes,
// functions, triggers), and without the VACUUM autovacuum came for the
// catalogs during the next drain (seen on 2026-12-04 during the hot key's:
// an ANALYZE of pg_attribute). A server that refuses the checkpoint (a
// role without pg_checkpoint) is only not checkpointed; a role that does
// not own the catalogs only does not vacuum them.
func settle(ctx context.Context, e *env, schema string) error {
	if schema != "" {
		if _, err := e.admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		if _, err := e.admin.Exec(ctx, `VACUUM (ANALYZE) pg_catalog.pg_class, pg_catalog.pg_attribute, pg_catalog.pg_depend,
			pg_catalog.pg_type, pg_catalog.pg_index, pg_catalog.pg_constraint, pg_catalog.pg_trigger, pg_catalog.pg_proc,
			pg_catalog.pg_attrdef, pg_catalog.pg_statistic, pg_catalog.pg_description, pg_catalog.pg_sequence`); err != nil {
			logf("ordering: no vacuum of the catalogs between drains: %v", err)
		}
	}
	if _, err := e.admin.Exec(ctx, "CHECKPOINT"); err != nil {
		logf("ordering: no checkpoint between drains: %v", err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		var busy bool
		if err := e.admin.QueryRow(ctx, `
			SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE backend_type = 'autovacuum worker')`).Scan(&busy); err != nil {
			return fmt.Errorf("wait for autovacuum: %w", err)
		}
		if !busy {
			return nil
		}
		if time.Now().After(deadline) {
			logf("ordering: autovacuum still running after a minute; the next drain starts beside it")
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// orderingRun loads a backlog of n events (keyed round-robin over keys
// keys, or without keys) into a fresh schema, then starts the workers and
// the dispatcher and times the drain to the last job's start.
func orderingRun(ctx context.Context, e *env, schema string, n, keys int, noTriggers bool, workers int) (OrderingRun, map[string][]orderRun, error) {
	r := OrderingRun{Events: n}
	p, err := e.migrated(ctx, schema, 24)
	if err != nil {
		return r, nil, err
	}
	defer p.Close()
	if noTriggers {
		if _, err := p.Exec(ctx, `
			DROP TRIGGER outbox_ordering_enqueue ON river_job;
			DROP TRIGGER outbox_ordering_settled ON river_job;
			DROP TRIGGER outbox_event_ordering ON outbox_event`); err != nil {
			return r, nil, err
		}
	}
	if err := orderedBacklog(ctx, p, n, keys); err != nil {
		return r, nil, err
	}
	if _, err := p.Exec(ctx, `VACUUM ANALYZE outbox_event`); err != nil {
		return r, nil, err
	}

	w := &orderWorker{}
	ws := river.NewWorkers()
	river.AddWorker(ws, w)
	wp, err := e.pool(ctx, schema, int32(workers/2+8), appWorkers)
	if err != nil {
		return r, nil, err
	}
	defer wp.Close()
	ow, err := newOrderingWorkers(e, p, wp, ws, workers)
	if err != nil {
		return r, nil, err
	}
	srv0, self0 := backendCPU(ctx, p), selfCPUSeconds()
	start := time.Now()
	r.started = start
	if err := ow.start(ctx); err != nil {
		return r, nil, err
	}
	defer ow.stop(ctx)
	// The handoff's end is when the dispatcher has handed off the n-th
	// event (OnBatch after each batch's commit): counted in this process,
	// not probed from the database beside the drain it measures.
	var (
		handed   atomic.Int64
		handedAt atomic.Int64 // nanoseconds since start; 0 until all are handed off
		allIn    = make(chan struct{})
	)
	d, err := dispatcher.New(p, dispatcher.Config{
		Routes: e.routes, PollInterval: time.Second, Logger: e.quiet,
		OnBatch: func(res claim.Result) {
			// The swap succeeds once: the batch that reaches n closes allIn.
			if handed.Add(int64(res.Done)) >= int64(n) && handedAt.CompareAndSwap(0, int64(time.Since(start))) {
				close(allIn)
			}
		},
	})
	if err != nil {
		return r, nil, err
	}
	if err := d.Start(ctx); err != nil {
		return r, nil, err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = d.Stop(sctx)
	}()
	if err := waitWorked(ctx, &w.worked, n, nil); err != nil {
		return r, nil, err
	}
	// Every job worked means every event handed off (one job each), but
	// the last batch's OnBatch runs just after its commit, which a worker
	// may beat: wait for it a little. A count still short of n is a fault
	// of the count, not a handoff time of 0.
	select {
	case <-allIn:
	case <-time.After(10 * time.Second):
		return r, nil, fmt.Errorf("all %d jobs worked, but the dispatcher reported %d events handed off", n, handed.Load())
	case <-ctx.Done():
		return r, nil, ctx.Err()
	}
	r.HandoffSeconds = time.Duration(handedAt.Load()).Seconds()
	return r, w.finish(ctx, p, &r, srv0, self0, start), nil
}

// orderingWorkers are the River workers of the ordering scenario's
// drains and, beside them, River's GIN cleaner.
type orderingWorkers struct {
	rc *river.Client[pgx.Tx]
	gc *outboxriver.GINCleaner
}

// newOrderingWorkers makes a River client on wp with workers workers of
// the bench queue (outboxriver.WorkerConfig: the ordered completion
// middleware, outboxd's fetch settings) and a GIN cleaner on p; start
// starts them.
func newOrderingWorkers(e *env, p, wp *pgxpool.Pool, ws *river.Workers, workers int) (*orderingWorkers, error) {
	cfg := outboxriver.WorkerConfig(ws, map[string]int{benchQueue: workers}, outboxriver.WorkerLatency{})
	cfg.Logger = e.quiet
	rc, err := river.NewClient(riverpgxv5.New(wp), cfg)
	if err != nil {
		return nil, err
	}
	// outboxd merges River's GIN pending lists beside its dispatcher
	// (OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS), as the latency scenario's
	// outbox modes do: without it a statement that writes river_job
	// stalls for tens of milliseconds whenever a list fills.
	gc, err := outboxriver.NewGINCleaner(p, outboxriver.GINCleanerConfig{})
	if err != nil {
		return nil, err
	}
	return &orderingWorkers{rc: rc, gc: gc}, nil
}

// start starts the workers, then the cleaner; on an error it stops what
// it started.
func (o *orderingWorkers) start(ctx context.Context) error {
	if err := o.rc.Start(ctx); err != nil {
		return err
	}
	if err := o.gc.Start(ctx); err != nil {
		o.stopClient(ctx)
		return err
	}
	return nil
}

// stop stops the cleaner and the workers (after a successful start).
func (o *orderingWorkers) stop(ctx context.Context) {
	_ = o.gc.Stop(context.WithoutCancel(ctx))
	o.stopClient(ctx)
}

func (o *orderingWorkers) stopClient(ctx context.Context) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	_ = o.rc.Stop(sctx)
}

// waitWorked waits, checking every 5 ms, until worked reaches n; each
// check calls tick first (when not nil), whose error ends the wait. It
// gives up after 10 minutes.
func waitWorked(ctx context.Context, worked *atomic.Int64, n int, tick func() error) error {
	limit := time.Now().Add(10 * time.Minute)
	for worked.Load() < int64(n) {
		if tick != nil {
			if err := tick(); err != nil {
				return err
			}
		}
		if time.Now().After(limit) {
			return fmt.Errorf("only %d of %d jobs worked in 10 minutes", worked.Load(), n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// orderedBacklog inserts n events, event i with key "key-<i mod keys>"
// (none when keys is 0), in transactions of at most 500 events: every
// distinct key a transaction publishes to holds one advisory lock until it
// commits, and Postgres' shared lock table holds max_locks_per_transaction
// × max_connections of them.
func orderedBacklog(ctx context.Context, p *pgxpool.Pool, n, keys int) error {
	const chunk = 500
	payload, _ := json.Marshal(map[string]any{"order_id": 12345, "amount_cents": 4200, "currency": "EUR"})
	for from := 0; from < n; from += chunk {
		to := min(n, from+chunk)
		var err error
		if keys == 0 {
			_, err = p.Exec(ctx, `INSERT INTO outbox_event (event_type, payload)
				SELECT $1, $2::jsonb FROM generate_series($3::int, $4::int - 1) g ORDER BY g`, eventType, string(payload), from, to)
		} else {
			_, err = p.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, ordering_key)
				SELECT $1, $2::jsonb, 'key-' || (g % $5::int) FROM generate_series($3::int, $4::int - 1) g ORDER BY g`, eventType, string(payload), from, to, keys)
		}
		if err != nil {
			return fmt.Errorf("backlog: %w", err)
		}
	}
	return nil
}

// violations counts, over every key, the jobs that started before the
// job of the previous event (by event id, which is the position order of
// a backlog published in order) ended, or out of order.
func violations(runs map[string][]orderRun) int {
	bad := 0
	for _, rs := range runs {
		for i := 1; i < len(rs); i++ { // in start order: appended as Work began
			if rs[i].id < rs[i-1].id || rs[i].start.Before(rs[i-1].end) {
				bad++
			}
		}
	}
	return bad
}

// gaps is the distribution of the time from one job's end to the next
// job's start, per key.
func gaps(runs map[string][]orderRun, since time.Time) *Summary {
	h := newHist()
	for _, rs := range runs {
		for i := 1; i < len(rs); i++ {
			if rs[i-1].end.After(since) {
				record(h, rs[i].start.Sub(rs[i-1].end))
			}
		}
	}
	return summarize(h)
}

// orderingGoals are issue 11's figures, for the modes this run had, each
// with the floor of one key beside the hot key's when it ran.
func orderingGoals(r *OrderingResults) []Goal {
	var g []Goal
	var keys *OrderingRun
	var unordered []string
	violations := 0
	for i := range r.Runs {
		switch r.Runs[i].Mode {
		case ordUnordered, ordUnorderedAgain:
			unordered = append(unordered, fmt.Sprintf("%.0f", r.Runs[i].PerSecond))
		case ordKeys:
			keys = &r.Runs[i]
		}
		violations += r.Runs[i].Violations
	}
	if len(r.Runs) > 0 {
		g = append(g, Goal{Name: "ordering: order violations", Target: "0", Measured: fmt.Sprint(violations), Pass: violations == 0})
	}
	if len(unordered) > 0 && keys != nil && r.UnorderedBase > 0 {
		var both string
		if len(unordered) > 1 {
			both = "; the mean of unordered " + strings.Join(unordered, " before and ") + " after"
		}
		g = append(g, Goal{
			Name: fmt.Sprintf("ordering: %d keys × %d vs unordered", r.Keys, r.PerKey), Target: "≥ 0.5×",
			Measured: fmt.Sprintf("%.2f× (%.0f vs %.0f ev/s%s)", keys.Ratio, keys.PerSecond, r.UnorderedBase, both),
			Pass:     keys.Ratio >= 0.5,
		})
	}
	floor := func(s string) string { return "; floor " + s }
	if r.Gap != nil {
		goal := Goal{Name: "ordering: hot key, per event", Target: "≤ 2 ms", Measured: fmt.Sprintf("%.2f ms", r.HotPerEventMs), Pass: r.HotPerEventMs <= 2}
		if r.FloorGap != nil {
			goal.Measured += floor(fmt.Sprintf("%.2f ms", r.FloorPerEventMs))
		}
		g = append(g, goal)
		goal = Goal{Name: "ordering: hot key, next job's start p99", Target: "≤ 5 ms", Measured: fmt.Sprintf("%.2f ms", r.Gap.P99), Pass: r.Gap.P99 <= 5}
		if a := r.GapAfterHandoff; a != nil && a.Count > 0 {
			goal.Measured += fmt.Sprintf(" (%.2f ms after the last handoff)", a.P99)
		}
		if r.FloorGap != nil {
			goal.Measured += floor(fmt.Sprintf("%.2f ms", r.FloorGap.P99))
		}
		g = append(g, goal)
	}
	return g
}

// orderingMarkdown renders the scenario.
func orderingMarkdown(r *OrderingResults) string {
	s := fmt.Sprintf("## Per-key ordering: backlogs drained by one dispatcher and %d River workers\n\n", r.Workers)
	s += fmt.Sprintf("Many keys: %d keys × %d events, interleaved. Hot key: %d events of one key. Jobs do no work.", r.Keys, r.PerKey, r.Hot)
	if r.UnorderedBase > 0 {
		s += " The rows are in the order they ran, each on a fresh schema after a checkpoint; × unordered divides by the unordered drains next to the row (for the many-keys drain, the mean of the one before it and the one after it)."
	}
	s += "\n\n"
	s += "| mode | events | seconds | events/s | × unordered | order violations | Postgres CPU ms / 1k events | dispatcher + workers CPU ms / 1k |\n| --- | --: | --: | --: | --: | --: | --: | --: |\n"
	for _, run := range r.Runs {
		s += fmt.Sprintf("| %s | %d | %.2f | %.0f | %.2f | %d | %.0f | %.0f |\n", run.Mode, run.Events, run.Seconds, run.PerSecond, run.Ratio, run.Violations, run.ServerCPUms, run.BenchCPUms)
	}
	if r.Gap != nil {
		s += fmt.Sprintf("\nHot key: %.3f ms per event. Next job's start after the previous job's end: p50 %.2f ms, p90 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.2f ms (%d gaps).\n",
			r.HotPerEventMs, r.Gap.P50, r.Gap.P90, r.Gap.P99, r.Gap.P999, r.Gap.Max, r.Gap.Count)
		if g := r.GapAfterHandoff; g != nil && g.Count > 0 {
			s += fmt.Sprintf("After the last event's handoff (no handoff locking the key's row beside the releases): p50 %.2f ms, p90 %.2f ms, p99 %.2f ms, max %.2f ms (%d gaps).\n",
				g.P50, g.P90, g.P99, g.Max, g.Count)
		}
	}
	if g := r.FloorGap; g != nil {
		s += fmt.Sprintf("\nFloor of one key (a River chain: each job completes itself and inserts its successor in one statement; no outbox): %.3f ms per event. Next job's start: p50 %.2f ms, p90 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.2f ms (%d gaps).\n",
			r.FloorPerEventMs, g.P50, g.P90, g.P99, g.P999, g.Max, g.Count)
		if r.Gap != nil {
			s += fmt.Sprintf("Hot key minus the floor: %+.3f ms per event; next job's start %+.2f ms at p50, %+.2f ms at p99",
				r.HotPerEventMs-r.FloorPerEventMs, r.Gap.P50-g.P50, r.Gap.P99-g.P99)
			if a := r.GapAfterHandoff; a != nil && a.Count > 0 {
				s += fmt.Sprintf(" (%+.2f ms after the last handoff)", a.P99-g.P99)
			}
			s += ".\n"
		}
	}
	return s + "\n"
}

// orderingPlot draws the drain rates of the modes as bars and, beside
// them, the CDF of the hot key's next-job start.
func orderingPlot(r *OrderingResults, path string) error {
	bars := plot.New()
	bars.Title.Text = "Drain with and without ordering keys"
	bars.Y.Label.Text = "events/s (to the last job's start)"
	vals := make(plotter.Values, len(r.Runs))
	names := make([]string, len(r.Runs))
	for i, run := range r.Runs {
		vals[i] = run.PerSecond
		names[i] = strings.Replace(run.Mode, ", ", "\n", 1)
	}
	b, err := plotter.NewBarChart(vals, vg.Points(40))
	if err != nil {
		return err
	}
	b.Color = plotutil.Color(0)
	bars.Add(b, plotter.NewGrid())
	bars.NominalX(names...)

	cdf := plot.New()
	cdf.Title.Text = "Hot key: next job's start after the previous job's end"
	cdf.X.Label.Text = "ms (log scale)"
	cdf.Y.Label.Text = "fraction of jobs"
	cdf.X.Scale = plot.LogScale{}
	cdf.X.Tick.Marker = plot.LogTicks{Prec: -1}
	cdf.Y.Min, cdf.Y.Max = 0, 1
	cdf.Add(plotter.NewGrid())
	lines := 0
	for i, g := range []*Summary{r.Gap, r.FloorGap} {
		if g == nil || len(g.CDF) == 0 {
			continue
		}
		pts := make(plotter.XYs, 0, len(g.CDF))
		for _, c := range g.CDF {
			pts = append(pts, plotter.XY{X: max(c[0], 0.001), Y: c[1]})
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			return err
		}
		l.Color = plotutil.Color(1 + i)
		l.Dashes = plotutil.Dashes(i)
		cdf.Add(l)
		cdf.Legend.Add([]string{"hot key", "floor (River chain)"}[i], l)
		lines++
	}
	cdf.Legend.Top, cdf.Legend.Left = false, false
	if lines == 0 {
		// No hot key gaps in this run (-ordering-modes without hot): an
		// empty axis, whose log scale needs a positive range.
		cdf.Title.Text += " (no data)"
		cdf.X.Min, cdf.X.Max = 0.1, 100
	}

	img := vgimg.New(vg.Points(1000), vg.Points(400))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Millimeter * 4, PadY: vg.Millimeter * 2, PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
	canvases := plot.Align([][]*plot.Plot{{bars, cdf}}, tiles, dc)
	bars.Draw(canvases[0][0])
	cdf.Draw(canvases[0][1])
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// backendCPU is the CPU time (user and system) so far of every backend
// connected to this bench's database, by pid.
func backendCPU(ctx context.Context, p *pgxpool.Pool) map[int]float64 {
	out := map[int]float64{}
	rows, err := p.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()`)
	if err != nil {
		return out
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return out
	}
	for _, pid := range pids {
		if s, err := procCPUSeconds(int(pid)); err == nil {
			out[int(pid)] = s
		}
	}
	return out
}

// backendCPUSince is the CPU time the backends of after spent since
// before (a backend that connected in between counts from zero).
func backendCPUSince(before, after map[int]float64) float64 {
	total := 0.0
	for pid, s := range after {
		total += s - before[pid]
	}
	return total
}

func selfCPUSeconds() float64 {
	s, _ := procCPUSeconds(os.Getpid())
	return s
}
