package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// The ordering scenarios: every event carries an ordering key, real
// ledgerworker processes work the jobs and record every run, and the
// faults are kill -9 of dispatchers, kill -9 of workers in the middle of
// jobs, and Postgres restarts. checkOrder then proves, per key and queue,
// the order, one run at a time, and every event worked exactly once
// successfully.

// orderedShape is a scenario's keys and events per key: 24 × 40 by
// default, 12 × 25 with -short, 100 × 50 in the long form (make chaos).
func orderedShape() (keys, perKey int) {
	switch {
	case long():
		return 100, 50
	case testing.Short():
		return 12, 25
	}
	return 24, 40
}

// orderedEventOf builds event i of run: key i % keys (its publish order
// within the key is i / keys), in one of three tenants; every fifth event
// of a key fans out to two queues, which order the key independently. No
// event is unroutable: a failed keyed event blocks its key by design.
func orderedEventOf(run string, keys int) func(i int) outbox.Event {
	return func(i int) outbox.Event {
		k, seq := i%keys, i/keys
		typ := "mail.order.step"
		if seq%5 == 2 {
			typ = "audit.order.step"
		}
		return outbox.Event{
			Type:        typ,
			Payload:     json.RawMessage(fmt.Sprintf(`{"i": %d, "run": %q}`, i, run)),
			TenantID:    fmt.Sprintf("tenant-%d", k%3),
			DispatchKey: keyOf(run, i),
			OrderingKey: fmt.Sprintf("order-%d", k),
		}
	}
}

// orderedJobs is how many jobs the n events of a run make.
func orderedJobs(run string, n, keys int) int {
	ev := orderedEventOf(run, keys)
	jobs := 0
	for i := range n {
		jobs += len(queuesOf(ev(i).Type))
	}
	return jobs
}

// workerSet is the ledgerworker processes of a scenario; each process
// writes its own ledger file in dir.
type workerSet struct {
	t     *testing.T
	dir   string
	url   string
	work  string // LEDGER_WORK_MS
	procs []*daemon
	files []string
}

func newWorkerSet(t *testing.T, url, work string) *workerSet {
	return &workerSet{t: t, dir: t.TempDir(), url: url, work: work}
}

// start starts one more worker process and waits until its River client
// runs.
func (w *workerSet) start() *daemon {
	w.t.Helper()
	file := fmt.Sprintf("worker-%d.jsonl", len(w.procs))
	d := startProcess(w.t, ledgerworkerBin, []string{
		"PATH=" + os.Getenv("PATH"),
		"DATABASE_URL=" + w.url,
		"LEDGER_FILE=" + filepath.Join(w.dir, file),
		"LEDGER_QUEUES=outbox_mail,outbox_audit",
		// Twelve slots per queue and process: with two processes or more,
		// as many slots as keys (24), so that a released job rarely waits
		// for a slot.
		"LEDGER_MAX_WORKERS=12",
		"LEDGER_WORK_MS=" + w.work,
	})
	d.waitLog(w.t, "ledgerworker started", time.Minute)
	w.procs = append(w.procs, d)
	w.files = append(w.files, file)
	return d
}

// died maps the ledger file of each dead worker process to when it was
// known dead.
func (w *workerSet) died() map[string]time.Time {
	m := map[string]time.Time{}
	for i, d := range w.procs {
		if !d.alive() {
			m[w.files[i]] = d.diedAt
		}
	}
	return m
}

// openRuns counts the runs of a ledger file that have no end record.
func openRuns(file string) (int, error) {
	runs, err := readLedgerFile(file)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, r := range runs {
		if r.End.IsZero() {
			n++
		}
	}
	return n, nil
}

