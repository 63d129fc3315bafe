package chaos

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/internal/proctest"
)

// The routes every scenario uses: one queue, a fan-out, and no route for
// "unrouted." (those events are built to fail).
const routesYAML = `routes:
  - prefix: "mail."
    queue: outbox_mail
  - prefix: "audit."
    queues: [outbox_audit, outbox_mail]
`

// eventType is the type of the i-th event of a scenario: mostly mail, every
// tenth a fan-out to two queues, every twentieth unroutable.
func eventType(i int) string {
	switch {
	case i%20 == 7:
		return "unrouted.thing.happened"
	case i%10 == 3:
		return "audit.user.login"
	default:
		return "mail.user.welcome"
	}
}

// queuesOf is the routing the ledger expects.
func queuesOf(typ string) []string {
	switch {
	case strings.HasPrefix(typ, "mail."):
		return []string{"outbox_mail"}
	case strings.HasPrefix(typ, "audit."):
		return []string{"outbox_audit", "outbox_mail"}
	}
	return nil
}

func routesFile(t testing.TB) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(p, []byte(routesYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// secret is a password put into every daemon's DATABASE_URL. The test
// databases trust local connections, so it is never checked, but it must
// never show up in a log line.
func secret() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "pw-" + hex.EncodeToString(b[:])
}

// withPassword puts password into a postgres:// URL's user info.
func withPassword(url, password string) string {
	for _, p := range []string{"postgres://", "postgresql://"} {
		if rest, ok := strings.CutPrefix(url, p); ok {
			at := strings.Index(rest, "@")
			if at < 0 {
				return url
			}
			user, _, _ := strings.Cut(rest[:at], ":")
			return p + user + ":" + password + rest[at:]
		}
	}
	return url + " password=" + password
}

// daemon is one outboxd (or ledgerworker) process.
type daemon struct {
	cmd    *exec.Cmd
	out    *proctest.SyncBuffer
	exited chan struct{}
	err    error
	// diedAt is when Wait returned (the process was dead by then); read
	// it after exited is closed.
	diedAt time.Time
}

// daemonEnv is the environment of a dispatching outboxd on url.
func daemonEnv(url, routes string, extra ...string) []string {
	env := []string{
		"PATH=" + os.Getenv("PATH"),
		"DATABASE_URL=" + url,
		"OUTBOX_DISPATCHER_ENABLED=true",
		"OUTBOX_ROUTES_FILE=" + routes,
		"OUTBOX_DISPATCH_INTERVAL_MS=250",
		"OUTBOX_DISPATCH_BATCH_SIZE=50",
		"OUTBOX_DISPATCH_CONCURRENCY=2",
		"OUTBOX_DATABASE_MAX_CONNS=5",
		"OUTBOX_LISTEN_PING_INTERVAL_MS=500",
		"OUTBOX_LISTEN_RECONNECT_DELAY_MS=200",
		"OUTBOX_DISPATCH_TIMEOUT_MS=10000",
	}
	return append(env, extra...)
}

// startDaemon starts outboxd with env; the test's cleanup kills it.
func startDaemon(t testing.TB, env []string) *daemon {
	t.Helper()
	return startProcess(t, outboxdBin, env)
}

// startProcess starts bin with env; the test's cleanup kills it.
func startProcess(t testing.TB, bin string, env []string) *daemon {
	t.Helper()
	d := &daemon{cmd: exec.Command(bin), out: &proctest.SyncBuffer{}, exited: make(chan struct{})}
	d.cmd.Env = env
	d.cmd.Stdout, d.cmd.Stderr = d.out, d.out
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		d.err = d.cmd.Wait()
		d.diedAt = time.Now()
		close(d.exited)
	}()
	t.Cleanup(func() {
		_ = d.cmd.Process.Kill()
		<-d.exited
		if t.Failed() {
			t.Logf("%s (pid %d) output, last 3000 bytes:\n%s", filepath.Base(bin), d.cmd.Process.Pid, tail(d.out.String(), 3000))
		}
	})
	return d
}

func (d *daemon) alive() bool {
	select {
	case <-d.exited:
		return false
	default:
		return true
	}
}

