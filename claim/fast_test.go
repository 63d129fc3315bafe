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
		// Two jobs: a keyed event of this rule is left to the Go handoff,
		// with every keyed event of its batch.
		{Prefix: "ledger.", Queues: []string{"outbox_ledger_a", "outbox_ledger_b"}},
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
// or none, trace contexts with and without a tracestate, keyed events of
// several keys and tenants, and events the statement must leave to the Go
// handoff (no route, a payload nested deeper than the payload rule
// allows). It returns how many
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
		// Keyed events of one-job rules: inserted after the others, key by
		// key in byte order of (tenant, key, queue), each key's in
		// position order, as the Go handoff does ("Z" sorts before "a").
		{typ: "shop.order.paid", payload: `{"keyed": 1}`, created: "2026-12-02 10:00:03+00", okey: "order-1", fast: true},
		{typ: "audit.user.login", payload: `{"keyed": 3}`, created: "2026-12-02 10:00:03.5+00", okey: "a-key", tenant: "t2", fast: true},
		{typ: "shop.order.shipped", payload: `{"keyed": 2}`, created: "2026-12-02 10:00:04+00", okey: "order-1", fast: true},
		{typ: "audit.user.login", payload: `{"keyed": 4}`, created: "2026-12-02 10:00:04.5+00", okey: "Z-key", tenant: "t2", dk: "dk-3", fast: true},
		{typ: "audit.user.logout", payload: `{"keyed": 5}`, created: "2026-12-02 10:00:04.6+00", okey: "a-key", fast: true},
		{typ: "shop.order.paid", payload: `{"keyed": 6}`, created: "2026-12-02 10:00:04.7+00", okey: "a-key", tenant: "t2", fast: true},
		// Left to the Go handoff.
		{typ: "audit.user.deep", payload: nestedArray(jsonlimit.MaxDepth + 1), created: "2026-12-02 10:00:02+00"},
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
// route order (every column but the ids and the insert times, and each
// keyed job's place in the insert order of the keyed jobs, which is the
// order in which their key rows are locked and decides each key's head).
// A job that waits in its key's line (migration 024) is not in river_job:
// it is read through pgtest.Jobs, state pending and in_line true, with the
// columns its line row keeps for River (args, kind, max_attempts,
// metadata, priority, queue, tags). A job in River reads in_line false.
func handedOff(t *testing.T, ctx context.Context, pool *pgxpool.Pool) []string {
	t.Helper()
	return queryStrings(t, ctx, pool, `
SELECT (to_jsonb(e) - 'processed_at' - 'river_job_ids' - 'scheduled_at')::text || ' jobs ' || coalesce((
    SELECT jsonb_agg(coalesce(to_jsonb(j) - 'id' - 'created_at' - 'scheduled_at',
                              jsonb_build_object('args', w.args, 'kind', w.kind, 'max_attempts', w.max_attempts, 'metadata', w.metadata,
                                                 'priority', w.priority, 'queue', w.queue, 'tags', w.tags))
                     || jsonb_build_object('state', a.state, 'in_line', a.in_line,
                            'keyed_insert_rank', CASE WHEN a.metadata ? 'outbox_ordering_key' THEN
                            (SELECT count(*) FROM `+pgtest.Jobs+` WHERE river_job.id < a.id AND river_job.metadata ? 'outbox_ordering_key') END) ORDER BY u.ord)
    FROM unnest(e.river_job_ids) WITH ORDINALITY u(job_id, ord)
    JOIN (SELECT * FROM `+pgtest.Jobs+`) a ON a.id = u.job_id
    LEFT JOIN river_job j ON j.id = a.id AND NOT a.in_line
    LEFT JOIN outbox_ordering_wait w ON w.job_id = a.id AND a.in_line), '[]')::text
FROM outbox_event e ORDER BY e.id`)
}

