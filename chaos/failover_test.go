package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/dbconn"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestFailover fails a primary over to its streaming standby under load:
// outboxd runs with a multi-host DATABASE_URL naming both (and no
// target_session_attrs: outbox defaults it to read-write), producers
// publish without pause, the primary fails, and the standby is promoted.
// Handoff must resume on the promoted node within 30 s, outboxd's listener
// must LISTEN there (NOTIFY is not replicated), and every event the
// promoted node holds must end handed off exactly once: one River job per
// route queue for each done event, none for the others, nothing left
// pending.
//
// The primary fails in three ways:
//   - crash-ro: the standby stops receiving WAL (its replication
//     connection is refused) while the primary goes on committing events
//     and handoffs for a while; then the primary is stopped with -m
//     immediate (every backend killed, no shutdown checkpoint, as in a
//     crash) and comes back fenced (default_transaction_read_only) on the
//     same port, first in the host list, before the standby is promoted;
//   - crash-gone: the same lag, and the primary never comes back;
//   - fenced: a switchover: the primary stays up and is made read-only by
//     a reload, so outboxd's open sessions on it start answering 25006 or
//     reporting read-only and must be left (also what a single-host URL
//     sees when its DNS name moves).
//
// In the crash modes the commits made during the lag are lost with the old
// primary (asynchronous replication): events the producers saw commit, and
// handoffs of events the standby holds as pending. The test requires that
// some were lost (the lag is real) and that the promoted node hands each
// event it holds off exactly once all the same.
func TestFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos: the failover scenario starts Postgres primaries and standbys; skipped with -short")
	}
	t.Parallel()
	for _, mode := range []string{"crash-ro", "crash-gone", "fenced"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			failover(t, mode)
		})
	}
}

