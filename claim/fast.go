package claim

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/jsonlimit"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// The one-statement handoff. A batch used to take three round trips: the
// claim, the handoff statement (handoffSQL) and the COMMIT. The claim's
// round trip came back to the dispatcher only so that Go could route the
// events and encode their jobs' args and metadata; for the common event
// (a payload within the payload rule, a rule whose jobs the handoff can
// write, and, for an event with an ordering key, a rule of one job) that
// work is plain data, which fastSQL does in
// the claim's own statement: it claims, routes by the longest matching
// prefix, builds each job's args and metadata as outboxriver.JobParams
// does, inserts River's rows, marks the events done and announces the
// queues. In the batch transaction a batch of such events takes two round
// trips (claim statement, COMMIT); sent without BEGIN (Handoff.batch), one,
// the shape of the relay floor (docs/benchmarks-record.md, "The floor").
//
// Every other event of the batch (a fault, no rule, a rule the statement
// cannot write) comes back locked and untouched, and the Go handoff
// (Handoff.handoff) hands it off in the same transaction as before. Keyed
// events go all together or not at all: when one keyed event of the batch
// must go to the Go handoff (its rule has two jobs or more, a fault, an
// earlier event of its key holds it back), every keyed event of the batch
// does. The key rows that the ordering trigger locks as each job is
// inserted are thus locked by one statement, in insertOrder's order, never
// some by this statement and more by the Go handoff's after it, which
// could lock two keys against a completion in the other order; and no
// event of a key is handed off while an earlier one of the batch waits.
// The statement's rows are the Go handoff's rows:
// TestFastHandoffMatchesGoHandoff hands the same events off both ways and
// compares every column of River's rows and of the events.

// fastRoutes is a routing table as the parallel arrays of fastSQL, built
// once per Handoff from its route.Table: the rules (longest prefix first,
// Table.Rules' order, which is Match's), and one entry per job of each rule
// that the statement can write, with what does not depend on the event.
type fastRoutes struct {
	rules  []route.Rule
	prefix []string
	// fast says the statement writes the rule's jobs; an event of any
	// other rule is left to the Go handoff (still routed by the
	// statement, so that a longer prefix is never skipped for a shorter).
	fast []bool
	// jobs is the number of jobs of each rule.
	jobs []int

	// One entry per job of the fast rules, in each rule's order.
	rule        []int32 // 1-based index of the rule
	pos         []int32 // the job's place among its rule's jobs
	queue       []string
	kind        []string
	payloadArgs []bool // args: payload (outboxriver.PayloadArgs)
	priority    []int16
	maxAttempts []int16
	tags        []string // comma-joined, as jobColumns

	argv []any // args(), built once
}

// newFastRoutes builds the arrays of t. A rule's jobs are made with
// outboxriver.JobParams for a sample event and turned into River's columns
// by jobColumns.add, exactly as the Go handoff makes them; the columns that
// do not depend on the event are kept. A rule whose jobs jobColumns refuses,
// or whose args are of a type the statement does not build, is not fast:
// the Go handoff then fails its events with the reason, as before.
func newFastRoutes(t *route.Table) *fastRoutes {
	f := &fastRoutes{rules: t.Rules()}
	sample := outboxriver.EventArgs{EventID: 1, EventType: "sample", Payload: json.RawMessage(`{}`)}
	for i, r := range f.rules {
		f.prefix = append(f.prefix, r.Prefix)
		params := outboxriver.JobParams(r, sample)
		f.jobs = append(f.jobs, len(params))
		var cols jobColumns
		fast := len(params) > 0
		payload := make([]bool, len(params))
		for k, p := range params {
			switch p.Args.(type) {
			case outboxriver.EventArgs, outboxriver.KindedEventArgs:
			case outboxriver.PayloadArgs:
				payload[k] = true
			default:
				fast = false
			}
			if err := cols.add(sample.EventID, k, p); err != nil {
				fast = false
			}
		}
		f.fast = append(f.fast, fast)
		if !fast {
			continue
		}
		for k := range params {
			f.rule = append(f.rule, int32(i+1))
			f.pos = append(f.pos, int32(k))
			f.queue = append(f.queue, cols.queue[k])
			f.kind = append(f.kind, cols.kind[k])
			f.payloadArgs = append(f.payloadArgs, payload[k])
			f.priority = append(f.priority, cols.priority[k])
			f.maxAttempts = append(f.maxAttempts, cols.maxAttempts[k])
			f.tags = append(f.tags, cols.tags[k])
		}
	}
	f.argv = []any{f.prefix, f.fast, f.rule, f.pos, f.queue, f.kind, f.payloadArgs, f.priority, f.maxAttempts, f.tags}
	return f
}

