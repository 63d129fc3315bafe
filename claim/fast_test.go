package claim

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/jsonlimit"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

// fastTestRoutes covers every shape the one-statement claim writes and one
// it must leave to the Go handoff: a rule of three jobs (the default
// envelope, an envelope under its own kind with priority, max attempts and
// tags, payload args), a complete type that is longer than its dotted
// prefix, and a catch-all-like short prefix.
func fastTestRoutes(t *testing.T) *route.Table {
	t.Helper()
	routes, err := route.New([]route.Rule{
		{Prefix: "shop.", Jobs: []route.Job{
			{Queue: "outbox_plain"},
			{Queue: "outbox_kinded", Kind: "shop_kinded", Priority: 2, MaxAttempts: 3, Tags: []string{"a_b", "c-d-e"}},
			{Queue: "outbox_payload", Kind: "shop_payload", Args: route.ArgsPayload},
		}},
		{Prefix: "shop.order.refunded", Queues: []string{"outbox_refunds"}},
		{Prefix: "shop.order.", Jobs: []route.Job{{Queue: "outbox_orders", Kind: "order_payload", Args: route.ArgsPayload, Priority: 4}}},
		{Prefix: "audit.", Queues: []string{"outbox_audit"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return routes
}

// nestedArray returns a JSON array nested depth levels deep.
func nestedArray(depth int) string {
	return strings.Repeat("[", depth) + strings.Repeat("]", depth)
}

// fastTestEvents inserts the same events into a schema: every field the
// jobs carry in each of its forms (absent, present, with the characters
// encoding/json escapes), creation times whose fraction has trailing zeros
// or none, trace contexts with and without a tracestate, and events the
// statement must leave to the Go handoff (an ordering key, no route, a
// payload nested deeper than the payload rule allows). It returns how many
// of them the one-statement claim should hand off.
func fastTestEvents(t *testing.T, ctx context.Context, pool *pgxpool.Pool) int {
	t.Helper()
	pgtest.AllowAnyPayload(t, pool)
	// Rows from before the trace context rule (migration 010) can hold any
	// text: the two handoffs must agree on those too.
	if _, err := pool.Exec(ctx, `ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_trace_context_rule`); err != nil {
		t.Fatal(err)
	}
	type ev struct {
		typ, payload, created   string
		tenant, dk, trace, okey any
		fast                    bool
	}
	events := []ev{
		{typ: "shop.order.paid", payload: `{"n": 1, "s": "x", "big": 123456789012345678901234567890, "f": 1.50, "e": 1e3}`, created: "2026-12-02 10:00:00+00", fast: true},
		{typ: "shop.order.paid", payload: `{"html": "<a href=\"x\">&amp;</a>", "u": "é \u2028 ✓", "ctl": "a\tb\nc"}`, created: "2026-12-02 10:00:00.5+00", tenant: "acme", dk: "dk-1", trace: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", fast: true},
		{typ: "shop.cart.emptied", payload: `[]`, created: "2026-12-02 10:00:00.000001+00", trace: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 vendor=a,other=b c", fast: true},
		{typ: "shop.cart.emptied", payload: `"just a string"`, created: "2026-12-02 23:59:59.999999+05:30", trace: " leading-space", fast: true},
		{typ: "shop.order.refunded", payload: `{"refund": true}`, created: "1999-01-01 00:00:00.12+00", tenant: "t2", fast: true},
		{typ: "audit.user.login", payload: `null`, created: "2026-12-02 10:00:00.100100+00", dk: "dk-2", trace: "", fast: true},
		{typ: "audit.user.logout", payload: `{"deep": ` + nestedArray(jsonlimit.MaxDepth-1) + `}`, created: "2026-12-02 10:00:01+00", fast: true},
		// Left to the Go handoff.
		{typ: "audit.user.deep", payload: nestedArray(jsonlimit.MaxDepth + 1), created: "2026-12-02 10:00:02+00"},
		{typ: "shop.order.paid", payload: `{"keyed": 1}`, created: "2026-12-02 10:00:03+00", okey: "order-1"},
		{typ: "shop.order.shipped", payload: `{"keyed": 2}`, created: "2026-12-02 10:00:04+00", okey: "order-1"},
		{typ: "billing.invoice.paid", payload: `{}`, created: "2026-12-02 10:00:05+00"},
	}
	fast := 0
	for _, e := range events {
		if _, err := pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, created_at, tenant_id, dispatch_key, trace_context, ordering_key)
VALUES ($1, $2::jsonb, $3::timestamptz, $4, $5, $6, $7)`, e.typ, e.payload, e.created, e.tenant, e.dk, e.trace, e.okey); err != nil {
			t.Fatalf("insert %s: %v", e.typ, err)
		}
		if e.fast {
			fast++
		}
	}
	return fast
}

// handedOff reads what a handoff wrote: each event (every column but the
// times it was handed off at and the job ids) with its River jobs in
// route order (every column but the ids and the insert times).
func handedOff(t *testing.T, ctx context.Context, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(ctx, `
SELECT (to_jsonb(e) - 'processed_at' - 'river_job_ids' - 'scheduled_at')::text || ' jobs ' || coalesce((
    SELECT jsonb_agg(to_jsonb(j) - 'id' - 'created_at' - 'scheduled_at' ORDER BY u.ord)
    FROM unnest(e.river_job_ids) WITH ORDINALITY u(job_id, ord) JOIN river_job j ON j.id = u.job_id), '[]')::text
FROM outbox_event e ORDER BY e.id`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// TestFastHandoffMatchesGoHandoff hands the same events off twice, in two
// schemas: once by the Go handoff alone and once with the one-statement
// claim, and compares everything written: the events (status, errors,
// retries) and every column of River's rows, args and metadata included.
// The statement must hand off the events it can and leave the others to
// the Go handoff, in the same transaction.
func TestFastHandoffMatchesGoHandoff(t *testing.T) {
	t.Parallel()
	ctx := pgtest.Context(t, 60*time.Second)
	routes := fastTestRoutes(t)

	goSchema := pgtest.NewSchema(t, nil)
	fastSchema := pgtest.NewSchema(t, nil)
	fastTestEvents(t, ctx, goSchema.Pool)
	wantFast := fastTestEvents(t, ctx, fastSchema.Pool)

	goOnly := &Handoff{Pool: goSchema.Pool, Routes: routes, MaxRetries: 3, goOnly: true}
	withFast := &Handoff{Pool: fastSchema.Pool, Routes: routes, MaxRetries: 3}
	goRes, err := goOnly.Batch(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	fastRes, err := withFast.Batch(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if goRes.OneStatement != 0 {
		t.Fatalf("the Go handoff alone handed %d events off in the claim's statement", goRes.OneStatement)
	}
	if fastRes.OneStatement != wantFast {
		t.Fatalf("the claim's statement handed off %d events, want %d", fastRes.OneStatement, wantFast)
	}
	if goRes.Done != fastRes.Done || goRes.Jobs != fastRes.Jobs || goRes.Unroutable != fastRes.Unroutable ||
		goRes.Broken != fastRes.Broken || goRes.Blocked != fastRes.Blocked {
		t.Fatalf("results differ:\n go   %+v\n fast %+v", goRes, fastRes)
	}
	if goRes.Done != wantFast+2 || goRes.Unroutable != 1 || goRes.Broken != 1 {
		t.Fatalf("Go handoff: %+v; want %d done, 1 unroutable, 1 broken", goRes, wantFast+2)
	}
	routed := map[int64]string{}
	for _, h := range goRes.Handed {
		routed[h.ID] = h.Route
	}
	for _, h := range fastRes.Handed {
		if routed[h.ID] != h.Route {
			t.Errorf("event %d: routed by %q, the Go handoff by %q", h.ID, h.Route, routed[h.ID])
		}
	}

	want, got := handedOff(t, ctx, goSchema.Pool), handedOff(t, ctx, fastSchema.Pool)
	if len(want) != len(got) {
		t.Fatalf("%d events in the fast schema, %d in the Go schema", len(got), len(want))
	}
	for i := range want {
		if want[i] != got[i] {
			t.Errorf("event %d differs:\n go   %s\n fast %s", i+1, want[i], got[i])
		}
	}
	// Sanity: the comparison covered jobs of every shape.
	all := strings.Join(got, "\n")
	for _, s := range []string{`"kind": "shop_payload"`, `"kind": "shop_kinded"`, `"kind": "order_payload"`, `"tracestate": "vendor=a,other=b c"`, `"outbox_args": "payload"`, `"state": "pending"`} {
		if !strings.Contains(all, s) {
			t.Errorf("no job with %s among:\n%s", s, all)
		}
	}
}

// TestFastHandoffChecksItsCounts breaks the statement's join on purpose (a
// rule index the routes do not have) and checks that takeFast refuses to
// let the batch commit.
func TestFastHandoffChecksItsCounts(t *testing.T) {
	t.Parallel()
	f := newFastRoutes(fastTestRoutes(t))
	shop := 0
	for i, p := range f.prefix {
		if p == "shop." {
			shop = i + 1
		}
	}
	events := []Event{{ID: 1, fastRule: shop}, {ID: 2}}
	if _, _, err := f.takeFast(events, fastCounts{3, 1, 3, 3}); err != nil {
		t.Fatalf("counts that match: %v", err)
	}
	for _, n := range []fastCounts{{2, 1, 2, 3}, {3, 0, 3, 3}, {3, 1, 2, 3}} {
		if _, _, err := f.takeFast(events, n); err == nil {
			t.Errorf("counts %v for one event of a three-job rule were accepted", n)
		}
	}
	if _, _, err := f.takeFast([]Event{{ID: 1, fastRule: 99}}, fastCounts{}); err == nil {
		t.Error("an unknown rule was accepted")
	}
	res, rest, err := f.takeFast(events, fastCounts{3, 1, 3, 3})
	if err != nil || res.Done != 1 || res.Jobs != 3 || res.OneStatement != 1 || len(rest) != 1 || rest[0].ID != 2 {
		t.Fatalf("takeFast = %+v, %v, %v", res, rest, err)
	}
}