// queryStrings returns the text column of every row sql returns.
func queryStrings(t *testing.T, ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, sql string, args ...any) []string {
	t.Helper()
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// fastFixture is a schema with a Handoff of fastTestRoutes, for the tests
// of which form of the claim a batch takes.
type fastFixture struct {
	t   *testing.T
	ctx context.Context
	s   *pgtest.Schema
	h   *Handoff
}

func newFastFixture(t *testing.T) *fastFixture {
	s := pgtest.NewSchema(t, nil)
	return &fastFixture{t: t, ctx: pgtest.Context(t, 60*time.Second), s: s,
		h: &Handoff{Pool: s.Pool, Routes: fastTestRoutes(t), MaxRetries: 3}}
}

// publish inserts an audit event, with ordering key okey (nil for none).
func (f *fastFixture) publish(okey any) {
	f.t.Helper()
	f.publishType("audit.user.login", okey)
}

// publishType inserts an event of type typ, with ordering key okey (nil
// for none).
func (f *fastFixture) publishType(typ string, okey any) {
	f.t.Helper()
	if _, err := f.s.Pool.Exec(f.ctx, `INSERT INTO outbox_event (event_type, payload, ordering_key) VALUES ($1, '{}', $2)`, typ, okey); err != nil {
		f.t.Fatal(err)
	}
}

// batch runs one Batch and fails the test on its error.
func (f *fastFixture) batch(what string) Result {
	f.t.Helper()
	res, err := f.h.Batch(f.ctx, 100)
	if err != nil {
		f.t.Fatalf("%s: %v", what, err)
	}
	return res
}

// TestFastHandoffMatchesGoHandoff hands the same events off twice, in two
// schemas: once by the Go handoff alone and once with the one-statement
// claim, and compares everything written: the events (status, errors,
// retries) and every column of River's rows, args and metadata included.
// The statement must hand off the events it can and leave the others to
// the Go handoff, in the same transaction.
func TestFastHandoffMatchesGoHandoff(t *testing.T) {
	t.Parallel()
	for _, oneTrip := range []bool{false, true} {
		t.Run(map[bool]string{false: "in the batch transaction", true: "in one round trip"}[oneTrip], func(t *testing.T) {
			t.Parallel()
			testFastHandoffMatchesGoHandoff(t, oneTrip)
		})
	}
}

func testFastHandoffMatchesGoHandoff(t *testing.T, oneTrip bool) {
	ctx := pgtest.Context(t, 60*time.Second)
	routes := fastTestRoutes(t)

	goSchema := pgtest.NewSchema(t, nil)
	fastSchema := pgtest.NewSchema(t, nil)
	fastTestEvents(t, ctx, goSchema.Pool)
	wantFast := fastTestEvents(t, ctx, fastSchema.Pool)

	goOnly := &Handoff{Pool: goSchema.Pool, Routes: routes, MaxRetries: 3, goOnly: true}
	withFast := &Handoff{Pool: fastSchema.Pool, Routes: routes, MaxRetries: 3}
	// One round trip is what a handoff uses after a batch the statement
	// handed off whole; the events it leaves go to a batch transaction
	// in the same call.
	withFast.oneTrip.Store(oneTrip)
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
		goRes.Broken != fastRes.Broken || goRes.Blocked != fastRes.Blocked || goRes.Claimed != fastRes.Claimed || goRes.Last.ID != fastRes.Last.ID {
		t.Fatalf("results differ:\n go   %+v\n fast %+v", goRes, fastRes)
	}
	if goRes.Done != wantFast || goRes.Unroutable != 1 || goRes.Broken != 1 {
		t.Fatalf("Go handoff: %+v; want %d done, 1 unroutable, 1 broken", goRes, wantFast)
	}
	if goRes.TopKeyDone != 2 || fastRes.TopKey != goRes.TopKey || fastRes.TopKeyDone != goRes.TopKeyDone {
		t.Errorf("top key: Go handoff %+v × %d, statement %+v × %d; want two events of one key", goRes.TopKey, goRes.TopKeyDone, fastRes.TopKey, fastRes.TopKeyDone)
	}
	// The events the statement left turn the next batch back to the
	// batch transaction.
	if withFast.oneTrip.Load() {
		t.Error("a batch with events the statement left keeps one round trip for the next")
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
	for _, s := range []string{`"kind": "shop_payload"`, `"kind": "shop_kinded"`, `"kind": "order_payload"`, `"tracestate": "vendor=a,other=b c"`, `"outbox_args": "payload"`,
		`"state": "pending"`, `"in_line": true`, `"ordering_key": "Z-key"`, `"outbox_ordering_position"`} {
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

// TestOneRoundTripAfterWholeBatches follows the handoff's choice of round
// trips: a batch of common events in the batch transaction, then the next
// in one round trip, which the statement commits on its own; a batch with
// an event the statement leaves (an ordering key whose rule has two jobs)
// hands that one off in a batch transaction in the same call and sends the
// next batch there too. Keyed events of a one-job rule go either way.
func TestOneRoundTripAfterWholeBatches(t *testing.T) {
	t.Parallel()
	f := newFastFixture(t)
	s, ctx, h, publish := f.s, f.ctx, f.h, f.publish
	step := func(what string, wantDone, wantOne int, wantOneTripAfter bool) {
		t.Helper()
		res := f.batch(what)
		if res.Done != wantDone || res.OneStatement != wantOne || h.oneTrip.Load() != wantOneTripAfter {
			t.Fatalf("%s: %d done, %d by the statement, one round trip next %v; want %d, %d, %v",
				what, res.Done, res.OneStatement, h.oneTrip.Load(), wantDone, wantOne, wantOneTripAfter)
		}
	}
	publish(nil)
	publish(nil)
	step("first batch, in the batch transaction", 2, 2, true)
	publish(nil)
	step("a whole batch in one round trip", 1, 1, true)
	publish(nil)
	f.publishType("ledger.entry.made", "k1")
	step("a keyed event of two jobs left by the round trip", 2, 1, false)
	publish(nil)
	step("back in the batch transaction", 1, 1, true)
	publish("k2")
	step("a keyed event of one job in one round trip", 1, 1, true)
	publish("k2")
	step("the next event of its key, queued behind the first", 1, 1, true)
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'done' AND cardinality(river_job_ids) >= 1`); n != 8 {
		t.Fatalf("%d events done with their jobs, want 8", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM `+pgtest.Jobs); n != 9 {
		t.Fatalf("%d River jobs (in River or in line), want 9 (one of the events has two)", n)
	}
	// The second k2 job waits behind the first, as the Go handoff's would:
	// in its key's line, not in river_job (migration 024).
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM `+pgtest.Jobs+` WHERE state = 'pending' AND in_line AND metadata->>'outbox_ordering_key' = 'k2'`); n != 1 {
		t.Fatalf("%d k2 jobs pending in line, want 1", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE metadata->>'outbox_ordering_key' = 'k2'`); n != 1 {
		t.Fatalf("%d k2 jobs in river_job, want 1 (the head; the other waits in line)", n)
	}

	// Without migration 016's check function the round trip is turned
	// off for good and batches go on in the batch transaction.
	if _, err := s.Pool.Exec(ctx, `DROP FUNCTION outbox_handoff_check(bigint, bigint, bigint, bigint, bigint)`); err != nil {
		t.Fatal(err)
	}
	publish(nil)
	h.oneTrip.Store(true)
	res, err := h.Batch(ctx, 100)
	if err != nil || res.Done != 1 || res.OneStatement != 1 || !h.noOneTrip.Load() {
		t.Fatalf("without the check function: %+v, %v, one round trip off %v", res, err, h.noOneTrip.Load())
	}
}

// TestOneRoundTripIsOneTransaction checks what the one-round-trip batch
// rests on: statements sent in one pgx batch without BEGIN run in one
// implicit transaction, so the setup's transaction-local settings apply to
// the claim and end with it, and a failing statement rolls back the ones
// before it.
func TestOneRoundTripIsOneTransaction(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	conn, err := s.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	b := &pgx.Batch{}
	b.Queue(asyncPlanSettingsSQL)
	b.Queue(`SELECT current_setting('enable_seqscan') || ' ' || current_setting('synchronous_commit')`)
	br := conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		t.Fatal(err)
	}
	var inBatch string
	if err := br.QueryRow().Scan(&inBatch); err != nil {
		t.Fatal(err)
	}
	if err := br.Close(); err != nil {
		t.Fatal(err)
	}
	var after string
	if err := conn.QueryRow(ctx, `SELECT current_setting('enable_seqscan') || ' ' || current_setting('synchronous_commit')`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if inBatch != "off off" || after != "on on" {
		t.Fatalf("settings in the batch %q, after it %q; want \"off off\", then \"on on\"", inBatch, after)
	}

	if _, err := conn.Exec(ctx, `CREATE TABLE one_trip (n int)`); err != nil {
		t.Fatal(err)
	}
	b = &pgx.Batch{}
	b.Queue(`INSERT INTO one_trip VALUES (1)`)
	b.Queue(`SELECT 1 / 0`)
	if err := conn.SendBatch(ctx, b).Close(); err == nil {
		t.Fatal("the failing batch did not fail")
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM one_trip`); n != 0 {
		t.Fatalf("%d rows of a failed batch were committed", n)
	}
}

// TestFastHandoffNeverCommitsMissingJobs makes River's table skip the jobs
// of one event type (a BEFORE INSERT trigger returning NULL) and checks
// both one-statement forms: neither commits an event without its jobs. The
// statement fails its check, is turned off for a while, and the Go
// handoff fails the event at fault alone while the others are handed off.
func TestFastHandoffNeverCommitsMissingJobs(t *testing.T) {
	t.Parallel()
	for _, oneTrip := range []bool{false, true} {
		t.Run(map[bool]string{false: "in the batch transaction", true: "in one round trip"}[oneTrip], func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			ctx := pgtest.Context(t, 60*time.Second)
			if _, err := s.Pool.Exec(ctx, `
CREATE FUNCTION skip_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.metadata->>'outbox_event_type' = 'audit.user.skipped' THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER skip_jobs BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION skip_jobs();
INSERT INTO outbox_event (event_type, payload) VALUES ('audit.user.login', '{}'), ('audit.user.skipped', '{}'), ('audit.user.logout', '{}');`); err != nil {
				t.Fatal(err)
			}
			h := &Handoff{Pool: s.Pool, Routes: fastTestRoutes(t), MaxRetries: 3}
			h.oneTrip.Store(oneTrip)
			res, err := h.Batch(ctx, 100)
			if err != nil {
				t.Fatal(err)
			}
			if res.Done != 2 || res.OneStatement != 0 || res.Retried != 1 {
				t.Fatalf("result %+v; want 2 done by the Go handoff and 1 retried", res)
			}
			if h.fastRoutesOf(batchClaim) != nil {
				t.Error("the statement is still on after its check failed")
			}
			if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event e WHERE status = 'done' AND (SELECT count(*) FROM river_job j WHERE j.id = ANY(e.river_job_ids)) <> 1`); n != 0 {
				t.Fatalf("%d events done without their job", n)
			}
			var status, lastErr string
			if err := s.Pool.QueryRow(ctx, `SELECT status::text, coalesce(last_error, '') FROM outbox_event WHERE event_type = 'audit.user.skipped'`).Scan(&status, &lastErr); err != nil {
				t.Fatal(err)
			}
			if status != "pending" || !strings.Contains(lastErr, "jobs inserted") {
				t.Fatalf("the event at fault: %s, %q; want pending with the counts in last_error", status, lastErr)
			}
		})
	}
}