func (d *daemon) kill9() {
	_ = d.cmd.Process.Signal(syscall.SIGKILL)
	<-d.exited
}

// stop sends SIGTERM and reports the exit status (-1 on timeout).
func (d *daemon) stop(timeout time.Duration) int {
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(timeout):
		return -1
	}
	var ee *exec.ExitError
	if errors.As(d.err, &ee) {
		return ee.ExitCode()
	}
	if d.err != nil {
		return -2
	}
	return 0
}

// waitLog waits until the daemon's output contains want (a daemon that
// exits first fails the test at once; a timeout is logged with the output
// by startDaemon's cleanup).
func (d *daemon) waitLog(t testing.TB, want string, timeout time.Duration) {
	t.Helper()
	pgtest.WaitFor(t, timeout, fmt.Sprintf("outboxd to log %q", want), func() bool {
		if strings.Contains(d.out.String(), want) {
			return true
		}
		if !d.alive() {
			t.Fatalf("outboxd exited before it logged %q:\n%s", want, tail(d.out.String(), 3000))
		}
		return false
	})
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}

// keyOf is the dispatch key of event i of a scenario run: the ledger's
// handle on every event, and what makes a producer's retry after an
// ambiguous commit idempotent.
func keyOf(run string, i int) string { return fmt.Sprintf("%s:%d", run, i) }

// producers publish events [from, n) of run in batches of batch from workers
// goroutines, retrying a batch until its transaction commits (a retry after
// an ambiguous commit finds the keys already stored). It returns when every
// event is committed or ctx ends, and reports the failed attempts.
type producers struct {
	pool    *pgxpool.Pool
	run     string
	from, n int
	batch   int
	workers int
	// event builds event i; nil means the mixed events of eventType.
	event func(i int) outbox.Event
	// pause is a wait after each committed batch, to spread a run over
	// the faults.
	pause     time.Duration
	committed atomic.Int64
	attempts  atomic.Int64
	errors    atomic.Int64
	lastErr   atomic.Value
}

func (p *producers) start(ctx context.Context) <-chan struct{} {
	done := make(chan struct{})
	var next atomic.Int64
	next.Store(int64(p.from))
	var wg sync.WaitGroup
	for range p.workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				lo := int(next.Add(int64(p.batch))) - p.batch
				if lo >= p.n {
					return
				}
				hi := min(lo+p.batch, p.n)
				evs := make([]outbox.Event, 0, hi-lo)
				for i := lo; i < hi; i++ {
					if p.event != nil {
						evs = append(evs, p.event(i))
						continue
					}
					evs = append(evs, outbox.Event{
						Type:        eventType(i),
						Payload:     json.RawMessage(fmt.Sprintf(`{"i": %d, "run": %q}`, i, p.run)),
						TenantID:    fmt.Sprintf("tenant-%d", i%7),
						DispatchKey: keyOf(p.run, i),
					})
				}
				delay := 50 * time.Millisecond
				for ctx.Err() == nil {
					p.attempts.Add(1)
					err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
						_, err := outbox.PublishMany(ctx, tx, evs)
						return err
					})
					if err == nil {
						p.committed.Add(int64(len(evs)))
						if p.pause > 0 {
							select {
							case <-time.After(p.pause):
							case <-ctx.Done():
							}
						}
						break
					}
					p.errors.Add(1)
					p.lastErr.Store(err.Error())
					select {
					case <-time.After(delay):
					case <-ctx.Done():
					}
					delay = min(delay*2, time.Second)
				}
			}
		})
	}
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

// ledger is what a scenario published.
type ledger struct {
	run string
	n   int
	// rolledBack are keys whose transactions rolled back: they must never
	// exist, nor their jobs.
	rolledBack []string
	// rolledBackIDs are ids handed out inside rolled-back transactions.
	rolledBackIDs []int64
}

// counts is the state of the outbox as the ledger sees it.
type counts struct {
	Done, Failed, Pending, Other int
	Lost, Duplicated, Phantom    int
	Problems                     []string
}

