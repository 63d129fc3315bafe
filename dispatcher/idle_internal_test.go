package dispatcher

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// idleKeys makes n idle keys k0..k{n-1} in queue q, as a release above
// READ COMMITTED leaves them (migration 018): each key's head is inserted
// as a handoff inserts it and completed by River's completion statement at
// REPEATABLE READ with nothing in line. With waiting, each key then gets
// one more job, inserted as a handoff inserts it (its id taken from
// river_job_id_seq first), which waits behind the idle key in the key's
// line, not in river_job (migration 024). It returns the waiting jobs' ids
// by key.
func idleKeys(t *testing.T, ctx context.Context, s *pgtest.Schema, n int, waiting bool) map[string]int64 {
	t.Helper()
	_, err := s.Pool.Exec(ctx, `
		INSERT INTO river_job (kind, args, queue, max_attempts, metadata, state, attempt, attempted_at)
		SELECT 'order_step', '{}', 'q', 3, jsonb_build_object('outbox_ordering_key', 'k' || i, 'outbox_ordering_position', 1), 'running', 1, now()
		FROM generate_series(0, $1 - 1) AS i, `+pgtest.AsHandoff, n)
	if err != nil {
		t.Fatal(err)
	}
	rr := pgtest.IsolationPool(t, s, "repeatable read")
	if _, err := rr.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE state = 'running'`); err != nil {
		t.Fatal(err)
	}
	if got := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE idle_since IS NOT NULL`); got != n {
		t.Fatalf("%d idle keys, want %d", got, n)
	}
	ids := map[string]int64{}
	if !waiting {
		return ids
	}
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO river_job (id, kind, args, queue, max_attempts, metadata)
		SELECT nextval('river_job_id_seq'), 'order_step', '{}', 'q', 3, jsonb_build_object('outbox_ordering_key', 'k' || i, 'outbox_ordering_position', 2)
		FROM generate_series(0, $1 - 1) AS i, `+pgtest.AsHandoff, n); err != nil {
		t.Fatal(err)
	}
	rows, err := s.Pool.Query(ctx, `
		SELECT metadata->>'outbox_ordering_key', id, state, in_line FROM `+pgtest.Jobs+`
		WHERE (metadata->>'outbox_ordering_position')::int = 2`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var k, state string
		var id int64
		var inLine bool
		if err := rows.Scan(&k, &id, &state, &inLine); err != nil {
			t.Fatal(err)
		}
		if state != "pending" || !inLine {
			t.Fatalf("the job behind idle key %s is %s (in the line: %t), want pending in the key's line", k, state, inLine)
		}
		ids[k] = id
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(ids) != n {
		t.Fatalf("%d jobs wait behind the idle keys, want %d", len(ids), n)
	}
	if got := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE (metadata->>'outbox_ordering_position')::int = 2`); got != 0 {
		t.Fatalf("%d of the jobs behind the idle keys are in river_job, want none: they wait in the line", got)
	}
	return ids
}

func startIdleWake(t *testing.T, pool *pgxpool.Pool, tick time.Duration) *idleWake {
	t.Helper()
	w := &idleWake{pool: pool, logger: slog.New(slog.NewTextHandler(t.Output(), nil)), tick: tick}
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := w.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	return w
}

func available(t *testing.T, pool *pgxpool.Pool, id int64) bool {
	t.Helper()
	return pgtest.Count(t, pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'available'`, id) == 1
}

// TestIdleWakeGoesOnWhileBatchesAreFull: 150 idle keys with a job in line
// each are all woken by the checks that follow the first at once (a check
// lists at most 100), long before the next tick (an hour away).
func TestIdleWakeGoesOnWhileBatchesAreFull(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 90*time.Second)
	ids := idleKeys(t, ctx, s, 150, true)
	w := startIdleWake(t, s.Pool, time.Hour)
	pgtest.WaitFor(t, 60*time.Second, "every idle key woken", func() bool { return w.woken.Load() == 150 })
	for k, id := range ids {
		if !available(t, s.Pool, id) {
			t.Fatalf("the job behind key %s is not available after the wake", k)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE idle_since IS NOT NULL`); n != 0 {
		t.Fatalf("%d keys still idle", n)
	}
}

