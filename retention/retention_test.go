package retention_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/retention"
	"github.com/outboxhq/outbox/route"
)

// seed inserts n rows of a status whose processed_at (for done) and
// created_at are age ago.
func seed(t *testing.T, pool *pgxpool.Pool, status string, n int, age time.Duration) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `
		INSERT INTO outbox_event (event_type, payload, status, created_at, processed_at, last_error)
		SELECT 'mail.user.welcome', jsonb_build_object('i', g), $1::outbox_status,
		       now() - make_interval(secs => $3), 
		       CASE WHEN $1 = 'done' THEN now() - make_interval(secs => $3) END,
		       CASE WHEN $1 IN ('failed', 'cancelled') THEN 'boom' END
		FROM generate_series(1, $2) g`, status, n, age.Seconds())
	if err != nil {
		t.Fatal(err)
	}
}

func counts(t *testing.T, pool *pgxpool.Pool) map[string]int {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
		SELECT status::text || CASE WHEN coalesce(processed_at, created_at) < now() - interval '1 day' THEN '/old' ELSE '/new' END, count(*)
		FROM outbox_event GROUP BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			t.Fatal(err)
		}
		out[k] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

const month = 30 * 24 * time.Hour

func TestRunDeletesExactlyOldDoneInBoundedBatches(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	seed(t, s.Pool, "done", 25, 2*month)
	seed(t, s.Pool, "done", 5, time.Hour)
	seed(t, s.Pool, "failed", 3, 2*month)
	seed(t, s.Pool, "cancelled", 4, 2*month)
	seed(t, s.Pool, "pending", 2, 2*month)

	var mu sync.Mutex
	var batches []int
	cfg := retention.Config{MaxAge: month, BatchSize: 10, RunBy: "test", OnBatch: func(n int) {
		mu.Lock()
		batches = append(batches, n)
		mu.Unlock()
	}}

	dry, err := retention.Run(ctx, s.Pool, cfg, true)
	if err != nil {
		t.Fatal(err)
	}
	if dry.Deleted != 25 || !dry.DryRun {
		t.Fatalf("dry run = %+v, want 25 rows", dry)
	}
	if c := counts(t, s.Pool); c["done/old"] != 25 {
		t.Fatalf("dry run deleted rows: %v", c)
	}

	res, err := retention.Run(ctx, s.Pool, cfg, false)
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted != dry.Deleted {
		t.Fatalf("run deleted %d rows, the dry run reported %d", res.Deleted, dry.Deleted)
	}
	if fmt.Sprint(batches) != "[10 10 5]" {
		t.Fatalf("batches %v, want [10 10 5]", batches)
	}
	want := map[string]int{"done/new": 5, "failed/old": 3, "cancelled/old": 4, "pending/old": 2}
	if c := counts(t, s.Pool); fmt.Sprint(c) != fmt.Sprint(want) {
		t.Fatalf("after retention: %v, want %v", c, want)
	}

	var affected int64
	var runBy string
	var finished bool
	err = s.Pool.QueryRow(ctx, `SELECT last_affected, last_run_by, last_finished_at IS NOT NULL FROM outbox_job_run WHERE name = $1`, retention.JobName).Scan(&affected, &runBy, &finished)
	if err != nil || affected != 25 || runBy != "test" || !finished {
		t.Fatalf("outbox_job_run = %d %q %v, %v", affected, runBy, finished, err)
	}

	again, err := retention.Run(ctx, s.Pool, cfg, false)
	if err != nil || again.Deleted != 0 {
		t.Fatalf("second run = %+v, %v; want nothing left", again, err)
	}
}

