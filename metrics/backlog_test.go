package metrics_test

import (
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/metrics"
)

// TestScheduledApartFromBacklog: events published with a NotBefore in the
// future count as scheduled, not as due backlog, in ReadBacklog (what
// outboxctl stats reads) and in the /metrics gauges; an event due for more
// than a minute counts as behind.
func TestScheduledApartFromBacklog(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	in := time.Now().Add(time.Hour)
	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "mail.a.b"}, outbox.Event{Type: "mail.a.b"}, outbox.Event{Type: "mail.a.b"},
		outbox.Event{Type: "mail.reminder.due", NotBefore: in},
		outbox.Event{Type: "mail.reminder.due", NotBefore: in.Add(time.Hour)},
		outbox.Event{Type: "mail.reminder.due", NotBefore: in.Add(24 * time.Hour)})
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET scheduled_at = now() - interval '2 minutes' WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}

	b, err := metrics.ReadBacklog(ctx, s.Pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if b.Due != 3 || b.DueOver != 1 || b.Scheduled != 3 || b.OldestDueAge < 2*time.Minute || b.NextDue.Sub(in).Abs() > time.Millisecond {
		t.Fatalf("backlog %+v, want 3 due (1 over a minute, oldest >= 2m), 3 scheduled, next due at %s", b, in)
	}

	got := gauges(t, s.Pool)
	if got["outbox_pending_events"] != 6 || got["outbox_pending_due_events"] != 3 || got["outbox_pending_scheduled_events"] != 3 ||
		got["outbox_pending_due_over_60s_events"] != 1 || got["outbox_next_scheduled_due_seconds"] < 3000 || got["outbox_next_scheduled_due_seconds"] > 3600 ||
		got["outbox_pending_held_events"] != 0 {
		t.Fatalf("gauges %v", got)
	}
	if _, ok := got["outbox_pending_held_events"]; !ok {
		t.Fatal("no outbox_pending_held_events gauge")
	}
}

// TestHeldCountedApart: events of an ordering key whose due time the
// dispatcher moved to wait for an earlier event of their key (migration
// 021, as claim's holdSQL does behind a dead letter) count as scheduled
// and as held, in ReadBacklog and in outbox_pending_held_events.
func TestHeldCountedApart(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	key := func() outbox.Event { return outbox.Event{Type: "mail.a.b", OrderingKey: "k"} }
	ids := pgtest.Publish(t, s.Pool, key(), key(), key(), outbox.Event{Type: "mail.reminder.due", NotBefore: time.Now().Add(time.Hour)})
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed' WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET held_from = scheduled_at, scheduled_at = now() + interval '1 minute' WHERE id = ANY($1)`, ids[1:3]); err != nil {
		t.Fatal(err)
	}
	b, err := metrics.ReadBacklog(ctx, s.Pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if b.Due != 0 || b.Scheduled != 3 || b.Held != 2 || b.Failed != 1 {
		t.Fatalf("backlog %+v, want 3 scheduled, 2 of them held, 1 failed", b)
	}
	if v, ok := gauges(t, s.Pool)["outbox_pending_held_events"]; !ok || v != 2 {
		t.Fatalf("outbox_pending_held_events = %v (reported %v), want 2", v, ok)
	}
}

// TestBacklogOnASchemaBefore021: without migration 021's held_from the
// backlog is read as before, with no held events, and the gauges stay up.
func TestBacklogOnASchemaBefore021(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.a.b"}, outbox.Event{Type: "mail.reminder.due", NotBefore: time.Now().Add(time.Hour)})
	if _, err := s.Pool.Exec(ctx, `ALTER TABLE outbox_event DROP COLUMN held_from CASCADE`); err != nil {
		t.Fatal(err)
	}
	b, err := metrics.ReadBacklog(ctx, s.Pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if b.Due != 1 || b.Scheduled != 1 || b.Held != 0 {
		t.Fatalf("backlog %+v, want 1 due, 1 scheduled, none held", b)
	}
	if got := gauges(t, s.Pool); got["outbox_database_up"] != 1 || got["outbox_pending_scheduled_events"] != 1 {
		t.Fatalf("gauges on a schema before 021: %v", got)
	}
}