// producerPool connects to the schema url with application_name
// "producer", so that scenarios that terminate the daemons' backends (whose
// application_name is the schema's name) leave the producers alone.
func producerPool(t testing.TB, url string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "producer"
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// settledCount counts the run's events that are pending or processing.
func settledCount(ctx context.Context, pool *pgxpool.Pool, run string) (int, error) {
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE starts_with(dispatch_key, $1) AND status IN ('pending', 'processing')`, run+":").Scan(&n)
	return n, err
}

// waitSettled waits until no event of the run is pending or processing
// (retrying through database outages) and returns false at the deadline.
func waitSettled(ctx context.Context, pool *pgxpool.Pool, run string, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		n, err := settledCount(ctx, pool, run)
		if err == nil && n == 0 {
			return true
		}
		time.Sleep(50 * time.Millisecond)
	}
	return false
}

// check reads the outbox and River's jobs and compares them with the
// ledger: every event exists once, is done (failed when unroutable) and
// has exactly one job per route queue; rolled-back events left nothing.
func (l *ledger) check(ctx context.Context, pool *pgxpool.Pool) (counts, error) {
	var c counts
	type row struct {
		id     int64
		typ    string
		status string
		jobIDs []int64
	}
	rows, err := pool.Query(ctx, `SELECT dispatch_key, id, event_type, status::text, coalesce(river_job_ids, '{}') FROM outbox_event WHERE starts_with(dispatch_key, $1)`, l.run+":")
	if err != nil {
		return c, err
	}
	byKey := map[string]row{}
	for rows.Next() {
		var k string
		var r row
		if err := rows.Scan(&k, &r.id, &r.typ, &r.status, &r.jobIDs); err != nil {
			return c, err
		}
		byKey[k] = r
	}
	if err := rows.Err(); err != nil {
		return c, err
	}
	// Jobs by (event id, queue), and their ids.
	jrows, err := pool.Query(ctx, `SELECT (args->>'event_id')::bigint, queue, count(*), array_agg(id) FROM river_job
		WHERE starts_with(args->>'dispatch_key', $1) GROUP BY 1, 2`, l.run+":")
	if err != nil {
		return c, err
	}
	type jk struct {
		event int64
		queue string
	}
	jobs := map[jk]int{}
	jobIDs := map[int64]bool{}
	for jrows.Next() {
		var k jk
		var n int
		var ids []int64
		if err := jrows.Scan(&k.event, &k.queue, &n, &ids); err != nil {
			return c, err
		}
		jobs[k] = n
		for _, id := range ids {
			jobIDs[id] = true
		}
	}
	if err := jrows.Err(); err != nil {
		return c, err
	}
	problem := func(format string, a ...any) {
		if len(c.Problems) < 20 {
			c.Problems = append(c.Problems, fmt.Sprintf(format, a...))
		}
	}
	seenJobs := map[jk]bool{}
	for i := range l.n {
		key := keyOf(l.run, i)
		r, ok := byKey[key]
		if !ok {
			c.Lost++
			problem("event %s was committed but is not in outbox_event", key)
			continue
		}
		want := queuesOf(eventType(i))
		switch r.status {
		case "done":
			c.Done++
		case "failed":
			c.Failed++
		case "pending", "processing":
			c.Pending++
		default:
			c.Other++
		}
		if want == nil {
			if r.status != "failed" && r.status != "pending" {
				c.Lost++
				problem("unroutable event %s is %s, want failed", key, r.status)
			}
		} else if r.status != "done" && r.status != "pending" && r.status != "processing" {
			c.Lost++
			problem("event %s (%s) is %s, want done", key, r.typ, r.status)
		}
		for _, q := range want {
			k := jk{r.id, q}
			seenJobs[k] = true
			switch n := jobs[k]; {
			case n == 0 && r.status == "done":
				c.Lost++
				problem("event %s is done but has no job in %s", key, q)
			case n > 1:
				c.Duplicated += n - 1
				problem("event %s has %d jobs in %s", key, n, q)
			}
		}
		if r.status == "done" {
			if len(r.jobIDs) != len(want) {
				problem("event %s records %d job ids, want %d", key, len(r.jobIDs), len(want))
				c.Duplicated++
			}
			for _, id := range r.jobIDs {
				if !jobIDs[id] {
					problem("event %s records job %d, which does not exist", key, id)
					c.Lost++
				}
			}
		}
		if want == nil {
			for _, q := range []string{"outbox_mail", "outbox_audit"} {
				if jobs[jk{r.id, q}] > 0 {
					c.Phantom++
					problem("unroutable event %s has a job in %s", key, q)
				}
			}
		}
	}
	typeOfID := make(map[int64]string, len(byKey))
	for _, r := range byKey {
		typeOfID[r.id] = r.typ
	}
	for k, n := range jobs {
		if !seenJobs[k] {
			typ, known := typeOfID[k.event]
			if !known || queuesOf(typ) != nil { // unroutable ones are counted above
				c.Phantom += n
				problem("%d job(s) in %s for event %d, which the ledger does not know", n, k.queue, k.event)
			}
		}
	}
	if len(l.rolledBack) > 0 || len(l.rolledBackIDs) > 0 {
		var rows, jobsOf int
		err := pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM outbox_event WHERE dispatch_key = ANY($1) OR id = ANY($2)),
			(SELECT count(*) FROM river_job WHERE args->>'dispatch_key' = ANY($1) OR (args->>'event_id')::bigint = ANY($2))`,
			l.rolledBack, l.rolledBackIDs).Scan(&rows, &jobsOf)
		if err != nil {
			return c, err
		}
		if rows+jobsOf > 0 {
			c.Phantom += rows + jobsOf
			problem("rolled-back events left %d rows and %d jobs", rows, jobsOf)
		}
	}
	return c, nil
}

