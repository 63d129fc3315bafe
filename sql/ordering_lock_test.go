package outboxsql_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// queryRower is a pool, or a transaction.
type queryRower interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}

// orderedJob inserts an ordered River job of key k at position pos, as a
// handoff does (with its id taken from River's sequence first; the enqueue
// trigger makes it the head or queues it in the key's line), with q (a
// pool, or a transaction left open), checks that it is in state want
// (available: the head, a River row; pending: queued, waiting in the line
// with no River row, migration 024) and returns its id.
func orderedJob(t *testing.T, ctx context.Context, q queryRower, k string, pos int64, want string) int64 {
	t.Helper()
	var id int64
	if err := q.QueryRow(ctx, `SELECT nextval('river_job_id_seq')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	var inserted int
	err := q.QueryRow(ctx, `
		WITH ins AS (
			INSERT INTO river_job (id, kind, args, queue, max_attempts, metadata)
			SELECT $1, 'order_step', '{}', 'orders', 3, jsonb_build_object('outbox_ordering_key', $2::text, 'outbox_ordering_position', $3::bigint)
			FROM `+pgtest.AsHandoff+`
			RETURNING id)
		SELECT count(*) FROM ins`, id, k, pos).Scan(&inserted)
	if err != nil {
		t.Fatalf("insert job of %q at %d: %v", k, pos, err)
	}
	state, inLine := jobRow(t, ctx, q, id)
	if state != want {
		t.Fatalf("job of %q at %d is %s, want %s", k, pos, state, want)
	}
	if inLine != (want == "pending") || (inserted == 1) == inLine {
		t.Fatalf("job of %q at %d (%s): inserted into river_job %d, in the line %v; a queued job waits in the line, not in river_job", k, pos, state, inserted, inLine)
	}
	return id
}

// legacyJob inserts an ordered job of key k at position pos that must wait
// behind its key's head, inserted by other code than the handoff (here
// as scheduled): it waits the way every job waited before migration 024,
// and rows queued before 024 still do, as a pending River row with a line
// row without its columns (kind NULL). River's actions (retry, cancel,
// completion by hand) reach only such a waiting job. It checks that and
// returns its id.
func legacyJob(t *testing.T, ctx context.Context, q queryRower, k string, pos int64) int64 {
	t.Helper()
	return legacyJobAs(t, ctx, q, k, pos, "scheduled")
}

// legacyJobAs is legacyJob with the River state the job is inserted in
// (without the handoff's mark, pgtest.AsHandoff, any state waits as a
// pending River row).
func legacyJobAs(t *testing.T, ctx context.Context, q queryRower, k string, pos int64, insertAs string) int64 {
	t.Helper()
	var id int64
	var state string
	err := q.QueryRow(ctx, `
		INSERT INTO river_job (kind, args, queue, max_attempts, state, metadata)
		VALUES ('order_step', '{}', 'orders', 3, $3, jsonb_build_object('outbox_ordering_key', $1::text, 'outbox_ordering_position', $2::bigint))
		RETURNING id, state::text`, k, pos, insertAs).Scan(&id, &state)
	if err != nil {
		t.Fatalf("insert legacy job of %q at %d as %s: %v", k, pos, insertAs, err)
	}
	var lined int
	if err := q.QueryRow(ctx, `SELECT count(*) FROM outbox_ordering_wait WHERE job_id = $1 AND kind IS NULL`, id).Scan(&lined); err != nil {
		t.Fatal(err)
	}
	if state != "pending" || lined != 1 {
		t.Fatalf("legacy job of %q at %d is %s in river_job with %d line rows without columns, want pending with 1", k, pos, state, lined)
	}
	if got, inLine := jobRow(t, ctx, q, id); got != "pending" || inLine {
		t.Fatalf("legacy job of %q at %d reads %s, in the line %v; want pending in river_job", k, pos, got, inLine)
	}
	return id
}

// jobRow reads job id's state, whether it waits in its key's line or is a
// River row (pgtest.Jobs), and whether it waits in the line; it fails
// unless the job is exactly one of the two.
func jobRow(t *testing.T, ctx context.Context, q queryRower, id int64) (state string, inLine bool) {
	t.Helper()
	var n int
	err := q.QueryRow(ctx, `
		SELECT count(*), coalesce(min(state), ''), coalesce(bool_or(in_line), false)
		FROM `+pgtest.Jobs+` WHERE id = $1`, id).Scan(&n, &state, &inLine)
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("job %d is %d times in river_job and the line, want once", id, n)
	}
	return state, inLine
}

// completers are the two ways an ordered job is completed: River's own
// completion statement (its completer, or a worker without outboxriver's
// middleware), which fires the settled trigger, and
// outbox_ordering_complete (the middleware's), which releases the next job
// itself when it completes more than one job (migration 017).
var completers = []struct {
	name string
	sql  string
}{
	{"river", `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = $1 AND state = 'running'`},
	{"function", `SELECT outbox_ordering_complete(ARRAY[$1::bigint, $2::bigint])`},
}

// completeJob makes job id run and then completes it with the completer's
// statement, under a lock_timeout of wait.
func completeJob(ctx context.Context, pool *pgxpool.Pool, completer string, id int64, wait time.Duration) error {
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = $1 AND state = 'available'`, id); err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, fmt.Sprintf(`SET LOCAL lock_timeout = '%dms'`, wait.Milliseconds())); err != nil {
			return err
		}
		if completer == "function" {
			// With a job without a key beside it: a group of one takes the
			// trigger path (migration 017), the other completer here.
			var plain int64
			if err := tx.QueryRow(ctx, `
				INSERT INTO river_job (kind, args, queue, max_attempts, state, attempt, attempted_at)
				VALUES ('plain_step', '{}', 'orders', 3, 'running', 1, now()) RETURNING id`).Scan(&plain); err != nil {
				return err
			}
			var n int
			err := tx.QueryRow(ctx, completers[1].sql, id, plain).Scan(&n)
			if err == nil && n != 2 {
				err = fmt.Errorf("job %d was not running", id)
			}
			return err
		}
		tag, err := tx.Exec(ctx, completers[0].sql, id)
		if err == nil && tag.RowsAffected() != 1 {
			err = fmt.Errorf("job %d was not running", id)
		}
		return err
	})
}

