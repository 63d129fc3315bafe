package outboxsql_test

import (
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestUnholdPutsHeldEventsBack (migration 021): the events of a key that
// the dispatcher moved behind its failed first event (held_from set) get
// their own due time back when that event is requeued or deleted, and not
// when an event of the key is handed off (pending to done fires nothing:
// the events held behind a pending event wait for its own due time).
func TestUnholdPutsHeldEventsBack(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	// hold moves events as the dispatcher's holdSQL does behind a failed
	// event of their key.
	hold := func(rest ...int64) {
		t.Helper()
		for _, id := range rest {
			if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET held_from = scheduled_at, scheduled_at = now() + interval '1 minute' WHERE id = $1`, id); err != nil {
				t.Fatal(err)
			}
		}
	}
	held := func(k string) int {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE ordering_key = $1 AND held_from IS NOT NULL AND scheduled_at > now()`, k)
	}

	// Requeued: the held events are back, due now.
	head, a, b := keyedEvent(t, ctx, s.Pool, "r"), keyedEvent(t, ctx, s.Pool, "r"), keyedEvent(t, ctx, s.Pool, "r")
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', last_error = 'x' WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	hold(a, b)
	if n := held("r"); n != 2 {
		t.Fatalf("%d events held, want 2", n)
	}
	if n, _ := requeue(t, ctx, s, "failed", head); n != 1 {
		t.Fatalf("requeue changed %d events, want 1", n)
	}
	if n := held("r"); n != 0 {
		t.Fatalf("%d events still held after their key's failed event was requeued", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id IN ($1, $2) AND held_from IS NULL AND scheduled_at <= now()`, a, b); n != 2 {
		t.Fatalf("%d of the 2 events due again with their own due time", n)
	}

	// Deleted by hand: the same.
	head, a = keyedEvent(t, ctx, s.Pool, "d"), keyedEvent(t, ctx, s.Pool, "d")
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', last_error = 'x' WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	hold(a)
	if _, err := s.Pool.Exec(ctx, `DELETE FROM outbox_event WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if n := held("d"); n != 0 {
		t.Fatalf("%d events still held after their key's failed event was deleted", n)
	}

	// A pending event handed off (pending to done): nothing moves.
	head, a = keyedEvent(t, ctx, s.Pool, "p"), keyedEvent(t, ctx, s.Pool, "p")
	hold(a)
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'done', processed_at = now() WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if n := held("p"); n != 1 {
		t.Fatalf("%d events held after a pending event of their key was handed off, want 1 (the trigger fires only when a held key can move early)", n)
	}
}