// verify settles the run, checks the ledger, records the report line and
// fails the test on any lost, duplicated, stuck or phantom event.
func verify(t *testing.T, ctx context.Context, pool *pgxpool.Pool, l *ledger, r report, settle time.Duration, daemons ...*daemon) counts {
	t.Helper()
	if !waitSettled(ctx, pool, l.run, settle) {
		t.Errorf("events still pending %s after the faults stopped", settle)
	}
	c, err := l.check(ctx, pool)
	if err != nil {
		t.Fatalf("ledger: %v", err)
	}
	r.Events = l.n
	r.Done, r.Failed, r.Lost, r.Duplicated, r.Stuck, r.Phantom = c.Done, c.Failed, c.Lost, c.Duplicated, c.Pending+c.Other, c.Phantom
	addReport(r)
	t.Logf("%s: events=%d done=%d failed=%d lost=%d duplicated=%d stuck=%d phantom=%d faults=%d in %s",
		r.Scenario, r.Events, r.Done, r.Failed, r.Lost, r.Duplicated, r.Stuck, r.Phantom, r.Faults, r.Elapsed.Round(time.Millisecond))
	if c.Lost+c.Duplicated+c.Pending+c.Other+c.Phantom > 0 {
		t.Errorf("ledger: lost=%d duplicated=%d stuck=%d phantom=%d\n%s", c.Lost, c.Duplicated, c.Pending+c.Other, c.Phantom, strings.Join(c.Problems, "\n"))
		for i, d := range daemons {
			t.Logf("outboxd %d output:\n%s", i, tail(d.out.String(), 4000))
		}
	}
	wantFailed := 0
	for i := range l.n {
		if queuesOf(eventType(i)) == nil {
			wantFailed++
		}
	}
	if c.Failed != wantFailed {
		t.Errorf("failed=%d, want %d (the unroutable ones)", c.Failed, wantFailed)
	}
	return c
}

// noSecret fails when password appears in any daemon's output.
func noSecret(t *testing.T, password string, daemons ...*daemon) {
	t.Helper()
	for i, d := range daemons {
		if out := d.out.String(); strings.Contains(out, password) {
			t.Errorf("outboxd %d logged the database password:\n%s", i, tail(out, 3000))
		}
	}
}

// doneCount counts the run's done events.
func doneCount(ctx context.Context, pool *pgxpool.Pool, run string) int {
	var n int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE starts_with(dispatch_key, $1) AND status = 'done'`, run+":").Scan(&n)
	return n
}

// waitDone waits until at least n events of the run are done; false at the
// deadline.
func waitDone(ctx context.Context, pool *pgxpool.Pool, run string, n int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if doneCount(ctx, pool, run) >= n {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}
