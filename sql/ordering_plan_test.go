package outboxsql_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
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
// included, for one id. Since migration 024 the release of a job that
// waits in its key's line inserts its River row and reads none; the
// release of a job queued the legacy way (a pending River row, as rows
// queued before 024 wait) still updates it from pending to available.
func TestOrderedCompletionUpdatesByPrimaryKey(t *testing.T) {
	t.Parallel()
	// A group of one takes the triggers' path, a larger one the
	// function's own statements (migration 017).
	for _, group := range []int{1, 2} {
		for _, legacy := range []bool{false, true} {
			name := fmt.Sprintf("group of %d, next in line", group)
			if legacy {
				name = fmt.Sprintf("group of %d, next pending in river_job", group)
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				testOrderedCompletionUpdatesByPrimaryKey(t, group, legacy)
			})
		}
	}
}

func testOrderedCompletionUpdatesByPrimaryKey(t *testing.T, group int, legacy bool) {
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)

	// A table of finished jobs, as River's keeps for a day: 'running' and
	// 'pending' are rare in its statistics.
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO river_job (kind, args, queue, max_attempts, state, attempt, attempted_at, finalized_at)
		SELECT 'done_step', '{}', 'orders', 3, 'completed', 1, now(), now() FROM generate_series(1, 20000)`); err != nil {
		t.Fatal(err)
	}
	var heads, nexts []int64
	for i := range group {
		k := fmt.Sprintf("k%d", i)
		heads = append(heads, orderedJob(t, ctx, s.Pool, k, int64(2*i+1), "available"))
		if legacy {
			nexts = append(nexts, legacyJob(t, ctx, s.Pool, k, int64(2*i+2)))
		} else {
			nexts = append(nexts, orderedJob(t, ctx, s.Pool, k, int64(2*i+2), "pending"))
		}
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = ANY($1)`, heads); err != nil {
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
	// The session's index scans, counted without waiting for the
	// statistics collector: they include the session's earlier
	// transactions' until it reports them (never inside a transaction),
	// so the call's are the difference.
	scans := func() (fetching, pkey, seq int64) {
		t.Helper()
		if err := tx.QueryRow(ctx, `
			SELECT pg_stat_get_xact_numscans('river_job_prioritized_fetching_index'::regclass),
			       pg_stat_get_xact_numscans('river_job_pkey'::regclass),
			       pg_stat_get_xact_numscans('river_job'::regclass)`).Scan(&fetching, &pkey, &seq); err != nil {
			t.Fatal(err)
		}
		return fetching, pkey, seq
	}
	fetching0, pkey0, seq0 := scans()
	var n int
	if err := tx.QueryRow(ctx, `SELECT outbox_ordering_complete($1)`, heads).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != group {
		t.Fatalf("completed %d jobs, want %d", n, group)
	}
	fetching, pkey, seq := scans()
	fetching, pkey, seq = fetching-fetching0, pkey-pkey0, seq-seq0
	if seq != 0 {
		t.Errorf("the completion and release read River's whole table %d times, want 0", seq)
	}
	if fetching != 0 {
		t.Errorf("the completion and release scanned River's fetching index %d times, want 0 (primary key scans: %d)", fetching, pkey)
	}
	if legacy && pkey < 2 {
		t.Errorf("the completion and release scanned the primary key %d times, want at least 2 (the completion and the release's update)", pkey)
	}
	if !legacy && pkey < 1 {
		t.Errorf("the completion scanned the primary key %d times, want at least 1 (the release inserts the next jobs)", pkey)
	}
	for _, next := range nexts {
		if state, inLine := jobRow(t, ctx, tx, next); state != "available" || inLine {
			t.Fatalf("the next job is %s (in the line %v) after its head completed, want available in river_job", state, inLine)
		}
	}
}

// TestOrderedCompletionPlansHoldAsKeysGrow: outbox_ordering_complete's
// statements are planned once per session (migration 017), with the
// statistics of the first call. Made while the key table held two keys,
// no plan may read the whole table once it holds many: a group of two
// completions reads a handful of the key index's entries, not thousands.
// (A semi-join with the key table, planned small, scanned its whole
// primary key on every call.)
func TestOrderedCompletionPlansHoldAsKeysGrow(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	conn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close(context.Background()) }()

	group := func(keys ...string) []int64 {
		var heads []int64
		for i, k := range keys {
			heads = append(heads, orderedJob(t, ctx, s.Pool, k, int64(2*i+1), "available"))
			orderedJob(t, ctx, s.Pool, k, int64(2*i+2), "pending")
		}
		if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = ANY($1)`, heads); err != nil {
			t.Fatal(err)
		}
		return heads
	}
	first := group("a", "b")
	if _, err := s.Pool.Exec(ctx, `ANALYZE outbox_ordering_key`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SELECT outbox_ordering_complete($1)`, first); err != nil {
		t.Fatal(err)
	}

	// Many more keys, no new statistics: the session keeps its plans.
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO river_job (kind, args, queue, max_attempts, metadata)
		SELECT 'order_step', '{}', 'orders', 3, jsonb_build_object('outbox_ordering_key', 'many-' || g, 'outbox_ordering_position', 1000 + g)
		FROM generate_series(1, 3000) g`); err != nil {
		t.Fatal(err)
	}
	second := group("c", "d")

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	// The session's counts, less those of its earlier transactions that
	// it has not reported yet.
	counts := func() (read, seq int64) {
		t.Helper()
		if err := tx.QueryRow(ctx, `
			SELECT pg_stat_get_xact_tuples_returned('outbox_ordering_key_pkey'::regclass),
			       pg_stat_get_xact_numscans('outbox_ordering_key'::regclass)`).Scan(&read, &seq); err != nil {
			t.Fatal(err)
		}
		return read, seq
	}
	read0, seq0 := counts()
	var n int
	if err := tx.QueryRow(ctx, `SELECT outbox_ordering_complete($1)`, second).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Fatalf("completed %d jobs, want 2", n)
	}
	read, seq := counts()
	read, seq = read-read0, seq-seq0
	if read > 50 || seq > 0 {
		t.Fatalf("completing two heads read %d entries of the key table's primary key and scanned the table %d times, want a handful and none (3,000 keys)", read, seq)
	}
}