// args returns fastSQL's arguments after the claim's own (not to be
// modified: every batch shares them).
func (f *fastRoutes) args() []any { return f.argv }

// fastSQL is the one-statement handoff around claim, a budgeted claim
// (budgeted, ordered) whose own parameters are $1..$(base-1); the routes
// are $base..$(base+9) (fastRoutes.args).
//
// The CTEs eligible and routed pick the claimed events the statement hands
// off: the rule of the longest matching prefix (route.PrefixMatches in SQL:
// the empty prefix matches every type, a prefix ending in a dot the types
// that start with it, any other prefix its own type) is fast; the event has
// no ordering key, or else its rule has one job, no earlier event of its
// key holds it back (blocked), and every other keyed event of the batch is
// eligible too (see above); the payload passes rowFault (sent, so within
// the byte limit, and nested
// at most jsonlimit.MaxDepth levels: the payload rule's own test of
// migration 005); created_at is within years 1000-9998 and scheduled_at is
// finite (so the time formats below and the Go handoff's checks agree); the
// database is UTF-8 (so that strings need no repair that encoding/json
// would make).
//
// The CTE job builds each job's args and metadata as JobParams and
// encoding/json do. River stores both as jsonb, so what must agree is the
// JSON value, not its text: the envelope's fields (EventArgs: event_id,
// event_type, tenant_id and dispatch_key null when none, payload,
// created_at in RFC 3339 with the fraction's trailing zeros trimmed, in
// UTC, as time.Time's MarshalJSON writes the UTC time scanEvent makes), or
// the payload itself; and the metadata keys of jobMetadata, each absent
// when empty as its omitempty says, the trace context split at its first
// space as splitTraceContext does.
//
// The jobs are inserted in ord order, insertOrder's: first the jobs without
// a key, each event's one after the other in route order; then the keyed
// ones (one job per event), by tenant, key and queue in byte order (COLLATE
// "C", as lockorder.Compare) and by position within a key. The job ids are
// recorded in route order by sorting them, since River's ids come from a
// sequence drawn as each row is inserted. (handoffSQL joins the jobs back
// instead, because there the ordering locks can change the insert order of
// an event's several jobs; here a keyed event has one.) Every
// join here is a lookup per claimed row, never a join of two CTEs, whose
// sizes the planner cannot know: it planned those as nested loops, and a
// batch of 1,000 events took 0.4 s.
//
// The statement returns the claim's rows in claim order, each with the
// rule the statement handed it off by (NULL when it did not; its payload
// is then not sent back) and the handoff's four counts (handoffCounts).
func fastSQL(claim string, base int, oneTrip bool) string {
	p := func(i int) string { return fmt.Sprintf("$%d", base+i) }
	// Sent without BEGIN the statement commits on its own, so it checks
	// its counts itself (migration 016); in the batch transaction the
	// dispatcher checks them before COMMIT (takeFast).
	check := "NULL::bigint"
	if oneTrip {
		check = "outbox_handoff_check(x.jobs, (SELECT count(*) FROM job), x.done, (SELECT count(*) FROM ev), x.recorded)"
	}
	return `
WITH c AS MATERIALIZED (` + claim + `),
rule AS (
    SELECT * FROM unnest(` + p(0) + `::text[], ` + p(1) + `::bool[]) WITH ORDINALITY AS r(prefix, fast, idx)
),
tmpl AS (
    SELECT * FROM unnest(` + p(2) + `::int[], ` + p(3) + `::int[], ` + p(4) + `::text[], ` + p(5) + `::text[], ` + p(6) + `::bool[], ` + p(7) + `::smallint[], ` + p(8) + `::smallint[], ` + p(9) + `::text[])
        AS t(rule_idx, route_pos, queue, kind, payload_args, priority, max_attempts, tags)
),
eligible AS MATERIALIZED (
    SELECT c.*, m.idx AS match_idx,
           coalesce(m.fast, false) AND c.payload IS NOT NULL
                 AND NOT jsonb_path_exists(c.payload, 'strict $.**{` + fmt.Sprint(jsonlimit.MaxDepth) + `} ? (@.type() == "object" || @.type() == "array")')
                 AND c.created_at >= '1000-01-01 00:00:00+00' AND c.created_at < '9999-01-01 00:00:00+00'
                 AND isfinite(c.scheduled_at)
                 AND current_setting('server_encoding') = 'UTF8'
                 AND (c.ordering_key IS NULL
                      OR (NOT coalesce(c.blocked, false) AND c.ordering_position IS NOT NULL
                          AND (SELECT count(*) FROM tmpl t WHERE t.rule_idx = m.idx) = 1)) AS ok
    FROM c LEFT JOIN LATERAL (
        SELECT r.idx, r.fast FROM rule r
        WHERE r.prefix = '' OR r.prefix = c.event_type OR (right(r.prefix, 1) = '.' AND starts_with(c.event_type, r.prefix))
        ORDER BY r.idx
        LIMIT 1
    ) m ON true
),
routed AS MATERIALIZED (
    SELECT f.id, f.event_type, f.tenant_id, f.payload, f.size, f.dispatch_key, f.retries, f.created_at, f.scheduled_at,
           f.trace_context, f.ordering_key, f.ordering_position, f.has_next, f.blocked, f.soon,
           CASE WHEN f.ok AND (f.ordering_key IS NULL
                               OR bool_and(f.ok) FILTER (WHERE f.ordering_key IS NOT NULL) OVER ())
                THEN f.match_idx END AS rule_idx
    FROM eligible f
),
ev AS (
    SELECT f.*,
           regexp_replace(to_char(f.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US'), '[.]?0+$', '') || 'Z' AS created,
           split_part(coalesce(f.trace_context, ''), ' ', 1) AS traceparent,
           CASE WHEN strpos(f.trace_context, ' ') > 0 THEN substr(f.trace_context, strpos(f.trace_context, ' ') + 1) ELSE '' END AS tracestate
    FROM routed f
    WHERE f.rule_idx IS NOT NULL
),
job AS (
    SELECT f.id AS event_id, t.route_pos,
           CASE WHEN t.payload_args THEN f.payload
                WHEN f.ordering_key IS NULL
                THEN jsonb_build_object('event_id', f.id, 'event_type', f.event_type, 'tenant_id', f.tenant_id,
                                        'payload', f.payload, 'dispatch_key', f.dispatch_key, 'created_at', f.created)
                ELSE jsonb_build_object('event_id', f.id, 'event_type', f.event_type, 'tenant_id', f.tenant_id,
                                        'payload', f.payload, 'dispatch_key', f.dispatch_key, 'created_at', f.created,
                                        'ordering_key', f.ordering_key)
           END AS args,
           t.kind, t.max_attempts,
           jsonb_strip_nulls(jsonb_build_object(
               'outbox_event_id', f.id, 'outbox_event_type', f.event_type,
               'outbox_tenant_id', f.tenant_id, 'outbox_dispatch_key', f.dispatch_key,
               'outbox_created_at', CASE WHEN t.payload_args THEN f.created END,
               'outbox_args', CASE WHEN t.payload_args THEN '` + string(route.ArgsPayload) + `' END,
               'traceparent', NULLIF(f.traceparent, ''), 'tracestate', NULLIF(f.tracestate, ''),
               'outbox_ordering_key', f.ordering_key,
               'outbox_ordering_position', CASE WHEN f.ordering_key IS NOT NULL THEN f.ordering_position END)) AS metadata,
           t.priority, t.queue, t.tags,
           row_number() OVER (ORDER BY f.ordering_key IS NOT NULL,
                                       CASE WHEN f.ordering_key IS NOT NULL THEN coalesce(f.tenant_id, '') END COLLATE "C",
                                       f.ordering_key COLLATE "C",
                                       CASE WHEN f.ordering_key IS NOT NULL THEN t.queue END COLLATE "C",
                                       f.ordering_position, f.scheduled_at, f.id, t.route_pos) AS ord
    FROM ev f JOIN tmpl t ON t.rule_idx = f.rule_idx
),` + handoffWritesSQL(`
        SELECT event_id, array_agg(jid ORDER BY jid) AS ids
        FROM jobn
        GROUP BY event_id`, false) + `,
counts AS MATERIALIZED (
    SELECT x.*, ` + check + ` AS checked
    FROM (SELECT ` + handoffCounts + `) x(jobs, done, recorded, queues)
)
SELECT f.id, f.event_type, f.tenant_id, CASE WHEN f.rule_idx IS NULL THEN f.payload END, f.size, f.dispatch_key, f.retries,
       f.created_at, f.scheduled_at, f.trace_context, f.ordering_key, f.ordering_position, f.has_next, f.blocked, f.soon,
       f.rule_idx, n.jobs, n.done, n.recorded, n.queues
FROM routed f
CROSS JOIN counts n
ORDER BY f.scheduled_at, f.id`
}

