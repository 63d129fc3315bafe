package outboxsql_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// idleSince reports whether key k's row is there and marked idle.
func idleSince(t *testing.T, ctx context.Context, pool *pgxpool.Pool, k string) (found, idle bool) {
	t.Helper()
	var since *time.Time
	err := pool.QueryRow(ctx, `SELECT idle_since FROM outbox_ordering_key WHERE tenant_id = '' AND ordering_key = $1 AND queue = 'orders'`, k).Scan(&since)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true, since != nil
}

// wake calls outbox_ordering_wake for key k in a READ COMMITTED
// transaction.
func wake(t *testing.T, ctx context.Context, pool *pgxpool.Pool, k string) bool {
	t.Helper()
	var woke bool
	err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, `SELECT outbox_ordering_wake('', $1, 'orders')`, k).Scan(&woke)
	})
	if err != nil {
		t.Fatal(err)
	}
	return woke
}

// TestReleaseAboveReadCommittedLeavesTheKeyIdle (migration 018): River's
// completion statement run at REPEATABLE READ, while a handoff queues a
// job behind the key's head, cannot see that job once it has waited for
// the handoff. The release keeps the key's row, marked idle, instead of
// deleting it (before 018 the row went and the job stayed pending with
// nothing to release it); a later handoff queues behind it rather than
// becoming a head of its own; outbox_ordering_wake, at READ COMMITTED,
// releases the first job in line. A key idle with nothing in line is
// deleted by the wake. At READ COMMITTED no key is marked idle.
func TestReleaseAboveReadCommittedLeavesTheKeyIdle(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 90*time.Second)
	rr := pgtest.IsolationPool(t, s, "repeatable read")

	head := orderedJob(t, ctx, s.Pool, "k", 1, "available")
	handoff, _ := pgtest.OpenTx(t, ctx, s.Pool)
	queued := orderedJob(t, ctx, handoff, "k", 2, "pending")

	// The completion sees an empty line; above READ COMMITTED it does not
	// wait for the handoff (under its lock_timeout, a wait would fail it).
	if err := completeJob(ctx, rr, "river", head, 10*time.Second); err != nil {
		t.Fatalf("completing the head at repeatable read: %v", err)
	}
	if err := handoff.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if found, idle := idleSince(t, ctx, s.Pool, "k"); !found || !idle {
		t.Fatalf("after the release at repeatable read the key's row is there %v, idle %v; want both", found, idle)
	}
	if got := jobState(t, ctx, s.Pool, queued); got != "pending" {
		t.Fatalf("the queued job is %s before the wake, want pending", got)
	}
	// A later handoff queues behind the idle key: nothing overtakes the
	// job in line.
	later := orderedJob(t, ctx, s.Pool, "k", 3, "pending")

	if !wake(t, ctx, s.Pool, "k") {
		t.Fatal("the wake found no idle key")
	}
	if got := jobState(t, ctx, s.Pool, queued); got != "available" {
		t.Fatalf("the queued job is %s after the wake, want available", got)
	}
	if got := keyHead(t, ctx, s.Pool, "k"); got != queued {
		t.Fatalf("the key's head is job %d, want %d", got, queued)
	}
	if _, idle := idleSince(t, ctx, s.Pool, "k"); idle {
		t.Fatal("the key is still idle after the wake")
	}
	if wake(t, ctx, s.Pool, "k") {
		t.Fatal("a second wake found the key idle")
	}

	// The rest of the line at READ COMMITTED: no idle mark, the row goes
	// with the last job.
	if err := completeJob(ctx, s.Pool, "river", queued, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := jobState(t, ctx, s.Pool, later); got != "available" {
		t.Fatalf("the later job is %s, want available", got)
	}
	if err := completeJob(ctx, s.Pool, "river", later, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if found, _ := idleSince(t, ctx, s.Pool, "k"); found {
		t.Fatal("the key's row is still there after its last job at read committed")
	}

	// Idle with nothing in line: the wake deletes the row.
	only := orderedJob(t, ctx, s.Pool, "solo", 1, "available")
	if err := completeJob(ctx, rr, "river", only, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if found, idle := idleSince(t, ctx, s.Pool, "solo"); !found || !idle {
		t.Fatalf("solo: row there %v, idle %v; want both", found, idle)
	}
	if !wake(t, ctx, s.Pool, "solo") {
		t.Fatal("the wake found no idle key solo")
	}
	if found, _ := idleSince(t, ctx, s.Pool, "solo"); found {
		t.Fatal("the idle key's row is still there after the wake with nothing in line")
	}
	next := orderedJob(t, ctx, s.Pool, "solo", 2, "available")
	if got := keyHead(t, ctx, s.Pool, "solo"); got != next {
		t.Fatalf("solo's head is job %d, want %d", got, next)
	}

	// The wake itself refuses to run above READ COMMITTED.
	var woke bool
	err := rr.QueryRow(ctx, `SELECT outbox_ordering_wake('', 'solo', 'orders')`).Scan(&woke)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "25000" {
		t.Fatalf("wake at repeatable read: %v, want SQLSTATE 25000", err)
	}
}

// TestSkipAboveReadCommittedEndsTheParking: outbox_unpark's skip of a
// parked head with nothing in line, called at SERIALIZABLE, leaves the key
// idle and no longer parked (the parked head is done, as when the row was
// deleted): a later retry finds nothing parked and runs nothing, and the
// wake deletes the row.
func TestSkipAboveReadCommittedEndsTheParking(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	head := orderedJob(t, ctx, s.Pool, "p", 1, "available")
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', finalized_at = now(), attempt = 3 WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE ordering_key = 'p' AND parked_at IS NOT NULL`); n != 1 {
		t.Fatalf("%d parked keys, want 1", n)
	}
	ser := pgtest.IsolationPool(t, s, "serializable")
	if n := pgtest.Count(t, ser, `SELECT count(*) FROM outbox_unpark('test', false, 'p', 'skip')`); n != 1 {
		t.Fatalf("skip touched %d keys, want 1", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE ordering_key = 'p' AND idle_since IS NOT NULL AND parked_at IS NULL AND parked_state IS NULL`); n != 1 {
		t.Fatal("after a skip at serializable the key is not idle and unparked")
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_unpark('test', false, 'p', 'retry')`); n != 0 {
		t.Fatalf("a retry after the skip touched %d keys, want 0", n)
	}
	if got := jobState(t, ctx, s.Pool, head); got != "discarded" {
		t.Fatalf("the skipped head is %s, want discarded", got)
	}
	if !wake(t, ctx, s.Pool, "p") {
		t.Fatal("the wake found no idle key p")
	}
	if found, _ := idleSince(t, ctx, s.Pool, "p"); found {
		t.Fatal("the key's row is still there after the wake")
	}
}

// TestBothCompletersLeaveTheKeyIdleAboveReadCommitted: River's completion
// statement and outbox_ordering_complete's group path, each run at
// SERIALIZABLE while a handoff queues a job behind the head, leave the key
// idle rather than strand that job; the wake releases it.
func TestBothCompletersLeaveTheKeyIdleAboveReadCommitted(t *testing.T) {
	t.Parallel()
	for _, c := range completers {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			ctx := pgtest.Context(t, 60*time.Second)
			ser := pgtest.IsolationPool(t, s, "serializable")
			head := orderedJob(t, ctx, s.Pool, "k", 1, "available")
			handoff, _ := pgtest.OpenTx(t, ctx, s.Pool)
			queued := orderedJob(t, ctx, handoff, "k", 2, "pending")
			if err := completeJob(ctx, ser, c.name, head, 10*time.Second); err != nil {
				t.Fatalf("completing the head at serializable: %v", err)
			}
			if err := handoff.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if found, idle := idleSince(t, ctx, s.Pool, "k"); !found || !idle {
				t.Fatalf("the key's row is there %v, idle %v; want both", found, idle)
			}
			if got := jobState(t, ctx, s.Pool, queued); got != "pending" {
				t.Fatalf("the queued job is %s before the wake, want pending", got)
			}
			if !wake(t, ctx, s.Pool, "k") {
				t.Fatal("the wake found no idle key")
			}
			if got := jobState(t, ctx, s.Pool, queued); got != "available" {
				t.Fatalf("the queued job is %s after the wake, want available", got)
			}
		})
	}
}