// completedJobs counts the run's completed jobs.
func completedJobs(ctx context.Context, pool *pgxpool.Pool, run string) (int, error) {
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE starts_with(args->>'dispatch_key', $1) AND state = 'completed'`, run+":").Scan(&n)
	return n, err
}

// waitCompleted waits until at least n jobs of the run are completed
// (retrying through database outages); false at the deadline.
func waitCompleted(ctx context.Context, pool *pgxpool.Pool, run string, n int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if c, err := completedJobs(ctx, pool, run); err == nil && c >= n {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

// verifyOrdered waits until every event of the run is done and every job
// completed, reads the outbox, River and the worker ledgers, records the
// report line and fails the test on any fault checkOrder finds.
// start is when the scenario started: the report's elapsed time includes
// the settling.
func verifyOrdered(t *testing.T, ctx context.Context, pool *pgxpool.Pool, run string, n, keys int, ws *workerSet, start time.Time, r report, daemons ...*daemon) orderCounts {
	t.Helper()
	want := orderedJobs(run, n, keys)
	settleFrom := time.Now()
	if !waitSettled(ctx, pool, run, settle) || !waitCompleted(ctx, pool, run, want, settle) {
		t.Errorf("the run did not settle within %s after the faults stopped", settle)
	}
	r.Elapsed = time.Since(start)
	t.Logf("%s: settled %s after the last fault", r.Scenario, time.Since(settleFrom).Round(time.Millisecond))
	evs, jobs, err := loadOrdered(ctx, pool, run)
	if err != nil {
		t.Fatalf("ordering ledger: %v", err)
	}
	runs, err := readRuns(ws.dir)
	if err != nil {
		t.Fatalf("ordering ledger: %v", err)
	}
	c := checkOrder(n, evs, jobs, runs, ws.died())
	r.Events, r.Lost, r.Duplicated, r.Stuck, r.Phantom = n, c.Lost, c.Duplicated, c.Stuck, c.Phantom
	for _, e := range evs {
		if e.Status == "done" {
			r.Done++
		}
	}
	r.Note = fmt.Sprintf("%s; reordered=%d early=%d overlaps=%d; %d keys, %d jobs, %d runs, %d killed runs, %d jobs retried",
		r.Note, c.Reordered, c.Early, c.Overlaps, c.Keys, c.Jobs, c.Runs, c.Killed, c.RetriedJobs)
	addReport(r)
	t.Logf("%s: events=%d faults=%d in %s: %s", r.Scenario, n, r.Faults, r.Elapsed.Round(time.Millisecond), c.summary())
	if c.Jobs != want {
		t.Errorf("%d jobs, want %d", c.Jobs, want)
	}
	if c.faults() > 0 {
		t.Errorf("ordering ledger: %s\n%s", c.summary(), c.problems())
		for i, d := range daemons {
			t.Logf("process %d output:\n%s", i, tail(d.out.String(), 3000))
		}
	}
	return c
}

// TestChaosOrderedKill9Dispatchers SIGKILLs dispatchers again and again
// while a producer publishes keyed events and three outboxd processes hand
// them off; two worker processes work the jobs. A killed claim rolls back:
// the order, one run at a time per key, and exactly one successful run per
// event and queue must survive it.
func TestChaosOrderedKill9Dispatchers(t *testing.T) {
	t.Parallel()
	start := time.Now()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, budget())
	keys, per := orderedShape()
	n := keys * per
	nd, kills := 3, 4
	if long() {
		kills = 16
	}
	run := "ord-kill9d"
	ws := newWorkerSet(t, s.URL, "1-5")
	ws.start()
	ws.start()
	env := daemonEnv(s.URL, routesFile(t), "OUTBOX_DISPATCH_BATCH_SIZE=10", "OUTBOX_DISPATCH_CONCURRENCY=3")
	var all []*daemon
	live := make([]*daemon, nd)
	for i := range live {
		live[i] = startDaemon(t, env)
		all = append(all, live[i])
	}
	// One producer: the order within a key is the publish order.
	p := &producers{pool: producerPool(t, s.URL, 2), run: run, n: n, batch: 10, workers: 1,
		event: orderedEventOf(run, keys), pause: 25 * time.Millisecond}
	producing := p.start(ctx)
	for k := range kills {
		target := (k + 1) * n / (kills + 2)
		if !waitDone(ctx, s.Pool, run, target, 2*time.Minute) {
			t.Fatalf("kill %d: the drain never reached %d done events", k+1, target)
		}
		i := rand.IntN(nd)
		live[i].kill9()
		live[i] = startDaemon(t, env)
		// Started, so that the next kill hits a running dispatcher.
		live[i].waitLog(t, "outbox dispatcher started", time.Minute)
		all = append(all, live[i])
	}
	<-producing
	verifyOrdered(t, ctx, s.Pool, run, n, keys, ws, start, report{Scenario: "ordered-kill9-disp", Faults: kills,
		Note: fmt.Sprintf("%d dispatchers, %d kill -9", nd, kills)}, append(all, ws.procs...)...)
}

// TestChaosOrderedKill9Workers SIGKILLs worker processes in the middle of
// jobs (each victim has a job running, by its ledger) while they drain
// keyed events; a replacement starts after each kill. The killed jobs stay
// running until River's rescuer retries them (ledgerworker: rescue after
// 5 s, on the leader's 30 s rescue pass): meanwhile their keys must stay
// held, then the retry is the same job, and the key goes on in order.
func TestChaosOrderedKill9Workers(t *testing.T) {
	t.Parallel()
	start := time.Now()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, budget())
	keys, per := orderedShape()
	n := keys * per
	nw, kills := 3, 3
	if long() {
		kills = 12
	}
	run := "ord-kill9w"
	d := startDaemon(t, daemonEnv(s.URL, routesFile(t)))
	ws := newWorkerSet(t, s.URL, "20-40")
	live := make([]*daemon, nw)
	for i := range live {
		live[i] = ws.start()
	}
	p := &producers{pool: producerPool(t, s.URL, 2), run: run, n: n, batch: 20, workers: 1,
		event: orderedEventOf(run, keys), pause: 10 * time.Millisecond}
	producing := p.start(ctx)
	want := orderedJobs(run, n, keys)
	cuts, done := 0, 0
	// A kill that cut no run (its victim had none running after 30 s, on
	// a busy machine) proves nothing: up to three more kills follow until
	// one cuts a run.
	for k := 0; k < kills || (cuts == 0 && k < kills+3); k++ {
		target := min(k+1, kills) * want / (kills + 2)
		if !waitCompleted(ctx, s.Pool, run, target, 2*time.Minute) {
			t.Fatalf("kill %d: the workers never completed %d jobs", k+1, target)
		}
		// The victim is a process with a job running (by its ledger),
		// so that the kill cuts a job in the middle; after 30 s without
		// one (a busy machine), any process.
		var i int
		var file string
		for look := time.Now().Add(30 * time.Second); ctx.Err() == nil; {
			i = rand.IntN(nw)
			file = filepath.Join(ws.dir, ws.files[slices.Index(ws.procs, live[i])])
			if n, err := openRuns(file); err != nil {
				t.Fatal(err)
			} else if n > 0 || time.Now().After(look) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		live[i].kill9()
		cut, err := openRuns(file)
		if err != nil {
			t.Fatal(err)
		}
		cuts += cut
		done++
		t.Logf("kill %d at %s: %s, %d running jobs cut", k+1, time.Since(start).Round(time.Millisecond), filepath.Base(file), cut)
		live[i] = ws.start()
	}
	<-producing
	c := verifyOrdered(t, ctx, s.Pool, run, n, keys, ws, start, report{Scenario: "ordered-kill9-work", Faults: done,
		Note: fmt.Sprintf("%d workers, %d kill -9 cutting %d running jobs", nw, done, cuts)}, append([]*daemon{d}, ws.procs...)...)
	// The faults hit: runs were cut by the kills, and their jobs were
	// rescued and run again.
	if c.Killed == 0 || c.RetriedJobs == 0 {
		t.Errorf("the kills cut %d runs and %d jobs were retried: want both > 0 (the scenario proved nothing)", c.Killed, c.RetriedJobs)
	}
}

// TestChaosOrderedPostgresRestart restarts the server (fast, then
// immediate) under two dispatchers, two worker processes and a retrying
// producer of keyed events. Jobs whose completion was lost are retried;
// nothing may run out of order or beside another job of its key.
func TestChaosOrderedPostgresRestart(t *testing.T) {
	t.Parallel()
	start := time.Now()
	c := startCluster(t)
	pool, url := c.schema(t, "chaos_ordered_restart")
	ctx := pgtest.Context(t, budget())
	keys, per := orderedShape()
	n := keys * per
	run := "ord-restart"
	env := daemonEnv(url, routesFile(t), "OUTBOX_DISPATCH_TIMEOUT_MS=5000")
	d1, d2 := startDaemon(t, env), startDaemon(t, env)
	d1.waitLog(t, "outbox listener connected", time.Minute)
	ws := newWorkerSet(t, url, "5-15")
	ws.start()
	ws.start()
	p := &producers{pool: producerPool(t, url, 2), run: run, n: n, batch: 10, workers: 1,
		event: orderedEventOf(run, keys), pause: 20 * time.Millisecond}
	producing := p.start(ctx)
	modes := []string{"fast", "immediate"}
	if long() {
		modes = []string{"fast", "immediate", "fast", "immediate"}
	}
	for i, mode := range modes {
		target := int64((i + 1) * n / (len(modes) + 1))
		for p.committed.Load() < target && ctx.Err() == nil {
			time.Sleep(10 * time.Millisecond)
		}
		c.restart(t, mode, time.Second)
	}
	<-producing
	verifyOrdered(t, ctx, pool, run, n, keys, ws, start, report{Scenario: "ordered-pg-restart", Faults: len(modes),
		Note: fmt.Sprintf("restarts %s; %d producer retries", strings.Join(modes, ","), p.errors.Load())}, append([]*daemon{d1, d2}, ws.procs...)...)
	for i, w := range ws.procs {
		if !w.alive() {
			t.Errorf("worker %d exited after the restart:\n%s", i, tail(w.out.String(), 2000))
		}
	}
}