// TestPlainClaimAfterBatchesOfKeyedEvents checks that a batch in which the
// claim statement hands nothing off (every event keyed) sends the next
// plainBatches batches to the plain claim, which skips the statement's
// routing, and that the statement comes back after them.
func TestPlainClaimAfterBatchesOfKeyedEvents(t *testing.T) {
	t.Parallel()
	f := newFastFixture(t)
	h, publish := f.h, f.publish
	batch := func() Result { t.Helper(); return f.batch("batch") }
	f.publishType("ledger.entry.made", "k1")
	if res := batch(); res.Done != 1 || res.OneStatement != 0 || h.plainLeft.Load() != plainBatches {
		t.Fatalf("keyed batch: %+v, plain batches left %d; want 1 done by the Go handoff, %d left", res, h.plainLeft.Load(), plainBatches)
	}
	publish(nil)
	if res := batch(); res.Done != 1 || res.OneStatement != 0 {
		t.Fatalf("the batch after it: %+v; want 1 done by the plain claim", res)
	}
	for h.plainLeft.Load() > 0 {
		batch()
	}
	publish(nil)
	if res := batch(); res.Done != 1 || res.OneStatement != 1 {
		t.Fatalf("after the plain batches: %+v; want 1 done by the statement", res)
	}
}

// TestFastHandoffLeavesKeyedEventsTogether checks that the one-statement
// claim hands off the keyed events of a batch only all together: when one
// of them must go to the Go handoff (its rule has two jobs, or an earlier
// event of its key holds it back), every keyed event of the batch does, so
// that the batch's key rows are still locked in one order (insertOrder)
// and no event overtakes an earlier one of its key.
func TestFastHandoffLeavesKeyedEventsTogether(t *testing.T) {
	t.Parallel()
	t.Run("a rule of two jobs", func(t *testing.T) {
		t.Parallel()
		f := newFastFixture(t)
		f.publish(nil)
		f.publish("k1")
		f.publishType("ledger.entry.made", "k2")
		res := f.batch("batch")
		if res.Done != 3 || res.OneStatement != 1 || res.Jobs != 4 {
			t.Fatalf("batch: %+v; want 3 done, the unkeyed one by the statement, 4 jobs", res)
		}
	})
	t.Run("an event held back by its key", func(t *testing.T) {
		t.Parallel()
		f := newFastFixture(t)
		// k3's first event is due in an hour: its second waits for it.
		if _, err := f.s.Pool.Exec(f.ctx, `INSERT INTO outbox_event (event_type, payload, ordering_key, scheduled_at)
VALUES ('audit.user.login', '{}', 'k3', now() + interval '1 hour')`); err != nil {
			t.Fatal(err)
		}
		f.publish(nil)
		f.publish("k3")
		f.publish("k4")
		res := f.batch("batch")
		if res.Done != 2 || res.OneStatement != 1 || res.Blocked != 1 {
			t.Fatalf("batch: %+v; want 2 done (the unkeyed one by the statement, k4 by the Go handoff), 1 blocked", res)
		}
		if n := pgtest.Count(t, f.s.Pool, `SELECT count(*) FROM outbox_event WHERE ordering_key = 'k3' AND status = 'pending'`); n != 2 {
			t.Fatalf("%d k3 events pending, want 2", n)
		}
		// Once the first is due, both go, in order, by the statement.
		if _, err := f.s.Pool.Exec(f.ctx, `UPDATE outbox_event SET scheduled_at = now() - interval '1 second' WHERE ordering_key = 'k3' AND status = 'pending'`); err != nil {
			t.Fatal(err)
		}
		res = f.batch("batch after")
		if res.Done != 2 || res.OneStatement != 2 {
			t.Fatalf("batch after: %+v; want both k3 events done by the statement", res)
		}
		// The second waits in the key's line, not in river_job (migration
		// 024).
		got := queryStrings(t, f.ctx, f.s.Pool, `SELECT state || CASE WHEN in_line THEN ' in line' ELSE '' END FROM `+pgtest.Jobs+`
WHERE metadata->>'outbox_ordering_key' = 'k3' ORDER BY (metadata->>'outbox_ordering_position')::bigint`)
		if len(got) != 2 || got[0] != "available" || got[1] != "pending in line" {
			t.Fatalf("k3 jobs in position order: %v; want the first available, the second pending in line behind it", got)
		}
	})
}