// The claims with a one-statement form. A key's walk (claimKeySQL) claims
// only keyed events, which the statement never hands off.
var (
	fastClaimSQL          = fastSQL(budgetedClaimSQL, 4, false)
	fastClaimAfterSQL     = fastSQL(budgetedClaimAfterSQL, 6, false)
	fastClaimAfterSkipSQL = fastSQL(budgetedClaimAfterSkipSQL, 8, false)

	oneTripClaimSQL          = fastSQL(budgetedClaimSQL, 4, true)
	oneTripClaimAfterSQL     = fastSQL(budgetedClaimAfterSQL, 6, true)
	oneTripClaimAfterSkipSQL = fastSQL(budgetedClaimAfterSkipSQL, 8, true)
)

// fastCounts are what the one-statement claim reports of its handoff
// (handoffCounts).
type fastCounts [4]int64

// scanFast reads a row of fastSQL: a claimed row (scanEvent), the rule it
// was handed off by and the statement's counts, the same on every row.
func scanFast(counts *fastCounts) pgx.RowToFunc[Event] {
	return func(row pgx.CollectableRow) (Event, error) {
		var rule *int64
		e, err := scanEventWith(row, &rule, &counts[0], &counts[1], &counts[2], &counts[3])
		if err != nil || rule == nil {
			return e, err
		}
		// Handed off: its payload was not sent back, and nothing about it
		// is a fault.
		e.fastRule, e.fault = int(*rule), ""
		return e, nil
	}
}