// idleKeyWithTwoInLine makes key k idle (its head completed at REPEATABLE
// READ while a handoff queued a job behind it) with two jobs in line, and
// returns the head and the two.
func idleKeyWithTwoInLine(t *testing.T, ctx context.Context, s *pgtest.Schema, k string) (head, first, second int64) {
	t.Helper()
	rr := pgtest.IsolationPool(t, s, "repeatable read")
	head = orderedJob(t, ctx, s.Pool, k, 1, "available")
	handoff, _ := pgtest.OpenTx(t, ctx, s.Pool)
	first = orderedJob(t, ctx, handoff, k, 2, "pending")
	if err := completeJob(ctx, rr, "river", head, 10*time.Second); err != nil {
		t.Fatalf("completing the head at repeatable read: %v", err)
	}
	if err := handoff.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	second = orderedJob(t, ctx, s.Pool, k, 3, "pending")
	if found, idle := idleSince(t, ctx, s.Pool, k); !found || !idle {
		t.Fatalf("the key's row is there %v, idle %v; want both", found, idle)
	}
	return head, first, second
}

// retryByHand makes a finished job available again, as River UI's or
// Client.JobRetry's retry does, and with running, runs it as River's
// fetch does.
func retryByHand(t *testing.T, ctx context.Context, pool *pgxpool.Pool, id int64, running bool) {
	t.Helper()
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'available', finalized_at = NULL, scheduled_at = now() WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if !running {
		return
	}
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = attempt + 1, attempted_at = now() WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
}

