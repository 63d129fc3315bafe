// Package ordertest puts per-key ordering into known states for tests of
// the packages that report and repair it (admin, metrics, outboxctl,
// outboxd, the console): it hands events off with the real claim, so that
// migration 011's triggers make heads and waiting jobs, and finalizes heads
// as River does, so that they park their keys. It lives apart from pgtest
// because claim's own tests use pgtest.
package ordertest

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

// Type is the event type of the events Events publishes; Routes sends it
// to Queue.
const (
	Type  = "order.item.changed"
	Queue = "outbox_order"
)

// Routes routes "order." to Queue.
func Routes(tb testing.TB) *route.Table {
	tb.Helper()
	routes, err := route.New([]route.Rule{{Prefix: "order.", Queues: []string{Queue}}})
	if err != nil {
		tb.Fatal(err)
	}
	return routes
}

// Events returns n events of Type with one tenant ("" for none) and
// ordering key.
func Events(tenant, key string, n int) []outbox.Event {
	evs := make([]outbox.Event, n)
	for i := range evs {
		evs[i] = outbox.Event{Type: Type, Payload: json.RawMessage(`{}`), TenantID: tenant, OrderingKey: key}
	}
	return evs
}

// HandOff hands up to 100 due events off to River with the real claim on
// routes (nil: Routes), as the dispatcher does, and returns the batch's
// result. Alerts are dropped.
func HandOff(tb testing.TB, pool *pgxpool.Pool, routes *route.Table) claim.Result {
	tb.Helper()
	if routes == nil {
		routes = Routes(tb)
	}
	h := &claim.Handoff{Pool: pool, Routes: routes, MaxRetries: 6, Alerter: alert.Func(func(context.Context, alert.Alert) {})}
	res, err := h.Batch(pgtest.Context(tb, 60*time.Second), 100)
	if err != nil {
		tb.Fatal(err)
	}
	return res
}

// FinalizeHead sets the head job of (tenant, key) in every queue to state
// (discarded or cancelled), as River does when it runs out of attempts or
// is cancelled: the settled trigger parks the key. It fails the test unless
// exactly one head changed.
func FinalizeHead(tb testing.TB, pool *pgxpool.Pool, tenant, key, state string) {
	tb.Helper()
	tag, err := pool.Exec(context.Background(), `
		UPDATE river_job SET state = $3::river_job_state, finalized_at = now()
		WHERE id IN (SELECT head_job_id FROM outbox_ordering_key WHERE tenant_id = $1 AND ordering_key = $2)`, tenant, key, state)
	if err != nil || tag.RowsAffected() != 1 {
		tb.Fatalf("finalize the head of %q/%q as %s: %v (%d rows)", tenant, key, state, err, tag.RowsAffected())
	}
}

// ParkKey publishes n events of one key, hands them off and discards the
// head job after one attempt that failed with lastError: the key is parked
// with n-1 jobs waiting. It returns the event ids and their jobs' ids.
func ParkKey(tb testing.TB, pool *pgxpool.Pool, tenant, key string, n int, lastError string) (events, jobs []int64) {
	tb.Helper()
	ctx := context.Background()
	events = pgtest.Publish(tb, pool, Events(tenant, key, n)...)
	HandOff(tb, pool, nil)
	for _, id := range events {
		var job int64
		if err := pool.QueryRow(ctx, `SELECT river_job_ids[1] FROM outbox_event WHERE id = $1 AND status = 'done'`, id).Scan(&job); err != nil {
			tb.Fatalf("job of event %d: %v", id, err)
		}
		jobs = append(jobs, job)
	}
	if _, err := pool.Exec(ctx, `
		UPDATE river_job SET state = 'discarded', finalized_at = now(), attempt = 1, max_attempts = 1, attempted_at = now(),
		       errors = ARRAY[jsonb_build_object('attempt', 1, 'at', now(), 'error', $2::text)]
		WHERE id = $1`, jobs[0], lastError); err != nil {
		tb.Fatal(err)
	}
	return events, jobs
}