// jobState reads job id's state, whether it is a River row or waits in
// its key's line (pending).
func jobState(t *testing.T, ctx context.Context, pool *pgxpool.Pool, id int64) string {
	t.Helper()
	state, _ := jobRow(t, ctx, pool, id)
	return state
}

func keyHead(t *testing.T, ctx context.Context, pool *pgxpool.Pool, k string) int64 {
	t.Helper()
	var head int64
	err := pool.QueryRow(ctx, `SELECT head_job_id FROM outbox_ordering_key WHERE tenant_id = '' AND ordering_key = $1 AND queue = 'orders'`, k).Scan(&head)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return head
}

// TestReleaseDoesNotWaitForAHandoffQueueingBehind: while a handoff that
// queues a job behind a key's head is still open, the head's completion
// releases the job already waiting at once (migration 013: the handoff
// holds the key's row FOR KEY SHARE, the release FOR NO KEY UPDATE). Under
// 012 the completion waited for the handoff's commit and ran into its
// lock_timeout. The job the handoff queued waits its turn and is released
// by the next completion. Both completers (River's statement and
// outbox_ordering_complete) behave so.
func TestReleaseDoesNotWaitForAHandoffQueueingBehind(t *testing.T) {
	t.Parallel()
	for _, c := range completers {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			ctx := pgtest.Context(t, 60*time.Second)

			head := orderedJob(t, ctx, s.Pool, "k", 1, "available")
			next := orderedJob(t, ctx, s.Pool, "k", 2, "pending")
			handoff, _ := pgtest.OpenTx(t, ctx, s.Pool)
			last := orderedJob(t, ctx, handoff, "k", 3, "pending")

			if err := completeJob(ctx, s.Pool, c.name, head, 3*time.Second); err != nil {
				t.Fatalf("completing the head while a handoff queues behind it: %v", err)
			}
			if got := jobState(t, ctx, s.Pool, next); got != "available" {
				t.Fatalf("the waiting job is %s after the head completed, want available", got)
			}
			if got := keyHead(t, ctx, s.Pool, "k"); got != next {
				t.Fatalf("the key's head is job %d, want %d", got, next)
			}
			if err := handoff.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if got := jobState(t, ctx, s.Pool, last); got != "pending" {
				t.Fatalf("the handed-off job is %s, want pending behind job %d", got, next)
			}
			if err := completeJob(ctx, s.Pool, c.name, next, 3*time.Second); err != nil {
				t.Fatal(err)
			}
			if got := jobState(t, ctx, s.Pool, last); got != "available" {
				t.Fatalf("the last job is %s after its predecessor completed, want available", got)
			}
			if got := keyHead(t, ctx, s.Pool, "k"); got != last {
				t.Fatalf("the key's head is job %d, want %d", got, last)
			}
		})
	}
}