// TestGroupReleaseOfAnIdleKeyClearsTheMark (migration 019): the head of an
// idle key, retried by hand and completed again by
// outbox_ordering_complete's group path, releases the first job in line
// and ends the idle mark, so the dispatcher's wake finds nothing to do.
// Under 018 the mark stayed, and the wake released the second job in line
// beside the first.
func TestGroupReleaseOfAnIdleKeyClearsTheMark(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	head, first, second := idleKeyWithTwoInLine(t, ctx, s, "k")

	retryByHand(t, ctx, s.Pool, head, false)
	if err := completeJob(ctx, s.Pool, "function", head, 10*time.Second); err != nil {
		t.Fatalf("completing the retried head in a group: %v", err)
	}
	if got := jobState(t, ctx, s.Pool, first); got != "available" {
		t.Fatalf("the first job in line is %s, want available", got)
	}
	if got := keyHead(t, ctx, s.Pool, "k"); got != first {
		t.Fatalf("the key's head is job %d, want %d", got, first)
	}
	if _, idle := idleSince(t, ctx, s.Pool, "k"); idle {
		t.Fatal("the key is still marked idle after the group moved its head")
	}
	if wake(t, ctx, s.Pool, "k") {
		t.Fatal("the wake found the key idle")
	}
	if got := jobState(t, ctx, s.Pool, second); got != "pending" {
		t.Fatalf("the second job in line is %s while the first is its key's head, want pending", got)
	}
}

// TestWakeLeavesARunningHeadToItsCompletion (migration 019): the wake of
// an idle key whose head was retried by hand (and runs again) only clears
// the mark: the next job waits for the head's completion, which releases
// it. Under 018 the wake released it beside the running head.
func TestWakeLeavesARunningHeadToItsCompletion(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	head, first, _ := idleKeyWithTwoInLine(t, ctx, s, "k")

	retryByHand(t, ctx, s.Pool, head, true)
	if !wake(t, ctx, s.Pool, "k") {
		t.Fatal("the wake found no idle key")
	}
	if got := jobState(t, ctx, s.Pool, first); got != "pending" {
		t.Fatalf("the first job in line is %s while the head runs again, want pending", got)
	}
	if found, idle := idleSince(t, ctx, s.Pool, "k"); !found || idle {
		t.Fatalf("after the wake the key's row is there %v, idle %v; want there, not idle", found, idle)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = $1 AND state = 'running'`, head); err != nil {
		t.Fatal(err)
	}
	if got := jobState(t, ctx, s.Pool, first); got != "available" {
		t.Fatalf("the first job in line is %s after the head's completion, want available", got)
	}
}

// TestWakeLeavesAParkedKeyParked (migration 019): a key parked after it
// went idle (by a head retried by hand that was then discarded) stays
// parked when the wake clears its mark; under 018 the wake released the
// next job past the parking.
func TestWakeLeavesAParkedKeyParked(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	head, first, _ := idleKeyWithTwoInLine(t, ctx, s, "k")

	retryByHand(t, ctx, s.Pool, head, true)
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', finalized_at = now() WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE ordering_key = 'k' AND parked_at IS NOT NULL`); n != 1 {
		t.Fatalf("%d parked keys after the retried head's discard, want 1", n)
	}
	if _, idle := idleSince(t, ctx, s.Pool, "k"); !idle {
		t.Fatal("the key is no longer idle after the retried head's discard: this test needs a key parked while idle")
	}
	if !wake(t, ctx, s.Pool, "k") {
		t.Fatal("the wake found no idle key")
	}
	if _, idle := idleSince(t, ctx, s.Pool, "k"); idle {
		t.Fatal("the key is still idle after the wake")
	}
	if got := jobState(t, ctx, s.Pool, first); got != "pending" {
		t.Fatalf("the first job in line is %s while its key is parked, want pending", got)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE ordering_key = 'k' AND parked_at IS NOT NULL`); n != 1 {
		t.Fatalf("%d parked keys after the wake, want 1", n)
	}
}