// TestBatchAfterSkipsWalkedKeys: BatchAfter with keys to skip (the keys a
// drain walks) neither claims nor locks their events, in each of its
// three forms (the Go handoff alone, the one-statement claim in the batch
// transaction, the one-statement claim in one round trip); it still
// claims the events of the same key in another tenant, of other keys and
// without a key, and the skipped events stay pending for a claim by key.
func TestBatchAfterSkipsWalkedKeys(t *testing.T) {
	t.Parallel()
	for _, form := range []string{"go", "fast", "one trip"} {
		t.Run(form, func(t *testing.T) {
			t.Parallel()
			ctx := pgtest.Context(t, 60*time.Second)
			s := pgtest.NewSchema(t, nil)
			routes, err := route.New([]route.Rule{{Prefix: "shop.", Queues: []string{"outbox_shop"}}})
			if err != nil {
				t.Fatal(err)
			}
			h := &Handoff{Pool: s.Pool, Routes: routes, MaxRetries: 3, goOnly: form == "go"}
			h.oneTrip.Store(form == "one trip")
			var ids []int64
			for _, e := range []struct{ tenant, key string }{
				{"", ""}, {"a", "k"}, {"a", "k"}, {"b", "k"}, {"", "k"}, {"a", "j"}, {"a", "k"}, {"", ""}, {"b", "j"},
			} {
				var id int64
				if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('shop.order.changed', '{}'::jsonb, NULLIF($1, ''), ordering_key => NULLIF($2, ''))`,
					e.tenant, e.key).Scan(&id); err != nil {
					t.Fatal(err)
				}
				ids = append(ids, id)
			}
			// Claim the first event, then the rest after it, passing keys
			// a/k and b/j by (but not a/j or b/k: the pairs, not each
			// tenant with each key).
			first, err := h.Batch(ctx, 1)
			if err != nil || first.Claimed != 1 {
				t.Fatalf("first batch: %+v %v", first, err)
			}
			// A batch handed off whole by the statement turns one round
			// trip on: set the form under test again.
			h.oneTrip.Store(form == "one trip")
			walked := Key{TenantID: "a", OrderingKey: "k"}
			// A transaction that locks any of the skipped events while the
			// batch runs would make SKIP LOCKED pass them for that reason
			// instead: none does, so a claim of them would show.
			res, err := h.BatchAfter(ctx, 100, first.Last, walked, Key{TenantID: "b", OrderingKey: "j"})
			if err != nil {
				t.Fatal(err)
			}
			if res.Claimed != 4 || res.Done != 4 || res.Blocked != 0 {
				t.Fatalf("BatchAfter past keys a/k and b/j: %+v, want the 4 events of other keys and tenants and without a key handed off", res)
			}
			if form != "go" && res.OneStatement != 4 {
				t.Fatalf("BatchAfter past keys a/k and b/j: %d events handed off by the claim's statement, want 4 (%+v)", res.OneStatement, res)
			}
			for _, i := range []int{1, 2, 6, 8} {
				var status string
				if err := s.Pool.QueryRow(ctx, `SELECT status FROM outbox_event WHERE id = $1`, ids[i]).Scan(&status); err != nil {
					t.Fatal(err)
				}
				if status != "pending" {
					t.Fatalf("event %d of a skipped key is %s, want pending", ids[i], status)
				}
			}
			byKey, err := h.BatchOfKey(ctx, 100, walked)
			if err != nil || byKey.Claimed != 3 || byKey.Done != 3 {
				t.Fatalf("BatchOfKey(a/k) after the skip: %+v %v, want its 3 events handed off", byKey, err)
			}
		})
	}
}
