package outboxsql_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestOrderedCompletionReleasesAGroup: outbox_ordering_complete (migration
// 017) completes a group of jobs and releases the next job of each key
// whose head is among them, in one call as the worker's role, with each of
// the cases the trigger path knows: a line with jobs (the first is
// released), an empty line (the key's row goes), a first job cancelled by
// hand (the key parks on it), a first job completed by hand (it is skipped
// and the one behind it released), a job that is not running (left alone)
// and a job without a key (completed). The jobs in line wait in it, not in
// river_job, and enter River when released (migration 024); the two
// changed by hand are River rows queued the legacy way, pending in
// river_job (as rows queued before 024 are), the only waiting jobs River's
// actions reach, and lines that mix both kinds are released in order. It
// sends River's insert notification once, commits without waiting for the
// WAL flush, and leaves the triggers working for the rest of its
// transaction.
func TestOrderedCompletionReleasesAGroup(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	disp := pgtest.RolePool(t, s, "outbox_dispatcher")

	a1 := orderedJob(t, ctx, s.Pool, "a", 1, "available")
	a2 := orderedJob(t, ctx, s.Pool, "a", 2, "pending")
	a3 := orderedJob(t, ctx, s.Pool, "a", 3, "pending")
	b1 := orderedJob(t, ctx, s.Pool, "b", 4, "available")
	c1 := orderedJob(t, ctx, s.Pool, "c", 5, "available")
	c2 := legacyJob(t, ctx, s.Pool, "c", 6)
	c3 := orderedJob(t, ctx, s.Pool, "c", 7, "pending")
	d1 := orderedJob(t, ctx, s.Pool, "d", 8, "available")
	d2 := legacyJob(t, ctx, s.Pool, "d", 9)
	d3 := orderedJob(t, ctx, s.Pool, "d", 10, "pending")
	e1 := orderedJob(t, ctx, s.Pool, "e", 11, "available")
	var plain int64
	if err := s.Pool.QueryRow(ctx, `
		INSERT INTO river_job (kind, args, queue, max_attempts, state, attempt, attempted_at)
		VALUES ('plain_step', '{}', 'orders', 3, 'running', 1, now()) RETURNING id`).Scan(&plain); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = ANY($1)`,
		[]int64{a1, b1, c1, d1}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'cancelled', finalized_at = now() WHERE id = $1`, c2); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = $1`, d2); err != nil {
		t.Fatal(err)
	}

	notifications := s.ListenRiverInsert(t, ctx)

	tx, err := disp.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	var n int
	if err := tx.QueryRow(ctx, `SELECT outbox_ordering_complete($1)`, []int64{a1, b1, c1, d1, e1, plain}).Scan(&n); err != nil {
		t.Fatalf("outbox_ordering_complete as outbox_dispatcher: %v", err)
	}
	if n != 5 {
		t.Errorf("completed %d jobs, want 5 (all but the one that was not running)", n)
	}
	var syncCommit, release string
	if err := tx.QueryRow(ctx, `SELECT current_setting('synchronous_commit'), current_setting('outbox.ordering_release', true)`).Scan(&syncCommit, &release); err != nil {
		t.Fatal(err)
	}
	if syncCommit != "off" {
		t.Errorf("synchronous_commit is %q after the call, want off for the rest of its transaction", syncCommit)
	}
	if release != "" {
		t.Errorf("outbox.ordering_release is %q after the call, want it empty: the triggers must see the transaction's other changes", release)
	}
	// River's own completion in the same transaction still releases (the
	// settled trigger fires again).
	if _, err := tx.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = $1 AND state = 'available'`, a2); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = $1 AND state = 'running'`, a2); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	for id, want := range map[int64]string{
		a1: "completed", a2: "completed", a3: "available",
		b1: "completed",
		c1: "completed", c2: "cancelled", c3: "pending",
		d1: "completed", d2: "completed", d3: "available",
		e1: "available", plain: "completed",
	} {
		if got := jobState(t, ctx, s.Pool, id); got != want {
			t.Errorf("job %d is %s, want %s", id, got, want)
		}
	}
	for k, want := range map[string]int64{"a": a3, "b": 0, "c": c2, "d": d3, "e": e1} {
		if got := keyHead(t, ctx, s.Pool, k); got != want {
			t.Errorf("key %q has head job %d, want %d", k, got, want)
		}
	}
	var parked string
	if err := s.Pool.QueryRow(ctx, `SELECT coalesce(parked_state, '') FROM outbox_ordering_key WHERE ordering_key = 'c'`).Scan(&parked); err != nil {
		t.Fatal(err)
	}
	if parked != "cancelled" {
		t.Errorf("key c is parked as %q, want cancelled (its first job in line was cancelled by hand)", parked)
	}
	if got := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait`); got != 1 {
		t.Errorf("%d jobs in line, want 1 (c's third)", got)
	}

	// The transaction's notifications (the group's release, d's and a2's
	// trigger release, all for queue orders) arrive as one.
	if got := notifications(); len(got) != 1 || (got[0] != `{"queue" : "orders"}` && got[0] != `{"queue":"orders"}`) {
		t.Fatalf("notifications %q, want one for queue orders", got)
	}
}

// TestOrderingReleaseSetByHandDisablesNothing: the setting with which
// outbox_ordering_complete tells the triggers to leave its changes to it
// (migration 017) counts only when it names the transaction making the
// change: a session (or a role's or database's settings) that sets it
// still gets every release from River's own completion.
func TestOrderingReleaseSetByHandDisablesNothing(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)

	head := orderedJob(t, ctx, s.Pool, "k", 1, "available")
	// The legacy way of waiting (a pending River row, as rows queued
	// before migration 024 wait): the only one River UI's retry reaches.
	next := legacyJob(t, ctx, s.Pool, "k", 2)
	var last int64
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('outbox.ordering_release', 'on', true)`); err != nil {
			return err
		}
		// A handoff's job still queues in the line (the enqueue trigger
		// runs).
		last = orderedJob(t, ctx, tx, "k", 3, "pending")
		if _, err := tx.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = $1`, head); err != nil {
			return err
		}
		// River UI's retry of the waiting job: the hold trigger keeps it
		// pending.
		if _, err := tx.Exec(ctx, `UPDATE river_job SET state = 'available' WHERE id = $1`, next); err != nil {
			return err
		}
		var state string
		if err := tx.QueryRow(ctx, `SELECT state::text FROM river_job WHERE id = $1`, next).Scan(&state); err != nil {
			return err
		}
		if state != "pending" {
			t.Errorf("with the setting on by hand, a retry made the waiting job %s, want it held pending", state)
		}
		_, err := tx.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = $1`, head)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := jobState(t, ctx, s.Pool, next); got != "available" {
		t.Fatalf("with the setting on by hand, River's completion of the head left the next job %s, want available", got)
	}
	if got := keyHead(t, ctx, s.Pool, "k"); got != next {
		t.Fatalf("the key's head is job %d, want %d", got, next)
	}
	if got := jobState(t, ctx, s.Pool, last); got != "pending" {
		t.Fatalf("the last job is %s while the next one is its key's head, want pending", got)
	}
	if err := completeJob(ctx, s.Pool, "river", next, 3*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := jobState(t, ctx, s.Pool, last); got != "available" {
		t.Fatalf("the last job is %s after its predecessor completed, want available", got)
	}
}