func failover(t *testing.T, mode string) {
	start := time.Now()
	primary := startCluster(t) // skips without initdb/pg_ctl
	standby := startStandby(t, primary)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	const schema = "failover"
	primary.schema(t, schema)
	run := "fo" + strings.NewReplacer(",", "", " ", "-").Replace(mode)
	password := secret()
	hosts := fmt.Sprintf("127.0.0.1:%d,127.0.0.1:%d", primary.port, standby.port)
	daemonURL := fmt.Sprintf("postgres://postgres:%s@%s/postgres?sslmode=disable&connect_timeout=5&search_path=%s&application_name=%s",
		password, hosts, schema, schema)
	// Producers are the application, here with outbox's own pool: it
	// defaults the read-write target and evicts read-only sessions, as an
	// application must to follow a failover.
	prodURL := fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable&connect_timeout=5&search_path=%s&application_name=producer",
		hosts, schema)
	prod, err := dbconn.Open(ctx, prodURL, dbconn.Options{MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(prod.Close)
	// Reads on the standby, before and after its promotion.
	check := producerPool(t, pgtest.WithSearchPath(standby.URL, schema), 2)

	// A poll interval longer than the 30 s the handoff has to resume in:
	// the promoted node is found by the listener's reconnect and the claim
	// pass that follows it, not by a poll tick.
	d := startDaemon(t, daemonEnv(daemonURL, routesFile(t), "OUTBOX_DISPATCH_INTERVAL_MS=60000"))
	d.waitLog(t, "outbox listener connected", 60*time.Second)

	pubCtx, stopPub := context.WithCancel(ctx)
	defer stopPub()
	p := &publisher{pool: prod, run: run, batch: 5, pause: 100 * time.Millisecond}
	pubDone := p.start(pubCtx, 3)

	if !waitDone(ctx, prod, run, 300, 60*time.Second) {
		t.Fatalf("handoff never started on the primary:\n%s", tail(d.out.String(), 3000))
	}

	// The failover.
	if mode != "fenced" {
		primary.cutReplication(t)
		lagFrom, lagDone := p.committed(), doneCount(ctx, prod, run)
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if p.committed() >= lagFrom+100 && doneCount(ctx, prod, run) >= lagDone+50 {
				break
			}
		}
	}
	failedAt := time.Now()
	switch mode {
	case "crash-ro":
		primary.stopImmediate(t)
		primary.startReadOnly(t)
	case "crash-gone":
		primary.stopImmediate(t)
	case "fenced":
		primary.fence(t)
	}
	standby.promote(t)
	promotedAt := time.Now()
	t.Logf("%s: the standby was promoted %s after the primary failed", mode, promotedAt.Sub(failedAt).Round(time.Millisecond))

	// Rows numbered past the promoted node's highest id at promotion were
	// published after it (the promoted sequence resumes past every
	// replicated value).
	// Pending rows at promotion include events whose handoff committed on
	// the old primary during the lag: the promoted node hands them off
	// again (their first jobs were lost with the old primary).
	var watermark int64
	var pendingAtPromotion int
	if err := check.QueryRow(ctx, `SELECT coalesce(max(id), 0), count(*) FILTER (WHERE status = 'pending') FROM outbox_event`).Scan(&watermark, &pendingAtPromotion); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, 30*time.Second-time.Since(promotedAt), "handoff to resume on the promoted node (30 s after the promotion)", func() bool {
		if !d.alive() {
			t.Fatalf("outboxd exited before the handoff resumed on the promoted node; outboxd:\n%s", tail(d.out.String(), 12000))
		}
		var n int
		err := check.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE id > $1 AND status = 'done'`, watermark).Scan(&n)
		return err == nil && n > 0
	})
	resumeAfter := time.Since(promotedAt)
	t.Logf("handoff resumed %s after the promotion", resumeAfter.Round(time.Millisecond))

	// Keep publishing on the new primary for a while, then stop.
	after := p.committed() + 300
	for deadline := time.Now().Add(30 * time.Second); p.committed() < after && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	stopPub()
	<-pubDone

	if !waitSettled(ctx, check, run, 30*time.Second) {
		n, _ := settledCount(ctx, check, run)
		t.Errorf("%d events still pending on the promoted node 30 s after the producers stopped", n)
	}
	// The wake path works on the promoted node: with the dispatcher idle,
	// an event is handed off at once, not at the next poll a minute away.
	// That needs the listener LISTENing there and the wake lock held there
	// (producers NOTIFY only while an idle dispatcher holds it).
	var markerID int64
	err = pgx.BeginFunc(ctx, check, func(tx pgx.Tx) error {
		r, err := outbox.Publish(ctx, tx, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(`{}`), DispatchKey: run + ":marker"})
		markerID = r.ID
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	woke := false
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var st string
		if err := check.QueryRow(ctx, `SELECT status::text FROM outbox_event WHERE id = $1`, markerID).Scan(&st); err == nil && st == "done" {
			woke = true
			break
		}
	}
	if !woke {
		t.Errorf("an event published on the promoted node while outboxd was idle was not handed off within 15 s (poll interval 60 s): the listener or the wake lock is not on the promoted node; outboxd:\n%s", tail(d.out.String(), 6000))
	}

	res, err := checkPromoted(ctx, check, run)
	if err != nil {
		t.Fatal(err)
	}
	missing, err := p.missing(ctx, check)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: published=%d held by the promoted node=%d (done=%d failed=%d, pending at promotion=%d) lost with the old primary (async replication)=%d",
		mode, p.committed(), res.events, res.done, res.failed, pendingAtPromotion, missing)
	addReport(report{
		Scenario: "failover-" + mode, Events: res.events, Done: res.done, Failed: res.failed,
		Lost: res.lost, Duplicated: res.duplicated, Stuck: res.stuck, Phantom: res.phantom, Faults: 1,
		Elapsed: time.Since(start),
		Note: fmt.Sprintf("resumed %s after promotion; %d pending at promotion; %d commits not replicated",
			resumeAfter.Round(100*time.Millisecond), pendingAtPromotion, missing),
	})
	if res.lost+res.duplicated+res.stuck+res.phantom > 0 {
		t.Errorf("promoted node: lost=%d duplicated=%d stuck=%d phantom=%d\n%s\noutboxd:\n%s",
			res.lost, res.duplicated, res.stuck, res.phantom, strings.Join(res.problems, "\n"), tail(d.out.String(), 4000))
	}
	if mode != "fenced" && missing == 0 {
		t.Errorf("no commit was lost with the old primary: the replication lag was not simulated")
	}
	if !d.alive() {
		t.Errorf("outboxd exited during the failover:\n%s", tail(d.out.String(), 3000))
	}
	noSecret(t, password, d)
}

// publisher publishes the run's events continuously from several
// goroutines, batch events per transaction, retrying a batch (same dispatch
// keys, so a retry after an ambiguous commit is idempotent) until it
// commits or the context ends.
type publisher struct {
	pool  *pgxpool.Pool
	run   string
	batch int
	pause time.Duration

	next atomic.Int64
	mu   sync.Mutex
	keys []string // committed, as the producers saw it
}

func (p *publisher) committed() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.keys)
}

func (p *publisher) start(ctx context.Context, workers int) <-chan struct{} {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				lo := int(p.next.Add(int64(p.batch))) - p.batch
				evs := make([]outbox.Event, 0, p.batch)
				keys := make([]string, 0, p.batch)
				for i := lo; i < lo+p.batch; i++ {
					keys = append(keys, keyOf(p.run, i))
					evs = append(evs, outbox.Event{
						Type:        eventType(i),
						Payload:     json.RawMessage(fmt.Sprintf(`{"i": %d}`, i)),
						DispatchKey: keys[len(keys)-1],
					})
				}
				delay := 50 * time.Millisecond
				for ctx.Err() == nil {
					err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
						_, err := outbox.PublishMany(ctx, tx, evs)
						return err
					})
					if err == nil {
						p.mu.Lock()
						p.keys = append(p.keys, keys...)
						p.mu.Unlock()
						break
					}
					sleepCtx(ctx, delay)
					delay = min(delay*2, time.Second)
				}
				sleepCtx(ctx, p.pause)
			}
		})
	}
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

// missing counts the keys producers saw committed that pool's node does
// not hold.
func (p *publisher) missing(ctx context.Context, pool *pgxpool.Pool) (int, error) {
	p.mu.Lock()
	keys := append([]string(nil), p.keys...)
	p.mu.Unlock()
	var held int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE dispatch_key = ANY($1)`, keys).Scan(&held)
	return len(keys) - held, err
}