// takeFast splits the claimed events into those the one-statement claim
// handed off, summed up in the returned Result, and the rest, for the Go
// handoff. It checks the statement's counts against what it says it handed
// off; an error means the transaction must not commit.
func (f *fastRoutes) takeFast(events []Event, n fastCounts) (Result, []Event, error) {
	res, rest, err := f.summarize(events)
	if err != nil {
		return Result{}, nil, err
	}
	if n[0] != int64(res.Jobs) || n[1] != int64(res.Done) || n[2] != int64(res.Jobs) {
		return Result{}, nil, fmt.Errorf("claim: one-statement handoff: %d jobs inserted for %d, %d events marked done for %d, %d job ids recorded for %d",
			n[0], res.Jobs, n[1], res.Done, n[2], res.Jobs)
	}
	return res, rest, nil
}

// summarize is takeFast without the check of the counts, for a statement
// that checked them itself: the events handed off, summed up, and the rest.
// An event handed off by a rule f does not have is an error.
func (f *fastRoutes) summarize(events []Event) (Result, []Event, error) {
	var (
		res     Result
		rest    = make([]Event, 0, len(events))
		keyDone keyTally
	)
	for i := range events {
		e := &events[i]
		if e.fastRule == 0 {
			rest = append(rest, *e)
			continue
		}
		if e.fastRule > len(f.rules) {
			return Result{}, nil, fmt.Errorf("claim: event %d handed off by rule %d of %d", e.ID, e.fastRule, len(f.rules))
		}
		rule := f.rules[e.fastRule-1]
		res.Done++
		res.OneStatement++
		res.Jobs += f.jobs[e.fastRule-1]
		res.Handed = append(res.Handed, Handed{ID: e.ID, Type: e.Type, Route: rule.Prefix, CreatedAt: e.CreatedAt})
		if scope, keyed := scopeOf(e); keyed {
			keyDone.add(&res, scope)
		}
	}
	return res, rest, nil
}

// fastRoutesOf returns h's routes as fastSQL's arrays for claim q, built on
// first use (the table does not change), or nil when q has no one-statement
// form, no rule is one the statement writes, or the statement is off.
func (h *Handoff) fastRoutesOf(q claimQuery) *fastRoutes {
	if q.fast == "" || h.Routes == nil || h.goOnly || time.Now().UnixNano() < h.fastOffUntil.Load() {
		return nil
	}
	h.fastOnce.Do(func() {
		f := newFastRoutes(h.Routes)
		if slices.Contains(f.fast, true) {
			h.fast = f
		}
	})
	return h.fast
}
