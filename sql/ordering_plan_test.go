package outboxsql_test

import (
	"context"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestOrderedCompletionUpdatesByPrimaryKey: outbox_ordering_complete and
// the release it triggers find the River rows they update by primary key,
// even where the statistics make the states they check rare. Before
// migration 014 the planner then chose River's fetching index (state,
// queue, priority, scheduled_at, id) for WHERE id = $1 AND state =
// 'running' (and 'pending'), a scan of every entry of that state, dead ones
// included, for one id.
func TestOrderedCompletionUpdatesByPrimaryKey(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)

	// A table of finished jobs, as River's keeps for a day: 'running' and
	// 'pending' are rare in its statistics.
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO river_job (kind, args, queue, max_attempts, state, attempt, attempted_at, finalized_at)
		SELECT 'done_step', '{}', 'orders', 3, 'completed', 1, now(), now() FROM generate_series(1, 20000)`); err != nil {
		t.Fatal(err)
	}
	head := orderedJob(t, ctx, s.Pool, "k", 1, "available")
	next := orderedJob(t, ctx, s.Pool, "k", 2, "pending")
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `ANALYZE river_job`); err != nil {
		t.Fatal(err)
	}

	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	var n int
	if err := tx.QueryRow(ctx, `SELECT outbox_ordering_complete(ARRAY[$1::bigint])`, head).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("completed %d jobs, want 1", n)
	}
	// This transaction's index scans, counted without waiting for the
	// statistics collector.
	var fetching, pkey int64
	if err := tx.QueryRow(ctx, `
		SELECT pg_stat_get_xact_numscans('river_job_prioritized_fetching_index'::regclass),
		       pg_stat_get_xact_numscans('river_job_pkey'::regclass)`).Scan(&fetching, &pkey); err != nil {
		t.Fatal(err)
	}
	if fetching != 0 {
		t.Errorf("the completion and release scanned River's fetching index %d times, want 0 (primary key scans: %d)", fetching, pkey)
	}
	if pkey < 2 {
		t.Errorf("the completion and release scanned the primary key %d times, want at least 2 (one per job updated)", pkey)
	}
	var state string
	if err := tx.QueryRow(ctx, `SELECT state::text FROM river_job WHERE id = $1`, next).Scan(&state); err != nil {
		t.Fatal(err)
	}
	if state != "available" {
		t.Fatalf("the next job is %s after its head completed, want available", state)
	}
}