// TestReleaseOfAnEmptyLineWaitsForAHandoff: when a key's head completes
// with no job in line but a handoff still open has queued one behind it
// (invisible to the release), the release waits for the handoff and then
// releases that job; it never deletes the key's row and strands the job
// pending. Both completers behave so.
func TestReleaseOfAnEmptyLineWaitsForAHandoff(t *testing.T) {
	t.Parallel()
	for _, c := range completers {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			ctx := pgtest.Context(t, 60*time.Second)

			head := orderedJob(t, ctx, s.Pool, "k", 1, "available")
			handoff, handoffPID := pgtest.OpenTx(t, ctx, s.Pool)
			queued := orderedJob(t, ctx, handoff, "k", 2, "pending")

			done := make(chan error, 1)
			go func() { done <- completeJob(ctx, s.Pool, c.name, head, 30*time.Second) }()
			pgtest.WaitFor(t, 20*time.Second, "the completion waits for the handoff", func() bool {
				return pgtest.WaitingFor(t, s.Pool, handoffPID)
			})
			select {
			case err := <-done:
				t.Fatalf("the completion returned (%v) before the handoff committed", err)
			default:
			}
			if err := handoff.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatalf("completing the head: %v", err)
			}
			if got := jobState(t, ctx, s.Pool, queued); got != "available" {
				t.Fatalf("the job the handoff queued is %s after the head completed, want available", got)
			}
			if got := keyHead(t, ctx, s.Pool, "k"); got != queued {
				t.Fatalf("the key's head is job %d, want %d", got, queued)
			}
			if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait`); n != 0 {
				t.Fatalf("%d jobs left in line, want 0", n)
			}
		})
	}
}

// TestUnparkLocksQueuesInByteOrder: outbox_unpark of every queue of a key
// locks (and reports) the key's rows in byte order, the order in which a
// handoff locks them (internal/lockorder), whatever the column's collation
// (migration 013; under 011, a collation that sorts "a" before "B" made it
// lock in the other order than a handoff, and the two could deadlock).
func TestUnparkLocksQueuesInByteOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	if _, err := s.Pool.Exec(ctx, `ALTER TABLE outbox_ordering_key ALTER COLUMN queue TYPE text COLLATE "und-x-icu"`); err != nil {
		t.Skipf("no ICU collation to sort by: %v", err)
	}
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO outbox_ordering_key (tenant_id, ordering_key, queue, head_job_id, head_position, parked_at, parked_state)
		VALUES ('', 'k', 'a', 1, 1, now(), 'discarded'), ('', 'k', 'B', 2, 1, now(), 'discarded')`); err != nil {
		t.Fatal(err)
	}
	var byCollation []string
	rows, err := s.Pool.Query(ctx, `SELECT queue FROM outbox_ordering_key ORDER BY queue`)
	if err != nil {
		t.Fatal(err)
	}
	if byCollation, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(byCollation) != "[a B]" {
		t.Fatalf("the column's collation sorts %v: the test needs one that sorts a before B", byCollation)
	}
	rows, err = s.Pool.Query(ctx, `SELECT o_queue FROM outbox_unpark('test', true, 'k', 'skip')`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != "[B a]" {
		t.Fatalf("outbox_unpark went through the queues as %v, want byte order [B a]", got)
	}
}