func TestDeletedDoneRowReleasesDispatchKey(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, dispatch_key, status, processed_at)
		VALUES ('mail.user.welcome', '{}', 'k1', 'done', now() - interval '60 days')`); err != nil {
		t.Fatal(err)
	}
	if _, err := retention.Run(ctx, s.Pool, retention.Config{MaxAge: month}, false); err != nil {
		t.Fatal(err)
	}
	var dup bool
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		p, err := outbox.Publish(ctx, tx, outbox.Event{Type: "mail.user.welcome", DispatchKey: "k1"})
		dup = p.Duplicate
		return err
	})
	if err != nil || dup {
		t.Fatalf("publish with the purged key: duplicate=%v err=%v; want a new event", dup, err)
	}
}

func TestConcurrentRunsDoNotBothDelete(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	seed(t, s.Pool, "done", 30, 2*month)

	inBatch := make(chan struct{})
	release := make(chan struct{})
	var once sync.Once
	cfg := retention.Config{MaxAge: month, BatchSize: 10}
	retention.SetBeforeCommit(&cfg, func() {
		once.Do(func() {
			close(inBatch)
			<-release
		})
	})
	first := make(chan error, 1)
	var firstRes retention.Result
	go func() {
		var err error
		firstRes, err = retention.Run(ctx, s.Pool, cfg, false)
		first <- err
	}()
	select {
	case <-inBatch:
	case err := <-first:
		t.Fatalf("first run ended before its first commit: %v", err)
	case <-ctx.Done():
		t.Fatal("first run never reached its first batch")
	}

	// The first run holds the lock in the middle of a batch.
	for _, dry := range []bool{false, true} {
		res, err := retention.Run(ctx, s.Pool, retention.Config{MaxAge: month, BatchSize: 10}, dry)
		if !errors.Is(err, retention.ErrLocked) {
			t.Fatalf("second run (dry=%v) = %+v, %v; want ErrLocked", dry, res, err)
		}
		if !strings.Contains(err.Error(), "pid") {
			t.Errorf("ErrLocked should name the holder: %v", err)
		}
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if firstRes.Deleted != 30 {
		t.Fatalf("first run deleted %d, want 30", firstRes.Deleted)
	}
	// The lock is free again.
	if res, err := retention.Run(ctx, s.Pool, cfg, false); err != nil || res.Deleted != 0 {
		t.Fatalf("run after release = %+v, %v", res, err)
	}
}

// TestRunDoesNotBlockDispatcher holds a retention batch open (its rows
// locked, its delete uncommitted) while a dispatcher drains new events on
// the same table: the dispatcher must finish without waiting for it.
func TestRunDoesNotBlockDispatcher(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)
	seed(t, s.Pool, "done", 200, 2*month)

	routes, err := route.New([]route.Rule{{Prefix: "mail.", Queues: []string{"outbox_mail"}}})
	if err != nil {
		t.Fatal(err)
	}
	d, err := dispatcher.New(s.Pool, dispatcher.Config{Routes: routes, PollInterval: 50 * time.Millisecond, BatchSize: 7, Concurrency: 2})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Stop(context.Background()) })

	inBatch := make(chan struct{})
	release := make(chan struct{})
	var once sync.Once
	var maxBatch int
	cfg := retention.Config{MaxAge: month, BatchSize: 50, OnBatch: func(n int) { maxBatch = max(maxBatch, n) }}
	retention.SetBeforeCommit(&cfg, func() {
		once.Do(func() {
			close(inBatch)
			<-release
		})
	})
	done := make(chan error, 1)
	var res retention.Result
	go func() {
		var err error
		res, err = retention.Run(ctx, s.Pool, cfg, false)
		done <- err
	}()
	<-inBatch

	evs := make([]outbox.Event, 40)
	for i := range evs {
		evs[i] = outbox.Event{Type: "mail.user.welcome"}
	}
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := outbox.PublishMany(ctx, tx, evs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, 30*time.Second, "the dispatcher to hand off every event while a retention batch is open (else retention blocks it)", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'pending'`) == 0
	})
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if res.Deleted != 200 || maxBatch > 50 {
		t.Fatalf("retention = %+v (largest batch %d), want 200 rows in batches of at most 50", res, maxBatch)
	}
	if c := counts(t, s.Pool); c["done/new"] != 40 || c["done/old"] != 0 {
		t.Fatalf("after retention: %v, want the 40 new done rows only", c)
	}
}

