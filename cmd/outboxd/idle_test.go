package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

// TestIdleWakeReleasesIdleKeys: a key's head completed by River's own
// completion statement at REPEATABLE READ with nothing in line is left
// idle (migration 018); the next event of the key, handed off, waits
// behind it; the running idleWake releases it within its checks, and then
// finds nothing more to do.
func TestIdleWakeReleasesIdleKeys(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, 120*time.Second)
	routes, err := route.New([]route.Rule{{Prefix: "order.", Queues: []string{"outbox_order"}}})
	if err != nil {
		t.Fatal(err)
	}
	ev := outbox.Event{Type: "order.step.done", TenantID: "acme", OrderingKey: "order-42", Payload: []byte(`{}`)}
	handOffKeyed(t, s.Pool, routes, ev)
	head := int64(pgtest.Count(t, s.Pool, `SELECT head_job_id FROM outbox_ordering_key WHERE ordering_key = 'order-42'`))
	rr := pgtest.IsolationPool(t, s, "repeatable read")
	if _, err := rr.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now(), attempt = 1, attempted_at = now() WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE idle_since IS NOT NULL`); n != 1 {
		t.Fatalf("%d idle keys after the completion at repeatable read, want 1", n)
	}
	handOffKeyed(t, s.Pool, routes, ev)
	next := int64(pgtest.Count(t, s.Pool, `SELECT id FROM river_job WHERE id <> $1`, head))
	state := func() string {
		t.Helper()
		var st string
		if err := s.Pool.QueryRow(ctx, `SELECT state::text FROM river_job WHERE id = $1`, next).Scan(&st); err != nil {
			t.Fatal(err)
		}
		return st
	}
	if got := state(); got != "pending" {
		t.Fatalf("the next job is %s behind the idle key, want pending", got)
	}

	w := &idleWake{pool: s.Pool, logger: slog.New(slog.NewTextHandler(t.Output(), nil)), tick: 10 * time.Millisecond}
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Stop(context.Background()) })
	pgtest.WaitFor(t, 60*time.Second, "the idle key is woken", func() bool { return w.woken.Load() == 1 })
	if got := state(); got != "available" {
		t.Fatalf("the next job is %s after the wake, want available", got)
	}
	if got := int64(pgtest.Count(t, s.Pool, `SELECT head_job_id FROM outbox_ordering_key WHERE ordering_key = 'order-42' AND idle_since IS NULL`)); got != next {
		t.Fatalf("the key's head is job %d, want %d", got, next)
	}
	start := w.checks.Load()
	pgtest.WaitFor(t, 60*time.Second, "more checks", func() bool { return w.checks.Load() >= start+3 })
	if n := w.woken.Load(); n != 1 {
		t.Fatalf("%d keys woken, want 1", n)
	}
}
