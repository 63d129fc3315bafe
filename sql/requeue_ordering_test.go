package outboxsql_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// keyedEvent inserts a pending event of ordering key k (the publish trigger
// gives it its position under the key's lock) and returns its id.
func keyedEvent(t *testing.T, ctx context.Context, q *pgxpool.Pool, k string) int64 {
	t.Helper()
	var id int64
	if err := q.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, ordering_key) VALUES ('mail.order.sent', '{}', $1) RETURNING id`, k).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// requeue runs outbox_requeue for one event and returns how many it
// changed and what it skipped.
func requeue(t *testing.T, ctx context.Context, s *pgtest.Schema, status string, id int64) (int, map[string]int) {
	t.Helper()
	var (
		n       int
		skipped []byte
	)
	err := s.Pool.QueryRow(ctx, `SELECT affected, skipped FROM outbox_requeue('test', false, statuses => ARRAY[$1], ids => ARRAY[$2::bigint], allow_replay => true)`,
		status, id).Scan(&n, &skipped)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]int{}
	if err := json.Unmarshal(skipped, &m); err != nil {
		t.Fatal(err)
	}
	return n, m
}

func position(t *testing.T, s *pgtest.Schema, id int64) int64 {
	t.Helper()
	return int64(pgtest.Count(t, s.Pool, `SELECT ordering_position FROM outbox_event WHERE id = $1`, id))
}

// TestRequeueOfADoneKeyedEventTakesANewPosition (migration 020): a done or
// cancelled event of an ordering key that is requeued is ordered by when it
// was requeued, behind the key's events published after it (before 020 it
// kept its old position, and its job went ahead of theirs in the key's
// line); a failed event keeps its position, ahead of the events it holds.
func TestRequeueOfADoneKeyedEventTakesANewPosition(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	done, cancelled, failed := keyedEvent(t, ctx, s.Pool, "k"), keyedEvent(t, ctx, s.Pool, "k"), keyedEvent(t, ctx, s.Pool, "k")
	later := keyedEvent(t, ctx, s.Pool, "k")
	for id, st := range map[int64]string{done: "done", cancelled: "cancelled", failed: "failed"} {
		if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = $2::outbox_status, processed_at = CASE WHEN $2 = 'done' THEN now() END WHERE id = $1`, id, st); err != nil {
			t.Fatal(err)
		}
	}
	failedAt := position(t, s, failed)
	for id, st := range map[int64]string{done: "done", cancelled: "cancelled", failed: "failed"} {
		if n, skipped := requeue(t, ctx, s, st, id); n != 1 {
			t.Fatalf("requeue of the %s event changed %d (skipped %v), want 1", st, n, skipped)
		}
	}
	for _, id := range []int64{done, cancelled} {
		if p, l := position(t, s, id), position(t, s, later); p <= l {
			t.Fatalf("requeued event %d is at position %d, not behind the later event's %d", id, p, l)
		}
	}
	if p := position(t, s, failed); p != failedAt {
		t.Fatalf("the requeued failed event moved from position %d to %d", failedAt, p)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'pending'`); n != 4 {
		t.Fatalf("%d pending events, want 4", n)
	}
}

// TestRequeueSkipsAKeyAProducerHolds (migration 020): the requeue of a done
// keyed event whose key a producer's open transaction holds does not wait
// for it: the event is skipped, reported as locked, and changed by a later
// requeue once the producer is gone. A dry run takes no lock.
func TestRequeueSkipsAKeyAProducerHolds(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	done := keyedEvent(t, ctx, s.Pool, "k")
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'done', processed_at = now() WHERE id = $1`, done); err != nil {
		t.Fatal(err)
	}
	producer, _ := pgtest.OpenTx(t, ctx, s.Pool)
	if _, err := producer.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, ordering_key) VALUES ('mail.order.sent', '{}', 'k')`); err != nil {
		t.Fatal(err)
	}
	var dry int
	if err := s.Pool.QueryRow(ctx, `SELECT affected FROM outbox_requeue('test', true, statuses => ARRAY['done'], ids => ARRAY[$1::bigint], allow_replay => true)`, done).Scan(&dry); err != nil {
		t.Fatal(err)
	}
	if dry != 1 {
		t.Fatalf("the dry run would change %d, want 1", dry)
	}
	n, skipped := requeue(t, ctx, s, "done", done)
	if n != 0 || skipped["locked"] != 1 {
		t.Fatalf("requeue while a producer holds the key changed %d, skipped %v; want 0 and locked 1", n, skipped)
	}
	if err := producer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n, skipped := requeue(t, ctx, s, "done", done); n != 1 {
		t.Fatalf("requeue after the producer committed changed %d (skipped %v), want 1", n, skipped)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event e WHERE e.id = $1 AND e.ordering_position > (SELECT max(ordering_position) FROM outbox_event WHERE id <> $1)`, done); n != 1 {
		t.Fatal("the requeued event is not behind the producer's event")
	}
}