func sleepCtx(ctx context.Context, d time.Duration) {
	select {
	case <-time.After(d):
	case <-ctx.Done():
	}
}

// promotedResult is what checkPromoted found.
type promotedResult struct {
	events, done, failed             int
	lost, duplicated, stuck, phantom int
	problems                         []string
}

// checkPromoted checks every event of the run that pool's node holds,
// whatever the producers saw: a done event has exactly one job per route
// queue carrying its id, an unroutable one is failed with no job, nothing
// is pending or processing, and no job names an event the node does not
// hold or a queue its event is not routed to.
func checkPromoted(ctx context.Context, pool *pgxpool.Pool, run string) (promotedResult, error) {
	var r promotedResult
	problem := func(format string, a ...any) {
		if len(r.problems) < 20 {
			r.problems = append(r.problems, fmt.Sprintf(format, a...))
		}
	}
	type ev struct{ typ, status string }
	events := map[int64]ev{}
	rows, err := pool.Query(ctx, `SELECT id, event_type, status::text FROM outbox_event WHERE starts_with(dispatch_key, $1)`, run+":")
	if err != nil {
		return r, err
	}
	for rows.Next() {
		var id int64
		var e ev
		if err := rows.Scan(&id, &e.typ, &e.status); err != nil {
			return r, err
		}
		events[id] = e
	}
	if err := rows.Err(); err != nil {
		return r, err
	}
	type jk struct {
		event int64
		queue string
	}
	jobs := map[jk]int{}
	jrows, err := pool.Query(ctx, `SELECT (args->>'event_id')::bigint, queue, count(*) FROM river_job
		WHERE starts_with(args->>'dispatch_key', $1) GROUP BY 1, 2`, run+":")
	if err != nil {
		return r, err
	}
	for jrows.Next() {
		var k jk
		var n int
		if err := jrows.Scan(&k.event, &k.queue, &n); err != nil {
			return r, err
		}
		jobs[k] = n
	}
	if err := jrows.Err(); err != nil {
		return r, err
	}
	r.events = len(events)
	for id, e := range events {
		want := queuesOf(e.typ)
		switch e.status {
		case "done":
			r.done++
			if want == nil {
				r.phantom++
				problem("unroutable event %d is done", id)
			}
			for _, q := range want {
				switch n := jobs[jk{id, q}]; {
				case n == 0:
					r.lost++
					problem("event %d is done but has no job in %s", id, q)
				case n > 1:
					r.duplicated += n - 1
					problem("event %d has %d jobs in %s", id, n, q)
				}
			}
		case "failed":
			r.failed++
			if want != nil {
				r.lost++
				problem("routable event %d (%s) is failed", id, e.typ)
			}
		default:
			r.stuck++
			problem("event %d is %s", id, e.status)
		}
	}
	for k, n := range jobs {
		e, ok := events[k.event]
		routed := false
		if ok {
			for _, q := range queuesOf(e.typ) {
				routed = routed || q == k.queue
			}
		}
		if !ok || !routed || e.status != "done" {
			r.phantom += n
			problem("%d job(s) in %s for event %d (held=%v status=%s)", n, k.queue, k.event, ok, e.status)
		}
	}
	return r, nil
}
