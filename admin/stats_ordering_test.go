package admin_test

import (
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestStatsShowParkedKeysAndAlert parks a real key (keyed events handed off
// by the claim, the head job discarded) and holds another in the outbox
// behind a failed event: Stats reports both in Ordering, raises
// keys_parked with the count and a pointer to outboxctl keys under the
// default thresholds, not above its threshold or when turned off, and
// drops it once the key is unparked.
func TestStatsShowParkedKeysAndAlert(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, 120*time.Second)
	cl := admin.New(s.Pool)

	st, err := cl.Stats(ctx, admin.StatsOpts{Thresholds: admin.DefaultThresholds()})
	if err != nil {
		t.Fatal(err)
	}
	if st.Ordering.Keys != 0 || st.Ordering.Parked != 0 || st.Ordering.ParkedByState["discarded"] != 0 || len(st.Ordering.ParkedByState) != 3 {
		t.Fatalf("unused ordering: %+v", st.Ordering)
	}
	if names := alertNames(st); names != "[]" {
		t.Fatalf("alerts without ordering %s", names)
	}

	ev := func(tenant, key string) outbox.Event {
		return outbox.Event{Type: "order.step.done", TenantID: tenant, OrderingKey: key}
	}
	ids := pgtest.Publish(t, s.Pool, ev("acme", "order-42"), ev("acme", "order-42"), ev("acme", "order-42"),
		ev("acme", "order-7"), ev("acme", "order-7"))
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', last_error = 'test' WHERE id = $1`, ids[3]); err != nil {
		t.Fatal(err)
	}
	if res := ordertest.HandOff(t, s.Pool, nil); res.Jobs != 3 {
		t.Fatalf("handoff %+v; want 3 jobs", res)
	}
	ordertest.FinalizeHead(t, s.Pool, "acme", "order-42", "discarded")

	st, err = cl.Stats(ctx, admin.StatsOpts{Thresholds: admin.DefaultThresholds()})
	if err != nil {
		t.Fatal(err)
	}
	o := st.Ordering
	if o.Keys != 1 || o.Parked != 1 || o.ParkedByState["discarded"] != 1 || o.Waiting != 2 || o.WaitingParked != 2 || o.HeldKeys != 1 ||
		o.OldestParkedWaitS <= 0 || o.OldestWaitS < o.OldestParkedWaitS || o.OldestParkedAgeS < 0 || o.OldestParkedAgeS > 120 {
		t.Fatalf("ordering %+v: want 1 key parked (discarded) with 2 jobs behind it, 1 held key", o)
	}
	// order-7's second event waits behind the failed one: the handoff
	// moved its due time (migration 021), so it is scheduled and held.
	if st.PendingHeld != 1 || st.PendingScheduled != 1 || st.PendingDue != 0 {
		t.Fatalf("pending: %d due, %d scheduled, %d held; want the held event scheduled and held", st.PendingDue, st.PendingScheduled, st.PendingHeld)
	}
	// The failed event alerts too (events_failed): it holds order-7.
	if names := alertNames(st); names != "[events_failed keys_parked]" {
		t.Fatalf("alerts %s", names)
	}
	a := st.Alerts[1]
	if a.Value != 1 || a.Threshold != 0 || !strings.Contains(a.Message, "1 ordering key is parked") ||
		!strings.Contains(a.Message, "2 jobs wait") || !strings.Contains(a.Message, "outboxctl keys") {
		t.Fatalf("keys_parked alert %+v", a)
	}

	for _, th := range []int64{1, -1} {
		st, err = cl.Stats(ctx, admin.StatsOpts{Thresholds: admin.Thresholds{MaxBehind: -1, MaxStalled: -1, MaxFailed: -1, MaxDiscarded: -1, MaxParked: th}})
		if err != nil {
			t.Fatal(err)
		}
		if names := alertNames(st); names != "[]" {
			t.Fatalf("MaxParked %d with 1 parked key: alerts %s", th, names)
		}
	}

	if _, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_unpark('test', false, 'order-42', 'skip', tenant_id => 'acme')`); err != nil {
		t.Fatal(err)
	}
	st, err = cl.Stats(ctx, admin.StatsOpts{Thresholds: admin.Thresholds{MaxBehind: -1, MaxStalled: -1, MaxFailed: -1, MaxDiscarded: -1}})
	if err != nil {
		t.Fatal(err)
	}
	if o := st.Ordering; o.Parked != 0 || o.Keys != 1 || o.Waiting != 1 {
		t.Fatalf("after unpark (skip): %+v, want the key running its next job, 1 waiting", o)
	}
	if names := alertNames(st); names != "[]" {
		t.Fatalf("alerts after unpark %s", names)
	}
}
