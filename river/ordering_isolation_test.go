package outboxriver_test

import (
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestOrderedCompletionAtRepeatableRead: a River client whose sessions
// start their transactions at REPEATABLE READ or SERIALIZABLE still
// releases a job that a handoff queued behind the key's head while the
// head's completion waited for it. The release of a line that looks empty
// waits for the handoffs that hold the key's row and then looks again;
// only a READ COMMITTED statement sees what they queued. Before the
// middleware ran its completions at READ COMMITTED whatever the session's
// default, the release deleted the key's row and left the job pending
// with nothing to release it.
func TestOrderedCompletionAtRepeatableRead(t *testing.T) {
	t.Parallel()
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			ctx := pgtest.Context(t, 90*time.Second)
			workers := pgtest.IsolationPool(t, s, level)
			p := newProbe()
			release := p.holdSeq(t, "k", "", 1)
			probeClient(t, workers, p, "ord")

			// The jobs, inserted as a handoff inserts them: with the id it
			// takes from River's sequence first. The enqueue trigger makes
			// the first the key's head and queues the next in the key's
			// line, where it waits with no River row (migration 024).
			insert := `WITH ins AS (
				INSERT INTO river_job (id, kind, args, queue, max_attempts, metadata)
				SELECT $1, 'order_probe', jsonb_build_object('key', 'k', 'seq', $2::int), 'ord', 3,
				       jsonb_build_object('outbox_ordering_key', 'k', 'outbox_ordering_position', $2::bigint)
				FROM ` + pgtest.AsHandoff + `
				RETURNING id)
				SELECT count(*) FROM ins`
			state := `SELECT state, in_line FROM ` + pgtest.Jobs + ` WHERE id = $1`
			var headID, nextID int64
			if err := s.Pool.QueryRow(ctx, `SELECT nextval('river_job_id_seq')`).Scan(&headID); err != nil {
				t.Fatal(err)
			}
			var inserted int
			var got string
			var inLine bool
			if err := s.Pool.QueryRow(ctx, insert, headID, 1).Scan(&inserted); err != nil || inserted != 1 {
				t.Fatalf("head inserted into river_job %d times (%v), want once", inserted, err)
			}
			if err := s.Pool.QueryRow(ctx, state, headID).Scan(&got, &inLine); err != nil || got != "available" || inLine {
				t.Fatalf("head is %q, in the line %v (%v), want available", got, inLine, err)
			}
			pgtest.WaitFor(t, 30*time.Second, "the head runs", func() bool { return len(p.started("ord/k")) == 1 })

			// A handoff (at READ COMMITTED, as the dispatcher's) queues the
			// next job behind the running head and stays open.
			handoff, handoffPID := pgtest.OpenTx(t, ctx, s.Pool)
			if err := handoff.QueryRow(ctx, `SELECT nextval('river_job_id_seq')`).Scan(&nextID); err != nil {
				t.Fatal(err)
			}
			if err := handoff.QueryRow(ctx, insert, nextID, 2).Scan(&inserted); err != nil || inserted != 0 {
				t.Fatalf("second job inserted into river_job %d times (%v), want it in the line", inserted, err)
			}
			if err := handoff.QueryRow(ctx, state, nextID).Scan(&got, &inLine); err != nil || got != "pending" || !inLine {
				t.Fatalf("second job is %q, in the line %v (%v), want pending in the line", got, inLine, err)
			}

			// The head ends; its completion finds the line empty and waits
			// for the handoff.
			release()
			pgtest.WaitFor(t, 30*time.Second, "the completion waits for the handoff", func() bool { return pgtest.WaitingFor(t, s.Pool, handoffPID) })
			if err := handoff.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			pgtest.WaitFor(t, 30*time.Second, "the queued job runs after the head", func() bool { return len(p.ended("ord/k")) == 2 })
			if got := p.started("ord/k"); len(got) != 2 || got[0] != 1 || got[1] != 2 {
				t.Fatalf("jobs started in order %v, want [1 2]", got)
			}
			pgtest.WaitFor(t, 30*time.Second, "the key's row goes once its line is empty", func() bool {
				return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key`) == 0
			})
			// The queued job ran as the River row of the id it was given.
			if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'completed' AND (args->>'seq')::int = 2`, nextID); n != 1 {
				t.Fatalf("%d completed River rows of job %d with seq 2, want 1", n, nextID)
			}
		})
	}
}