func TestRunnerRunsOncePerInterval(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	seed(t, s.Pool, "done", 12, 2*month)

	runs := make(chan retention.Result, 4)
	r, err := retention.NewRunner(s.Pool, retention.RunnerConfig{
		Config:        retention.Config{MaxAge: month, BatchSize: 5},
		Interval:      time.Hour,
		CheckInterval: time.Hour,
		OnRun: func(res retention.Result, err error) {
			if err != nil {
				t.Errorf("runner: %v", err)
			}
			runs <- res
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Stop(context.Background()) })
	select {
	case res := <-runs:
		if res.Deleted != 12 || res.Batches != 3 {
			t.Fatalf("first run = %+v, want 12 rows in 3 batches", res)
		}
	case <-ctx.Done():
		t.Fatal("the runner did not run at start")
	}

	// Another instance checks now: the last run finished less than an hour
	// ago, so nothing is due.
	seed(t, s.Pool, "done", 3, 2*month)
	other, err := retention.NewRunner(s.Pool, retention.RunnerConfig{Config: retention.Config{MaxAge: month}, Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	res, err := other.RunIfDue(ctx)
	if err != nil || res != nil {
		t.Fatalf("RunIfDue right after a run = %+v, %v; want not due", res, err)
	}
	if err := r.Stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if err := r.Stop(ctx); err != nil { // idempotent
		t.Fatalf("second stop: %v", err)
	}
	if err := r.Start(ctx); err == nil {
		t.Fatal("a stopped runner started again")
	}
}

func TestConfig(t *testing.T) {
	t.Parallel()
	for in, want := range map[int]int{0: 1000, -5: 1, 1: 1, 10000: 10000, 20000: 10000} {
		if got := retention.ClampBatchSize(in); got != want {
			t.Errorf("ClampBatchSize(%d) = %d, want %d", in, got, want)
		}
	}
	if _, err := retention.Run(context.Background(), nil, retention.Config{}, true); err == nil || !strings.Contains(err.Error(), "OUTBOX_DONE_RETENTION_HOURS") {
		t.Errorf("Run without MaxAge = %v, want an error naming OUTBOX_DONE_RETENTION_HOURS", err)
	}
}

func TestRunPurgesExpiredReceipts(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	_, err := s.Pool.Exec(ctx, `
		INSERT INTO outbox_receipt (receiver, event_id, state, expires_at)
		SELECT 'mailer', g, 'done', now() - interval '1 hour' FROM generate_series(1, 25) g;
		INSERT INTO outbox_receipt (receiver, event_id, state, expires_at)
		SELECT 'mailer', g, 'done', now() + interval '1 hour' FROM generate_series(100, 104) g;`)
	if err != nil {
		t.Fatal(err)
	}
	cfg := retention.Config{MaxAge: time.Hour, BatchSize: 10}
	dry, err := retention.Run(ctx, s.Pool, cfg, true)
	if err != nil {
		t.Fatal(err)
	}
	res, err := retention.Run(ctx, s.Pool, cfg, false)
	if err != nil {
		t.Fatal(err)
	}
	if dry.ReceiptsDeleted != 25 || res.ReceiptsDeleted != 25 {
		t.Fatalf("dry run counted %d, run deleted %d; want 25 and 25", dry.ReceiptsDeleted, res.ReceiptsDeleted)
	}
	var left int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_receipt WHERE expires_at > now()`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	var total int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_receipt`).Scan(&total); err != nil {
		t.Fatal(err)
	}
	if left != 5 || total != 5 {
		t.Fatalf("%d live of %d receipts left, want 5 of 5", left, total)
	}
}

// TestLockKeyFollowsTheTableSchema: with a "$user" schema first in the
// search_path, current_schema() is that schema, not the one holding
// outbox_event. Two runs on one table must still exclude each other: the
// lock key is the table's schema.
func TestLockKeyFollowsTheTableSchema(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	seed(t, s.Pool, "done", 5, 40*24*time.Hour)

	// A login role with a schema of its own name, as "$user" finds it.
	role := "t_ret_" + strings.TrimPrefix(s.Name, "t_")
	admin := pgtest.Admin(t)
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN IN ROLE outbox_dispatcher`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, role)
		if _, err := admin.Exec(ctx, `DROP SCHEMA IF EXISTS `+role+` CASCADE; DROP ROLE `+role); err != nil {
			t.Errorf("drop role %s: %v", role, err)
		}
	})
	if _, err := admin.Exec(ctx, `CREATE SCHEMA `+role+` AUTHORIZATION `+role); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = role
	cfg.ConnConfig.Password = ""
	cfg.ConnConfig.RuntimeParams["search_path"] = `"$user", ` + s.Name
	cfg.MaxConns = 4
	userPool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(userPool.Close)
	var cur string
	if err := userPool.QueryRow(ctx, `SELECT current_schema()`).Scan(&cur); err != nil || cur != role {
		t.Fatalf("current_schema() = %q (%v), want the $user schema %q", cur, err, role)
	}

	// The owner's connection (search_path = the table's schema) holds the
	// lock: a run through the "$user" connection is refused.
	lock, err := retention.TryLock(ctx, s.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := retention.Run(ctx, userPool, retention.Config{MaxAge: 720 * time.Hour}, false); !errors.Is(err, retention.ErrLocked) {
		t.Fatalf("run with a $user schema while the table's lock is held: err = %v, want ErrLocked", err)
	}
	lock.Unlock(ctx)
	res, err := retention.Run(ctx, userPool, retention.Config{MaxAge: 720 * time.Hour}, false)
	if err != nil || res.Deleted != 5 {
		t.Fatalf("run with a $user schema: %+v, %v; want 5 deleted", res, err)
	}
}
