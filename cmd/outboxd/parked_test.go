package main

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

// handOffKeyed publishes events and hands them all off with the real
// claim, so the ordering triggers make heads and waiting jobs; it returns
// the events' ids.
func handOffKeyed(t *testing.T, pool *pgxpool.Pool, routes *route.Table, events ...outbox.Event) []int64 {
	t.Helper()
	ids := pgtest.Publish(t, pool, events...)
	if res := ordertest.HandOff(t, pool, routes); res.Jobs != len(events) {
		t.Fatalf("handoff %+v; want %d jobs", res, len(events))
	}
	return ids
}

// TestParkedWatchAlertsOncePerParking parks real keys (keyed events handed
// off by the claim, the head job discarded or cancelled) under a running
// parkedWatch with a recording alerter: each newly parked key raises one
// ParkedKey alert with its tenant, key, queue, head job and event and its
// state, and nothing of the payload; a key still parked at later checks
// raises nothing more; a key unparked (River's retry of the head) and
// parked again raises a new alert.
func TestParkedWatchAlertsOncePerParking(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, 120*time.Second)

	ev := func(tenant, key string) outbox.Event {
		return outbox.Event{Type: "order.step.done", TenantID: tenant, OrderingKey: key, Payload: []byte(`{"card":"SECRET-4242"}`)}
	}
	routes, err := route.New([]route.Rule{{Prefix: "order.", Queues: []string{"outbox_order"}}})
	if err != nil {
		t.Fatal(err)
	}
	ids := handOffKeyed(t, s.Pool, routes, ev("acme", "order-42"), ev("acme", "order-42"), ev("acme", "order-42"),
		ev("", "order-7"), ev("", "order-7"))
	headOf := func(key string) int64 {
		return int64(pgtest.Count(t, s.Pool, `SELECT head_job_id FROM outbox_ordering_key WHERE ordering_key = $1`, key))
	}
	setState := func(key, state string) int64 {
		t.Helper()
		job := headOf(key)
		if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = $2::river_job_state, finalized_at = CASE WHEN $2 = 'available' THEN NULL ELSE now() END WHERE id = $1`, job, state); err != nil {
			t.Fatal(err)
		}
		return job
	}

	var (
		mu  sync.Mutex
		got []alert.Alert
	)
	alerts := func() []alert.Alert { mu.Lock(); defer mu.Unlock(); return append([]alert.Alert(nil), got...) }
	w := &parkedWatch{pool: s.Pool, logger: slog.New(slog.NewTextHandler(t.Output(), nil)), tick: 10 * time.Millisecond,
		al: alert.Func(func(_ context.Context, a alert.Alert) { mu.Lock(); defer mu.Unlock(); got = append(got, a) })}
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Stop(context.Background()) })
	waitChecks := func(n int64) {
		t.Helper()
		start := w.checks.Load()
		pgtest.WaitFor(t, 60*time.Second, "the parked-key checks", func() bool { return w.checks.Load() >= start+n })
	}

	waitChecks(3)
	if a := alerts(); len(a) != 0 {
		t.Fatalf("alerts with no parked key: %+v", a)
	}

	job42 := setState("order-42", "discarded")
	pgtest.WaitFor(t, 60*time.Second, "the alert for order-42", func() bool { return len(alerts()) >= 1 })
	waitChecks(5)
	if n := len(alerts()); n != 1 {
		t.Fatalf("%d alerts for one parked key over several checks, want 1", n)
	}
	a := alerts()[0]
	if a.Reason != alert.ParkedKey || a.TenantID != "acme" || a.OrderingKey != "order-42" || a.Queue != "outbox_order" ||
		a.JobID != job42 || a.EventID != ids[0] || a.EventType != "order.step.done" {
		t.Fatalf("alert %+v, want ParkedKey for acme/order-42 in outbox_order, head job %d, event %d", a, job42, ids[0])
	}
	for _, want := range []string{`"order-42"`, `tenant "acme"`, "outbox_order", "is discarded", "2 later jobs wait", "outboxctl keys"} {
		if !strings.Contains(a.Message, want) {
			t.Errorf("message %q lacks %q", a.Message, want)
		}
	}
	if strings.Contains(a.Message+a.Err, "SECRET") {
		t.Fatalf("the alert carries the payload: %+v", a)
	}

	job7 := setState("order-7", "cancelled")
	pgtest.WaitFor(t, 60*time.Second, "the alert for order-7", func() bool { return len(alerts()) >= 2 })
	waitChecks(5)
	if a := alerts(); len(a) != 2 || a[1].OrderingKey != "order-7" || a[1].TenantID != "" || a[1].JobID != job7 ||
		!strings.Contains(a[1].Message, "(no tenant)") || !strings.Contains(a[1].Message, "is cancelled") {
		t.Fatalf("alerts %+v: want one more, for order-7 (no tenant, cancelled), and none again for order-42", a)
	}

	// River's retry of the head unparks the key; failing again parks it anew.
	setState("order-42", "available")
	pgtest.WaitFor(t, 60*time.Second, "order-42 unparked", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE ordering_key = 'order-42' AND parked_at IS NULL`) == 1
	})
	waitChecks(3)
	setState("order-42", "discarded")
	pgtest.WaitFor(t, 60*time.Second, "the alert for order-42 parked again", func() bool { return len(alerts()) >= 3 })
	waitChecks(5)
	if a := alerts(); len(a) != 3 || a[2].OrderingKey != "order-42" || a[2].JobID != job42 {
		t.Fatalf("alerts %+v: want a third, for order-42 parked again", a)
	}
}