// TestIdleWakePassesAKeyItCannotLock: a key whose waiting job another
// session holds locked (its row in the key's line, where it waits) does
// not hold up the wake of the others: its wake gives up after its lock
// timeout, the next key is woken, and the held key is woken at a later
// check once the lock is gone. Keys with a job in line are woken before
// idle keys with none.
func TestIdleWakePassesAKeyItCannotLock(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 6})
	ctx := pgtest.Context(t, 90*time.Second)
	ids := idleKeys(t, ctx, s, 2, true)
	// A third idle key with nothing in line, idle before the others: it
	// comes after them all the same.
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_ordering_key SET idle_since = idle_since - interval '1 hour' WHERE ordering_key = 'k0'`); err != nil {
		t.Fatal(err)
	}
	// Its waiting job is its row in the line: deleting the row leaves
	// nothing in line.
	if _, err := s.Pool.Exec(ctx, `DELETE FROM outbox_ordering_wait WHERE ordering_key = 'k0'`); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM `+pgtest.Jobs+` WHERE id = $1`, ids["k0"]); n != 0 {
		t.Fatal("k0's waiting job is still there after its line row was deleted")
	}

	var order []string
	rows, err := s.Pool.Query(ctx, idleSQL, idleLimit)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var tenant, key, queue string
		if err := rows.Scan(&tenant, &key, &queue); err != nil {
			t.Fatal(err)
		}
		order = append(order, key)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(order) != 2 || order[0] != "k1" || order[1] != "k0" {
		t.Fatalf("idle keys listed %v, want [k1 k0]: the key with a job in line first", order)
	}

	hold, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = hold.Rollback(context.Background()) }()
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait WHERE job_id = $1`, ids["k1"]); n != 1 {
		t.Fatalf("%d line rows for k1's waiting job, want 1", n)
	}
	if _, err := hold.Exec(ctx, `SELECT 1 FROM outbox_ordering_wait WHERE job_id = $1 FOR UPDATE`, ids["k1"]); err != nil {
		t.Fatal(err)
	}
	// The wake of the held key gives up at its lock timeout, well before
	// its statement's timeout.
	began := time.Now()
	_, err = (&idleWake{pool: s.Pool}).wakeKey(ctx, "", "k1", "q")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
		t.Fatalf("waking the held key: %v, want lock_not_available (55P03) from its lock timeout", err)
	}
	if took := time.Since(began); took >= idleKeyTimeout {
		t.Fatalf("waking the held key took %s, want less than %s", took, idleKeyTimeout)
	}
	w := startIdleWake(t, s.Pool, 50*time.Millisecond)
	pgtest.WaitFor(t, 60*time.Second, "the held key's wake fails", func() bool { return w.failed.Load() >= 1 })
	// k1 failed; k0, after it in the list, was woken all the same.
	pgtest.WaitFor(t, 60*time.Second, "k0's row goes", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE ordering_key = 'k0'`) == 0
	})
	if available(t, s.Pool, ids["k1"]) {
		t.Fatal("the held job became available while locked")
	}
	if err := hold.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, 60*time.Second, "the held key is woken once free", func() bool { return available(t, s.Pool, ids["k1"]) })
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE idle_since IS NOT NULL`); n != 0 {
		t.Fatalf("%d keys still idle", n)
	}
}

// TestIdleWakeWaitsOutAnOldSchema: on a schema before migration 018 (no
// idle_since) the wake checks once and then not again for a minute, rather
// than put a failed statement in the server's log at every tick.
func TestIdleWakeWaitsOutAnOldSchema(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	if _, err := s.Pool.Exec(ctx, `ALTER TABLE outbox_ordering_key DROP COLUMN idle_since`); err != nil {
		t.Fatal(err)
	}
	w := startIdleWake(t, s.Pool, 10*time.Millisecond)
	pgtest.WaitFor(t, 30*time.Second, "the first check", func() bool { return w.checks.Load() >= 1 })
	time.Sleep(500 * time.Millisecond) // fifty ticks
	if n := w.checks.Load(); n != 1 {
		t.Fatalf("%d checks within half a second of finding an old schema, want 1", n)
	}
	if n := w.failed.Load(); n != 0 {
		t.Fatalf("%d keys failed, want none: the listing itself fails", n)
	}
}
