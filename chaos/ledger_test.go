package chaos

import (
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestLedgerDetectsEveryKindOfLoss feeds the ledger a hand-made outbox
// with one of each fault, so that a chaos scenario passing means something:
// a done event without its job (lost), a second job for a pair
// (duplicated), a pending event (stuck), a missing event (lost), a job for
// an event the ledger does not know and a stored rolled-back event
// (phantom).
func TestLedgerDetectsEveryKindOfLoss(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	const run = "ledger"
	const n = 8
	// Events 0..7 as a healthy dispatcher leaves them: mail → one job,
	// audit (3) → two, unrouted (7) → failed.
	for i := range n {
		if i == 5 {
			continue // lost: never stored
		}
		status := "done"
		switch i {
		case 7:
			status = "failed"
		case 6:
			status = "pending" // stuck
		}
		var id int64
		if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, dispatch_key, status) VALUES ($1, '{}', $2, $3::outbox_status) RETURNING id`,
			eventType(i), keyOf(run, i), status).Scan(&id); err != nil {
			t.Fatal(err)
		}
		if status != "done" {
			continue
		}
		queues := queuesOf(eventType(i))
		if i == 1 {
			queues = nil // lost: done without its job
		}
		if i == 2 {
			queues = append(queues, queues...) // duplicated
		}
		var ids []int64
		for _, q := range queues {
			var jid int64
			if err := s.Pool.QueryRow(ctx, `INSERT INTO river_job (args, kind, max_attempts, queue, state)
				VALUES (jsonb_build_object('event_id', $1::bigint, 'dispatch_key', $2::text), 'outbox_event', 5, $3, 'available') RETURNING id`,
				id, keyOf(run, i), q).Scan(&jid); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, jid)
		}
		if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET river_job_ids = $2 WHERE id = $1`, id, ids); err != nil {
			t.Fatal(err)
		}
	}
	// A phantom job for an unknown event, and a "rolled-back" key stored.
	if _, err := s.Pool.Exec(ctx, `INSERT INTO river_job (args, kind, max_attempts, queue, state)
		VALUES (jsonb_build_object('event_id', 999999, 'dispatch_key', 'ledger:999'), 'outbox_event', 5, 'outbox_mail', 'available')`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, dispatch_key) VALUES ('mail.a.b', '{}', 'rb-1')`); err != nil {
		t.Fatal(err)
	}
	l := &ledger{run: run, n: n, rolledBack: []string{"rb-1"}}
	c, err := l.check(ctx, s.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if c.Lost != 2 || c.Duplicated < 1 || c.Pending != 1 || c.Phantom != 2 {
		t.Fatalf("ledger saw lost=%d duplicated=%d stuck=%d phantom=%d, want 2, ≥1, 1, 2\n%v", c.Lost, c.Duplicated, c.Pending, c.Phantom, c.Problems)
	}
}
