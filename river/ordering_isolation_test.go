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

			// The head, inserted as a handoff inserts it (the enqueue
			// trigger makes it the key's head).
			insert := `INSERT INTO river_job (kind, args, queue, max_attempts, metadata)
				VALUES ('order_probe', jsonb_build_object('key', 'k', 'seq', $1::int), 'ord', 3,
				        jsonb_build_object('outbox_ordering_key', 'k', 'outbox_ordering_position', $1::bigint))
				RETURNING state::text`
			var state string
			if err := s.Pool.QueryRow(ctx, insert, 1).Scan(&state); err != nil || state != "available" {
				t.Fatalf("head inserted as %q (%v), want available", state, err)
			}
			pgtest.WaitFor(t, 30*time.Second, "the head runs", func() bool { return len(p.started("ord/k")) == 1 })

			// A handoff (at READ COMMITTED, as the dispatcher's) queues the
			// next job behind the running head and stays open.
			handoff, handoffPID := pgtest.OpenTx(t, ctx, s.Pool)
			if err := handoff.QueryRow(ctx, insert, 2).Scan(&state); err != nil || state != "pending" {
				t.Fatalf("second job inserted as %q (%v), want pending", state, err)
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
		})
	}
}
