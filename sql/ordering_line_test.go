package outboxsql_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestWaitedCountIsPerStatement: the enqueue trigger counts the jobs it
// kept out of river_job (they wait in their key's line, migration 024) in
// outbox.ordering_waited, tagged with the start of the statement that
// inserted them, so that a transaction's later statement does not count
// an earlier one's: each statement reads "<its start in µs>/<its count>".
func TestWaitedCountIsPerStatement(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)

	orderedJob(t, ctx, s.Pool, "k", 1, "available")
	tx, _ := pgtest.OpenTx(t, ctx, s.Pool)
	// Each statement gives its start as the trigger tags it, and how many
	// of its jobs river_job got.
	insert := func(positions ...int64) (tag string, inserted int) {
		t.Helper()
		err := tx.QueryRow(ctx, `
			WITH ins AS (
				INSERT INTO river_job (id, kind, args, queue, max_attempts, metadata)
				SELECT nextval('river_job_id_seq'), 'order_step', '{}', 'orders', 3,
				       jsonb_build_object('outbox_ordering_key', 'k', 'outbox_ordering_position', p)
				FROM unnest($1::bigint[]) p, `+pgtest.AsHandoff+`
				RETURNING id)
			SELECT (extract(epoch FROM statement_timestamp()) * 1000000)::bigint::text, (SELECT count(*) FROM ins)`,
			positions).Scan(&tag, &inserted)
		if err != nil {
			t.Fatal(err)
		}
		return tag, inserted
	}
	waited := func() string {
		t.Helper()
		var v string
		if err := tx.QueryRow(ctx, `SELECT coalesce(current_setting('outbox.ordering_waited', true), '')`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}

	var tags []string
	for i, positions := range [][]int64{{2}, {3}, {4, 5}} {
		tag, inserted := insert(positions...)
		if inserted != 0 {
			t.Fatalf("statement %d: river_job got %d of its jobs, want none (they wait behind the head)", i+1, inserted)
		}
		if got, want := waited(), fmt.Sprintf("%s/%d", tag, len(positions)); got != want {
			t.Fatalf("statement %d: outbox.ordering_waited is %q, want %q", i+1, got, want)
		}
		for _, prev := range tags {
			if prev == tag {
				t.Fatalf("statement %d has the tag %s of an earlier statement", i+1, tag)
			}
		}
		tags = append(tags, tag)
	}
	var lined int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM outbox_ordering_wait WHERE kind IS NOT NULL`).Scan(&lined); err != nil {
		t.Fatal(err)
	}
	if lined != 4 {
		t.Fatalf("%d jobs wait in the line, want 4", lined)
	}
}

// TestLegacyWaitingJobIsReleasedByUpdate: an ordered job behind its key's
// head that other code than the handoff inserted (as available, the way
// River's InsertManyTx does, or as scheduled) waits as every job waited
// before migration 024, and as rows queued before 024 still do: a pending
// River row, with a line row that holds none of its columns (kind NULL).
// The head's completion, by River's statement or by
// outbox_ordering_complete's group path, makes that row available,
// keeping its id.
func TestLegacyWaitingJobIsReleasedByUpdate(t *testing.T) {
	t.Parallel()
	for _, c := range completers {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			ctx := pgtest.Context(t, 60*time.Second)

			head := orderedJob(t, ctx, s.Pool, "k", 1, "available")
			ids := []int64{
				legacyJobAs(t, ctx, s.Pool, "k", 2, "available"),
				legacyJobAs(t, ctx, s.Pool, "k", 3, "scheduled"),
			}
			// With the handoff's mark, a job not shaped as the handoff's
			// (attempted before) waits as a River row too: the line keeps
			// only the columns of the handoff's jobs.
			var attempted int64
			var state string
			err := s.Pool.QueryRow(ctx, `
				INSERT INTO river_job (kind, args, queue, max_attempts, attempt, metadata)
				SELECT 'order_step', '{}', 'orders', 3, 1, jsonb_build_object('outbox_ordering_key', 'k', 'outbox_ordering_position', 4)
				FROM `+pgtest.AsHandoff+`
				RETURNING id, state::text`).Scan(&attempted, &state)
			if err != nil || state != "pending" {
				t.Fatalf("an attempted job inserted with the handoff's mark behind the head: %s (%v), want a pending River row", state, err)
			}
			if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait WHERE job_id = $1 AND kind IS NULL`, attempted); n != 1 {
				t.Fatalf("the attempted job has %d line rows without its columns, want 1", n)
			}
			ids = append(ids, attempted)

			prev := head
			for i, id := range ids {
				if err := completeJob(ctx, s.Pool, c.name, prev, 3*time.Second); err != nil {
					t.Fatal(err)
				}
				if state, inLine := jobRow(t, ctx, s.Pool, id); state != "available" || inLine {
					t.Fatalf("job %d is %s (in the line %v) after its predecessor completed, want available in river_job", i+1, state, inLine)
				}
				if got := keyHead(t, ctx, s.Pool, "k"); got != id {
					t.Fatalf("the key's head is job %d, want %d", got, id)
				}
				if i+1 < len(ids) {
					if got := jobState(t, ctx, s.Pool, ids[i+1]); got != "pending" {
						t.Fatalf("the job behind is %s, want pending", got)
					}
				}
				prev = id
			}
			if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait`); n != 0 {
				t.Fatalf("%d jobs left in line, want 0", n)
			}
		})
	}
}

// TestWaitingJobEntersRiverAsHandedOff: a job shaped as the handoff's that
// must wait behind its key's head has no River row while it waits (its
// columns are in its line row); the head's completion, by River's statement
// or by outbox_ordering_complete's group path, inserts it into river_job,
// available, with the id it was given at the handoff and the columns it
// was handed off with.
func TestWaitingJobEntersRiverAsHandedOff(t *testing.T) {
	t.Parallel()
	for _, c := range completers {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			ctx := pgtest.Context(t, 60*time.Second)

			head := orderedJob(t, ctx, s.Pool, "k", 1, "available")
			var id int64
			if err := s.Pool.QueryRow(ctx, `SELECT nextval('river_job_id_seq')`).Scan(&id); err != nil {
				t.Fatal(err)
			}
			const cols = `args::text, created_at, kind, max_attempts, metadata::text, priority, queue, tags::text`
			if _, err := s.Pool.Exec(ctx, `
				INSERT INTO river_job (id, args, created_at, kind, max_attempts, metadata, priority, queue, tags)
				SELECT $1, '{"n": 7, "s": "x"}', '2026-01-02 03:04:05.678901+00', 'line_step', 5,
				       '{"outbox_ordering_key": "k", "outbox_ordering_position": 2, "outbox_event_id": 42, "other": [1, 2]}',
				       3, 'orders', '{a,b}'
				FROM `+pgtest.AsHandoff, id); err != nil {
				t.Fatal(err)
			}
			if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1`, id); n != 0 {
				t.Fatalf("the waiting job has %d River rows, want none", n)
			}
			if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait WHERE job_id = $1 AND kind IS NOT NULL AND event_id = 42`, id); n != 1 {
				t.Fatalf("the waiting job has %d line rows with its columns, want 1", n)
			}

			if err := completeJob(ctx, s.Pool, c.name, head, 3*time.Second); err != nil {
				t.Fatal(err)
			}
			var args, metadata, kind, queue, tags, state string
			var created time.Time
			var maxAttempts, priority, attempt int
			err := s.Pool.QueryRow(ctx, `SELECT `+cols+`, state::text, attempt FROM river_job WHERE id = $1`, id).
				Scan(&args, &created, &kind, &maxAttempts, &metadata, &priority, &queue, &tags, &state, &attempt)
			if err != nil {
				t.Fatalf("the released job's River row: %v", err)
			}
			if state != "available" || attempt != 0 {
				t.Errorf("the released job is %s at attempt %d, want available at 0", state, attempt)
			}
			if args != `{"n": 7, "s": "x"}` || kind != "line_step" || maxAttempts != 5 || priority != 3 || queue != "orders" || tags != "{a,b}" {
				t.Errorf("the released job has args %s, kind %s, max_attempts %d, priority %d, queue %s, tags %s; want those it was handed off with",
					args, kind, maxAttempts, priority, queue, tags)
			}
			if metadata != `{"other": [1, 2], "outbox_event_id": 42, "outbox_ordering_key": "k", "outbox_ordering_position": 2}` {
				t.Errorf("the released job has metadata %s, want what it was handed off with", metadata)
			}
			if want := time.Date(2026, 1, 2, 3, 4, 5, 678901000, time.UTC); !created.Equal(want) {
				t.Errorf("the released job was created at %v, want %v (its handoff)", created, want)
			}
			if got := keyHead(t, ctx, s.Pool, "k"); got != id {
				t.Fatalf("the key's head is job %d, want %d", got, id)
			}
			if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait`); n != 0 {
				t.Fatalf("%d jobs left in line, want 0", n)
			}
		})
	}
}
