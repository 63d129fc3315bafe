// Package claim holds the dispatcher's SQL and its batch transaction: claim
// due events with FOR UPDATE SKIP LOCKED, route them, insert one River job
// per (event, queue) and mark the events done, all in one transaction, so
// that the handoff is exactly-once. The jobs are River's rows as River's
// InsertManyTx makes them, inserted by the statement that marks their
// events done. For the common event (no ordering key, a payload within the
// rule) that statement is the claim itself (fastSQL), and a batch of such
// events costs one round trip; the others are routed in Go and handed off
// by handoffSQL, and their batch costs two round trips and the COMMIT.
//
// A batch whose River insert fails is rolled back and retried event by
// event, each in its own transaction, so that one poison event fails alone:
// it gets retries+1, last_error and a backoff of 1, 2, 4, 8, 16 or 32
// minutes, and after more than MaxRetries failures the status failed.
package claim

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/internal/jsonlimit"
	"github.com/outboxhq/outbox/internal/lockorder"
	"github.com/outboxhq/outbox/internal/schemacheck"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// Event is a claimed outbox row.
type Event struct {
	ID       int64
	Type     string
	TenantID *string
	// Payload holds the jsonb's text exactly as the server sent it: the
	// dispatcher only forwards it and never decodes it (a payload Go's
	// decoder refuses must not fail the claim of a whole batch).
	Payload     json.RawMessage
	DispatchKey *string
	Retries     int
	CreatedAt   time.Time
	ScheduledAt time.Time
	// TraceContext is the producer's W3C trace context (migration 010), or
	// "" when none.
	TraceContext string
	// OrderingKey is the event's ordering key (migration 011), or nil;
	// OrderingPosition its place in the key's order.
	OrderingKey      *string
	OrderingPosition int64

	// fault says why this row cannot be handed off (see rowFault), or "".
	fault string
	// more: the byte budget left locked rows out of this batch.
	more bool
	// blocked: an earlier event of the same ordering key is still pending,
	// processing or failed outside this batch, so this one must wait (see
	// ordered); soon: one of those is pending and due, so it is in another
	// batch's hands (or cut from this one) and will be handed off shortly.
	blocked, soon bool
	// fastRule is the 1-based rule (fastRoutes) by which the
	// one-statement claim handed this event off, 0 when it did not.
	fastRule int
}

// Position is a place in claim order, (scheduled_at, id).
type Position struct {
	ScheduledAt time.Time
	ID          int64
}

// After reports whether p comes after q in claim order.
func (p Position) After(q Position) bool {
	return p.ScheduledAt.After(q.ScheduledAt) || (p.ScheduledAt.Equal(q.ScheduledAt) && p.ID > q.ID)
}

// claimInOrderSQL locks up to $1 due pending events in claim order
// (scheduled_at, id) that also meet and (" AND ...", or empty): claimSQL
// and its continuations, which differ only there.
func claimInOrderSQL(and string) string {
	return `
SELECT ` + claimColumns + `
FROM outbox_event
WHERE status = 'pending' AND scheduled_at <= now()` + and + `
ORDER BY scheduled_at, id
LIMIT $1
FOR UPDATE SKIP LOCKED`
}

// claimSQL locks up to $1 due pending events. The partial index
// outbox_event_claim_idx (scheduled_at, id) WHERE status = 'pending' makes
// this an index range scan that stops after $1 rows; SKIP LOCKED lets
// concurrent dispatchers take disjoint batches. The rows stay locked until
// the batch transaction ends, so no 'processing' state is written: the
// status goes straight from pending to done (or failed) in the same
// transaction, one UPDATE per row instead of two. budgeted wraps it to
// bound the batch by payload bytes.
var claimSQL = claimInOrderSQL("")

// claimAfterSQL is claimSQL starting after a position: the continuation of a
// drain. Handed-off rows leave dead entries at the front of the claim index
// that only VACUUM removes, so during a long drain a claim from the start
// would walk over every entry drained so far (measured: 2 ms per claim
// after 100,000 events). Starting after the last claimed position skips
// them. It is only a shortcut: rows behind the position (a late commit, a
// rolled-back batch) are found by the next full claim, which every drain
// starts with.
var claimAfterSQL = claimInOrderSQL(afterPosition)

// afterPosition is the condition of claimAfterSQL: after ($4, $5).
const afterPosition = ` AND (scheduled_at, id) > ($4, $5)`

// claimAfterSkipSQL is claimAfterSQL without the events of the ordering
// keys being walked ($6 tenants, empty for none, and $7 keys, pairwise; see
// Handoff.BatchAfter). A walked key's events are the walk's to hand off:
// a batch in claim order that claimed them would only lock them, find
// them held back behind the walk's batch and let go, once for every batch
// of the key's backlog, on the cores the walk's releases run on
// (docs/ordering-measurements.md, "The drain passes a walked key by").
// The filter locks and writes none of the rows it passes, but they do not
// count towards the LIMIT: the index scan reads each one's heap row, so a
// batch that finds nothing else reads the walked keys' whole remaining
// backlog (about 10,000 rows for the bench's hot key, a few milliseconds).
// The drain's position does not move past rows it passed, so a lone
// walker's batches in claim order read them again, before each of its
// walk's batches or every 2 of them (drain.walk, walkProbeMax): still far
// less than the claims they replace, which locked every one of them.
var claimAfterSkipSQL = claimInOrderSQL(afterPosition + `
  AND (ordering_key IS NULL
       OR (COALESCE(tenant_id, ''), ordering_key) NOT IN (SELECT s.tenant, s.key FROM unnest($6::text[], $7::text[]) AS s(tenant, key)))`)

// claimKeySQL locks up to $1 due pending events of one ordering key ($4
// tenant, empty for none; $5 key) in the key's position order, over
// outbox_event_ordering_idx: the walk of a hot key's backlog (see
// Handoff.BatchOfKey). The ordered wrapper still holds back any event
// behind an earlier one of the key that this batch did not lock.
const claimKeySQL = `
SELECT ` + claimColumns + `
FROM outbox_event
WHERE COALESCE(tenant_id, '') = $4 AND ordering_key = $5 AND status = 'pending' AND scheduled_at <= now()
ORDER BY ordering_position
LIMIT $1
FOR UPDATE SKIP LOCKED`

const claimColumns = `id, event_type, tenant_id, payload, dispatch_key, retries, created_at, scheduled_at, trace_context, ordering_key, ordering_position`

// budgeted bounds a claim by payload bytes as well as by count: of the rows
// the locking query (claimSQL, claimAfterSQL) returns, in claim order, it
// keeps those whose running sum of payload sizes stays within $2 bytes, and
// always the first. The size is the payload's JSON text (what the server
// sends and the dispatcher holds in memory), but computing that text costs
// a detoast and a conversion of every row, so a first cut uses the stored
// size (pg_column_size, read from the row or its TOAST pointer without
// fetching the value) and only the rows that survive it are measured
// exactly and cut again. Small payloads (stored in at most 2,000 bytes, so
// inline and uncompressed, their text far below the payload limit) count
// their stored size: measuring their text cost a 100-event claim 60 % more
// time for no gain in the bound. Rows locked but cut are not written: they
// stay pending and the next batch (or another dispatcher once this
// transaction ends) takes them; has_next on the last row returned says
// locked rows were cut, so a drain goes on. A payload larger than $3 bytes
// is not sent at all (NULL), only its size: the row is dead-lettered.
func budgeted(locking string) string {
	return ordered(`
SELECT id, event_type, tenant_id, CASE WHEN size > $3 THEN NULL ELSE payload END AS payload, size,
       dispatch_key, retries, created_at, scheduled_at, trace_context, ordering_key, ordering_position, has_next
FROM (
    SELECT s.*, sum(s.size) OVER w AS size_upto, row_number() OVER w AS n2
    FROM (
        SELECT ` + claimColumns + `, has_next,
               CASE WHEN stored <= 2000 THEN stored ELSE octet_length(c.payload::text) END AS size
        FROM (
            SELECT l.*, pg_column_size(l.payload) AS stored,
                   sum(pg_column_size(l.payload)) OVER w AS stored_upto,
                   row_number() OVER w AS n1, lead(l.id) OVER w IS NOT NULL AS has_next
            FROM (` + locking + `) l
            WINDOW w AS (ORDER BY scheduled_at, id)
        ) c
        WHERE c.n1 = 1 OR c.stored_upto <= $2
    ) s
    WINDOW w AS (ORDER BY scheduled_at, id)
) f
WHERE f.n2 = 1 OR f.size_upto <= $2`)
}

// ordered marks, among the rows the budgeted claim keeps, those that must
// wait for their ordering key (migration 011): an event with a key is
// handed off only when no earlier event of its (tenant, key), by
// ordering_position, is pending, processing or failed, unless that event
// is in this very batch (the handoff then inserts their jobs in position
// order). An earlier event that another batch holds locked, that is not
// due yet, that backs off after a failed attempt or that is dead-lettered
// blocks it: a later event never overtakes an earlier one.
//
// For each key of the batch, first is the earliest such event outside the
// batch (one step of outbox_event_ordering_idx, a partial index that holds
// only unfinished keyed events, past the batch's own rows, which the
// hashed NOT IN skips); the batch's events of that key after it are
// blocked. firsts is MATERIALIZED: once per batch. Inlined, the planner
// (which expects kept to hold one row) ran it as the inner side of a
// nested loop, once per claimed row: 10,000 index lookups for a batch of
// 100 events of 100 keys. Where each key had 40 finished events, the claim
// took 21.4 ms that way and 1.7 ms with firsts materialized
// (docs/ordering-measurements.md, "Open").
// soon says that event is pending and due: another batch holds it (or the
// byte budget cut it from this one), and the drain claims again shortly
// instead of waiting for the next wake. Events without a key skip
// all of it.
func ordered(kept string) string {
	return `
WITH kept AS (` + kept + `),
keys AS (
    SELECT DISTINCT COALESCE(tenant_id, '') AS tenant, ordering_key AS key FROM kept WHERE ordering_key IS NOT NULL
),
firsts AS MATERIALIZED (
    SELECT keys.tenant, keys.key, f.ordering_position AS position, f.soon
    FROM keys CROSS JOIN LATERAL (
        SELECT p.ordering_position, (p.status = 'pending' AND p.scheduled_at <= now()) AS soon
        FROM outbox_event p
        WHERE COALESCE(p.tenant_id, '') = keys.tenant AND p.ordering_key = keys.key
          AND p.status IN ('pending', 'processing', 'failed')
          AND p.id NOT IN (SELECT id FROM kept)
        ORDER BY p.ordering_position
        LIMIT 1
    ) f
)
SELECT k.id, k.event_type, k.tenant_id, k.payload, k.size, k.dispatch_key, k.retries, k.created_at, k.scheduled_at,
       k.trace_context, k.ordering_key, k.ordering_position, k.has_next,
       f.position < k.ordering_position AS blocked, f.position < k.ordering_position AND f.soon AS soon
FROM kept k
LEFT JOIN firsts f ON k.ordering_key IS NOT NULL AND f.tenant = COALESCE(k.tenant_id, '') AND f.key = k.ordering_key
ORDER BY k.scheduled_at, k.id`
}

var (
	budgetedClaimSQL          = budgeted(claimSQL)
	budgetedClaimAfterSQL     = budgeted(claimAfterSQL)
	budgetedClaimAfterSkipSQL = budgeted(claimAfterSkipSQL)
	budgetedClaimKeySQL       = budgeted(claimKeySQL)
)

// DefaultBatchBytes is the default payload byte budget of one batch.
const DefaultBatchBytes = 4 << 20

// planSettingsSQL keeps the claim an ordered scan of the claim index that
// stops at LIMIT. Handed-off rows leave dead entries in that index until
// VACUUM; with stale statistics the planner otherwise picks a bitmap scan
// and a sort, which visits every dead entry and its heap page on every
// claim (measured: 24,000 dead entries cost 1.3-3.5 ms per claim, growing
// with the backlog until autovacuum; the ordered scan marks them dead once
// and then costs 0.1-0.2 ms). Local to the batch transaction. (Generic
// plans for the batch, plan_cache_mode = force_generic_plan, were tried
// and reverted on 2026-12-02: docs/benchmarks-record.md, "Generic plans
// for the batch transaction".)
const planSettingsSQL = `SELECT set_config('enable_bitmapscan', 'off', true), set_config('enable_seqscan', 'off', true)`

// asyncPlanSettingsSQL is planSettingsSQL plus synchronous_commit = off
// (Handoff.SynchronousCommit false), in the same statement.
const asyncPlanSettingsSQL = planSettingsSQL + `, set_config('synchronous_commit', 'off', true)`

// claimOneSQL re-locks one event for the event-by-event retry, in the
// shape of the budgeted claim ($2 is unused: one row is always kept).
var claimOneSQL = budgeted(`
SELECT ` + claimColumns + `
FROM outbox_event
WHERE id = $1 AND status = 'pending'
FOR UPDATE SKIP LOCKED`)

// markBrokenSQL dead-letters rows that can never be handed off (see
// rowFault), at once: retrying cannot change what is stored. $1 and $2 are
// parallel arrays of event ids and reasons.
const markBrokenSQL = `
UPDATE outbox_event e
SET status = 'failed', locked_until = NULL, retries = e.retries + 1, last_error = b.msg
FROM unnest($1::bigint[], $2::text[]) AS b(id, msg)
WHERE e.id = b.id`

// markUnroutableSQL fails events that no route matches, at once.
const markUnroutableSQL = `
UPDATE outbox_event
SET status = 'failed', locked_until = NULL, retries = retries + 1,
    last_error = 'no route matches event type ' || event_type || ': add a rule to the routes file, then requeue'
WHERE id = ANY($1::bigint[])`

// holdSQL moves the due time of events held back for their ordering key
// ($1, ids locked by this batch) to when the event they wait for can move
// (migration 021): the earliest unfinished earlier event of the key, read
// after this batch's own handoffs and failures in the transaction. Behind
// a pending event that is not due (delayed, backing off), to its due time;
// behind a failed (dead-lettered) or processing one, which an operator or
// the rescue moves, to now; either at most holdFor ($2 seconds) on.
// outbox_event_unhold puts held events back at once when the event they
// wait for moves early, but it cannot see a hold that this transaction has
// not committed yet: the bound caps what that race costs (an operator's
// cancel of a head delayed by a month, between this statement and the
// commit, would otherwise hold its key for that month). held_from keeps
// the event's own due time. An event whose earlier event is pending and
// due (another batch holds it), or that no longer waits, is left as it is.
// It returns how many events it moved.
const holdSQL = `
WITH h AS (
    SELECT e.id, w.status, w.scheduled_at AS until
    FROM outbox_event e
    CROSS JOIN LATERAL (
        SELECT p.status, p.scheduled_at
        FROM outbox_event p
        WHERE COALESCE(p.tenant_id, '') = COALESCE(e.tenant_id, '') AND p.ordering_key = e.ordering_key
          AND p.status IN ('pending', 'processing', 'failed')
          AND p.ordering_position < e.ordering_position
        ORDER BY p.ordering_position
        LIMIT 1
    ) w
    WHERE e.id = ANY($1::bigint[]) AND e.status = 'pending' AND e.ordering_key IS NOT NULL
      AND NOT (w.status = 'pending' AND w.scheduled_at <= now())
),
moved AS (
    UPDATE outbox_event e
    SET held_from = COALESCE(e.held_from, e.scheduled_at),
        scheduled_at = CASE WHEN h.status = 'pending' THEN LEAST(h.until, now() + make_interval(secs => $2))
                            ELSE now() + make_interval(secs => $2) END
    FROM h
    WHERE e.id = h.id
    RETURNING 1
)
SELECT count(*) FROM moved`

// holdFor is the most holdSQL moves an event's due time: a held key's
// backlog is claimed at most once per holdFor instead of at every poll,
// and an operator's requeue or cancel of the event it waits for puts it
// back at once (outbox_event_unhold), or, in a race with the hold's
// commit, within holdFor.
const holdFor = time.Minute

// recordFailureSQL records one failed attempt. Backoff is 1, 2, 4, 8, 16, 32
// minutes for the 1st to 6th failure (then 32); after more than $3 failures
// the event is dead-lettered as failed. The status guard leaves an event
// alone if another dispatcher handed it off in the meantime.
const recordFailureSQL = `
UPDATE outbox_event
SET retries      = retries + 1,
    last_error   = $2,
    locked_until = NULL,
    status       = CASE WHEN retries + 1 > $3 THEN 'failed'::outbox_status ELSE 'pending'::outbox_status END,
    scheduled_at = CASE WHEN retries + 1 > $3 THEN scheduled_at
                        ELSE now() + make_interval(mins => 1 << LEAST(retries, 5)) END
WHERE id = $1 AND status IN ('pending', 'processing')
RETURNING status::text, retries, event_type, tenant_id`

// rescueSQL (Handoff.Rescue) puts rows left in 'processing' past
// locked_until back to pending. This dispatcher never commits 'processing'
// (see claimSQL), but external tools or older versions may; the rescue keeps
// them from sticking.
// A processing row without locked_until has no lease that could still be
// running (nothing of this version writes one), so it is rescued too; the
// processing index holds NULL keys as well, so this stays an index scan.
const rescueSQL = `
UPDATE outbox_event SET status = 'pending', locked_until = NULL
WHERE status = 'processing' AND (locked_until < now() OR locked_until IS NULL)`

// Handoff runs batches. Its fields must be set before use and not changed.
type Handoff struct {
	Pool   *pgxpool.Pool
	Routes *route.Table
	// MaxRetries is the number of failed attempts after which the next
	// failure dead-letters the event.
	MaxRetries int
	// BatchBytes bounds the payload bytes of one batch (see budgeted); a
	// batch always takes at least one event. 0 means DefaultBatchBytes.
	BatchBytes int
	// Timeout bounds each transaction (a batch, and each event-by-event
	// retry on its own). A batch that times out is retried event by event;
	// an event that times out alone TimeoutsBeforeCharge times in a row is
	// charged a failed attempt. 0 means no bound of its own.
	Timeout time.Duration
	Alerter alert.Alerter
	// Logger receives the handoff's warnings; nil means slog.Default().
	Logger *slog.Logger
	// SynchronousCommit makes the batch transaction wait for its WAL flush.
	// By default it does not (synchronous_commit off for the transaction): the
	// handoff stays exactly-once because a River worker can only start a
	// job after its own synchronous commit, which flushes the WAL up to and
	// including this earlier transaction; a crash before that loses the
	// batch as a whole (events pending again, no jobs), never half of it.
	// Set it when workers run with synchronous_commit = off themselves.
	SynchronousCommit bool

	mu       sync.Mutex
	timeouts map[int64]int // lone timeouts in a row, by event id

	// fast is the routing table as the one-statement claim's arrays
	// (fastRoutesOf); goOnly turns that claim off (tests compare the two
	// handoffs), fastOffUntil (Unix ns) for a while after it failed.
	// oneTrip: the last batch was handed off by the statement whole, so
	// the next one is sent in one round trip; noOneTrip: never (migration
	// 016 is missing).
	fastOnce     sync.Once
	fast         *fastRoutes
	goOnly       bool
	fastOffUntil atomic.Int64
	oneTrip      atomic.Bool
	noOneTrip    atomic.Bool
	// plainLeft counts down the batches that use the plain claim after
	// one in which the statement handed nothing off (plainBatches).
	plainLeft atomic.Int32
	// holds says whether the batches hold events back (holdSQL, migration
	// 021); line whether the handoff writes its ordered jobs' line rows
	// itself (handoffLineSQL, migration 025).
	holds schemaFeature
	line  schemaFeature
}

// Result summarises one batch.
type Result struct {
	// Claimed is the number of events the claim returned.
	Claimed int
	// Done events were handed to River.
	Done int
	// Jobs inserted into River.
	Jobs int
	// OneStatement of the Done events were handed off by the claim's own
	// statement (fastSQL), the rest by the Go handoff.
	OneStatement int
	// Unroutable events were failed at once.
	Unroutable int
	// Broken events broke the payload rule (or held a value that cannot be
	// handed off) and were dead-lettered at once.
	Broken int
	// Retried events failed an attempt and were rescheduled.
	Retried int
	// DeadLettered events failed for the last time.
	DeadLettered int
	// TimedOut events timed out alone in their transaction (they stay
	// pending, or are counted in Retried or DeadLettered when charged).
	TimedOut int
	// Skipped events were claimed by another dispatcher during the
	// event-by-event retry, or had to wait for their ordering key there.
	Skipped int
	// Blocked events were claimed but left pending because an earlier
	// event of their ordering key must be handed off first (see ordered).
	Blocked int
	// BlockedSoon is true when an event waits for an earlier one that is
	// pending and due: another batch holds it, so claiming again shortly
	// hands the waiting one off.
	BlockedSoon bool
	// Held of the Blocked events wait for an earlier event of their key
	// that cannot move before a due time of its own (delayed, backing off)
	// or an operator's hand (dead-lettered): their due time was moved so
	// that claims leave them alone meanwhile (holdSQL).
	Held int
	// Handed lists the handed-off events: those the claim statement
	// handed off in claim order, then the Go handoff's (metrics count them
	// by route and time them; benchmarks time each by id).
	Handed []Handed
	// Fallback is true when the batch failed as a whole and its events were
	// retried one by one.
	Fallback bool
	// More is true when the byte budget cut the batch: more events were
	// due than it returned, although it returned fewer than its limit.
	More bool
	// Last is the claim-order position of the last claimed event (zero
	// when none was claimed), where BatchAfter can continue.
	Last Position
	// TopKey is the ordering key with the most events handed off in this
	// batch's transaction, and TopKeyDone that number (0 when no keyed
	// event was handed off; at most 1 after an event-by-event fallback,
	// whose transactions hand off one event each): a batch that a key
	// fills is a hot key's, whose next events BatchOfKey claims.
	TopKey     Key
	TopKeyDone int
}

// Key is an ordering key with its tenant ("" for none).
type Key struct {
	TenantID    string
	OrderingKey string
}

// Handed is one event handed off to River.
type Handed struct {
	ID   int64
	Type string
	// Route is the prefix of the rule that routed it.
	Route     string
	CreatedAt time.Time
}

func (r *Result) add(o Result) {
	r.Done += o.Done
	r.Jobs += o.Jobs
	r.OneStatement += o.OneStatement
	r.Unroutable += o.Unroutable
	r.Broken += o.Broken
	r.Retried += o.Retried
	r.DeadLettered += o.DeadLettered
	r.Skipped += o.Skipped
	r.Blocked += o.Blocked
	r.Held += o.Held
	r.BlockedSoon = r.BlockedSoon || o.BlockedSoon
	r.TimedOut += o.TimedOut
	r.Handed = append(r.Handed, o.Handed...)
	if o.TopKeyDone > r.TopKeyDone {
		r.TopKey, r.TopKeyDone = o.TopKey, o.TopKeyDone
	}
}

// Rescue puts rows left in 'processing' past their lease back to pending
// (see rescueSQL) and returns how many it put back.
func (h *Handoff) Rescue(ctx context.Context) (int64, error) {
	tag, err := h.Pool.Exec(ctx, rescueSQL)
	if err != nil {
		return 0, fmt.Errorf("claim: rescue stale processing rows: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Batch claims up to limit due events and hands them off in one
// transaction. When the River insert or the commit fails, the batch is
// rolled back and every claimed event is retried in its own transaction.
// An error means the batch could not run at all (nothing changed).
func (h *Handoff) Batch(ctx context.Context, limit int) (Result, error) {
	return h.batch(ctx, batchClaim, limit, h.batchBytes(), outbox.MaxPayloadBytes)
}

func (h *Handoff) batchBytes() int {
	if h.BatchBytes > 0 {
		return h.BatchBytes
	}
	return DefaultBatchBytes
}

// BatchAfter is Batch for the events after position after in claim order:
// the continuation of a drain (see claimAfterSQL). It may miss events
// behind the position; a later Batch finds them. The events of the
// ordering keys in skip (the keys a drain walks, BatchOfKey) are passed
// over, not claimed: they stay pending and due, and the claim of the
// position moves past them like past events another batch holds.
func (h *Handoff) BatchAfter(ctx context.Context, limit int, after Position, skip ...Key) (Result, error) {
	if len(skip) == 0 {
		return h.batch(ctx, afterClaim, limit, h.batchBytes(), outbox.MaxPayloadBytes, after.ScheduledAt, after.ID)
	}
	tenants, keys := make([]string, len(skip)), make([]string, len(skip))
	for i, k := range skip {
		tenants[i], keys[i] = k.TenantID, k.OrderingKey
	}
	return h.batch(ctx, afterSkipClaim, limit, h.batchBytes(), outbox.MaxPayloadBytes, after.ScheduledAt, after.ID, tenants, keys)
}

// BatchOfKey is Batch for the due events of one ordering key, in the
// key's order: the next batch of a key whose events filled the previous
// one (Result.TopKey). Only one batch at a time can hand a key's events
// off; walking the key's backlog by key lets the batch that does go on
// with the key's next events, wherever they are in claim order, while
// other batches go on past them.
func (h *Handoff) BatchOfKey(ctx context.Context, limit int, key Key) (Result, error) {
	return h.batch(ctx, keyClaim, limit, h.batchBytes(), outbox.MaxPayloadBytes, key.TenantID, key.OrderingKey)
}

// claimQuery is a claim and its one-statement forms (fastSQL): in the
// batch transaction (fast) and on its own (oneTrip); "" when it has none.
type claimQuery struct{ sql, fast, oneTrip string }

var (
	batchClaim = claimQuery{budgetedClaimSQL, fastClaimSQL, oneTripClaimSQL}
	afterClaim = claimQuery{budgetedClaimAfterSQL, fastClaimAfterSQL, oneTripClaimAfterSQL}
	// The continuation past the keys being walked (BatchAfter's skip).
	afterSkipClaim = claimQuery{budgetedClaimAfterSkipSQL, fastClaimAfterSkipSQL, oneTripClaimAfterSkipSQL}
	// A key's walk claims only keyed events, which the statement never
	// hands off.
	keyClaim = claimQuery{sql: budgetedClaimKeySQL}
)

// batch claims with q and hands the claimed events off, in one of three
// ways:
//
//   - one round trip: the one-statement claim (fastSQL) sent without BEGIN,
//     so that it commits on its own, checked by the statement itself
//     (migration 016). Used while the batches before were handed off by the
//     statement whole. Events it leaves (a fault, keyed events of a rule
//     of several jobs, ...) are not locked any more when it returns; a
//     batch transaction (below) claims and hands them off at once, and
//     the next batches use that until one is handed off by the statement
//     whole again.
//   - the batch transaction with the one-statement claim: the statement
//     hands the common events off, the Go handoff the rest, and the
//     dispatcher checks the statement's counts before COMMIT.
//   - the batch transaction with the plain claim and the Go handoff alone:
//     for the walk of a key, for routes the statement cannot write, for
//     fastOffFor after the statement failed, and for plainBatches after a
//     batch in which it handed nothing off.
func (h *Handoff) batch(ctx context.Context, q claimQuery, args ...any) (Result, error) {
	fast := h.fastRoutesOf(q)
	if fast != nil && h.plainLeft.Load() > 0 {
		// The statement handed nothing off lately (every event keyed and
		// routed to two queues, say): the plain claim, without the routing
		// it would do for nothing, until plainLeft runs out.
		h.plainLeft.Add(-1)
		fast = nil
	}
	if fast == nil {
		return h.txBatch(ctx, q.sql, nil, "", args)
	}
	var (
		res Result
		ff  *fastFailure
		// leftOver: the one-round-trip batch left events to this call's
		// batch transaction.
		leftOver bool
	)
	if h.oneTrip.Load() && !h.noOneTrip.Load() {
		first, rest, err := h.oneTripBatch(ctx, fast, q.oneTrip, args)
		switch {
		case err == nil && rest == 0:
			return first, nil
		case err == nil:
			res, leftOver = first, true
		case errors.As(err, &ff):
			fast = h.fastFailed(ff, true)
		default:
			return first, err
		}
		h.oneTrip.Store(false)
		if fast == nil {
			return h.txBatch(ctx, q.sql, nil, "", args)
		}
	}
	more, err := h.txBatch(ctx, q.sql, fast, q.fast, args)
	if errors.As(err, &ff) {
		h.fastFailed(ff, false)
		more, err = h.txBatch(ctx, q.sql, nil, "", args)
		res.merge(more)
		return res, err
	}
	res.merge(more)
	if err == nil && more.Claimed > 0 && !res.Fallback {
		// Whole batches go one round trip at a time from the next one on;
		// after a batch with nothing for the statement, the next
		// plainBatches use the plain claim.
		h.oneTrip.Store(!leftOver && more.OneStatement == more.Claimed)
		if res.OneStatement == 0 {
			h.plainLeft.Store(plainBatches)
		}
	}
	return res, err
}

// plainBatches is how many batches use the plain claim after a batch in
// which the one-statement claim handed nothing off: a stream of keyed
// events of a rule with several jobs pays for the statement's routing once
// in plainBatches+1 batches.
const plainBatches = 15

// fastFailure is a failure of the one-statement claim, not of the
// database: the batch is handed off again without it.
type fastFailure struct{ err error }

func (f *fastFailure) Error() string { return "one-statement handoff: " + f.err.Error() }
func (f *fastFailure) Unwrap() error { return f.err }

// fastOffFor is how long the one-statement claim stays off after it failed
// (a trigger on River's table refused a job, a slow insert timed out):
// meanwhile the Go handoff finds the event at fault and charges it alone,
// and a failure that repeats costs a failed statement twice a minute, not
// at every batch.
const fastOffFor = 30 * time.Second

// fastFailed logs a failure of the one-statement claim and turns the
// statement off for fastOffFor; it returns the routes for the batch
// transaction to use next (nil: the plain claim). A one-round-trip statement
// whose check function is missing (migration 016 not applied) turns only
// the one round trip off, until the process restarts.
func (h *Handoff) fastFailed(f *fastFailure, oneTrip bool) *fastRoutes {
	var pgErr *pgconn.PgError
	if oneTrip && errors.As(f.err, &pgErr) && pgErr.Code == "42883" {
		h.noOneTrip.Store(true)
		h.logger().Warn("outbox: outbox_handoff_check() is missing (run `outboxctl migrate`): batches are handed off in a batch transaction, one round trip more each",
			slog.String("error", f.err.Error()))
		return h.fast
	}
	h.fastOffUntil.Store(time.Now().Add(fastOffFor).UnixNano())
	h.logger().Warn("outbox: the one-statement handoff failed; batches are handed off by the Go handoff for a while",
		slog.String("error", f.err.Error()), slog.Duration("for", fastOffFor))
	return nil
}

func (h *Handoff) logger() *slog.Logger {
	if h.Logger != nil {
		return h.Logger
	}
	return slog.Default()
}

// merge adds o, a later batch of the same call, to r: the counts, and the
// claim's extent (the larger claim, the later position).
func (r *Result) merge(o Result) {
	r.add(o)
	r.Claimed = max(r.Claimed, o.Claimed)
	r.More = r.More || o.More
	r.Fallback = r.Fallback || o.Fallback
	if o.Last.After(r.Last) {
		r.Last = o.Last
	}
}

// oneTripBatch claims and hands off with the one-statement claim sent
// without BEGIN: the setup and the statement are one implicit transaction,
// which commits when the server reaches the batch's Sync, in one round
// trip. It returns the batch's result and how many claimed events the
// statement left (not handed off, and no longer locked). A failure of the
// statement is a *fastFailure after the connection was reaped if it timed
// out; nothing of it is committed.
func (h *Handoff) oneTripBatch(ctx context.Context, fast *fastRoutes, sql string, args []any) (Result, int, error) {
	var res Result
	conn, err := h.Pool.Acquire(ctx)
	if err != nil {
		return res, 0, fmt.Errorf("claim: acquire connection: %w", err)
	}
	defer conn.Release()
	tctx, cancel := h.txContext(ctx)
	defer cancel()

	var counts fastCounts
	b := &pgx.Batch{}
	b.Queue(h.setupSQL())
	b.Queue(sql, append(args, fast.args()...)...)
	br := conn.Conn().SendBatch(tctx, b)
	events, err := readClaim(br, 1, scanFast(&counts))
	// Close reads the end of the batch: the implicit transaction's commit.
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		return res, 0, h.fastError(ctx, tctx, conn.Conn(), fmt.Errorf("claim: %w", err))
	}
	res = extent(events)
	// The rules come from fast's own arrays: summarize cannot fail here
	// unless the statement is broken, and its check has passed.
	handed, rest, err := fast.summarize(events)
	if err != nil {
		return res, 0, err
	}
	res.add(handed)
	return res, len(rest), nil
}

// fastError classifies err, a failure of the one-statement claim on conn
// whose transaction context was tctx: the caller's cancellation and a
// database at fault (transient, not a timeout) are returned as they are;
// anything else is a *fastFailure, after the session was reaped if it
// timed out (it may still hold the claimed rows' locks).
func (h *Handoff) fastError(ctx, tctx context.Context, conn *pgx.Conn, err error) error {
	if ctx.Err() != nil {
		return err
	}
	timeout := timedOut(ctx, tctx, err)
	if timeout {
		h.reap(ctx, conn)
	}
	if IsTransient(err) && !timeout {
		return err
	}
	return &fastFailure{err}
}

// extent is the Result of a claim that returned events, before anything
// is handed off: how many, whether the byte budget cut it, and the
// claim-order position of its last event.
func extent(events []Event) Result {
	res := Result{Claimed: len(events)}
	if n := len(events); n > 0 {
		res.More = events[n-1].more
		res.Last = Position{ScheduledAt: events[n-1].ScheduledAt, ID: events[n-1].ID}
	}
	return res
}

// setupSQL is the batch's first statement (planSettingsSQL, with
// synchronous_commit off unless SynchronousCommit).
func (h *Handoff) setupSQL() string {
	if h.SynchronousCommit {
		return planSettingsSQL
	}
	return asyncPlanSettingsSQL
}

// txBatch claims with sql, or with fastSQL (the one-statement claim of
// fast) when fast is not nil, and hands the claimed events off in the
// batch transaction. A failure of the one-statement claim (as a whole, or
// its counts) is a *fastFailure, after a rollback (and a reap if it timed
// out): nothing of it is committed, and the caller claims again without it.
func (h *Handoff) txBatch(ctx context.Context, sql string, fast *fastRoutes, fastSQL string, args []any) (Result, error) {
	var res Result
	conn, err := h.Pool.Acquire(ctx)
	if err != nil {
		return res, fmt.Errorf("claim: acquire connection: %w", err)
	}
	defer conn.Release()

	tctx, cancel := h.txContext(ctx)
	defer cancel()
	var (
		tx     pgx.Tx
		events []Event
		counts fastCounts
	)
	if fast != nil {
		tx, events, err = h.beginWith(tctx, conn.Conn(), scanFast(&counts), fastSQL, append(args, fast.args()...)...)
	} else {
		tx, events, err = h.begin(tctx, conn.Conn(), sql, args...)
	}
	if err != nil {
		if fast == nil {
			return res, err
		}
		return res, h.fastError(ctx, tctx, conn.Conn(), err)
	}
	defer rollback(ctx, tx)
	res = extent(events)
	if len(events) == 0 {
		// Nothing locked, nothing written.
		return res, finish(tctx, tx, nil, nil, nil)
	}

	// The one-statement claim handed some events off already (in this
	// transaction, not committed); the Go handoff takes the rest and
	// commits.
	var (
		fastRes    Result
		rest       = events
		batchRes   Result
		unroutable []Event
	)
	if fast != nil {
		if fastRes, rest, err = fast.takeFast(events, counts); err != nil {
			rollback(ctx, tx)
			return Result{}, &fastFailure{err}
		}
	}
	batchRes, unroutable, err = h.handoff(tctx, tx, rest)
	if err != nil {
		if ctx.Err() != nil {
			return res, err
		}
		rollback(ctx, tx)
		timeout := timedOut(ctx, tctx, err)
		if timeout {
			h.reap(ctx, conn.Conn())
		}
		if IsTransient(err) && !timeout {
			// The database, not an event, is at fault: charge no event a
			// retry; the events stay pending and the loop backs off.
			return res, err
		}
		if timeout && len(events) == 1 {
			one, err := h.loneTimeout(ctx, events[0], err)
			res.add(one)
			return res, err
		}
		// Poison isolation: retry each event alone. After a timeout this
		// also finds the slow event; two lone timeouts in a row say the
		// database itself is slow, and the loop backs off instead.
		res.Fallback = true
		inARow := 0
		for _, e := range events {
			one, oneErr := h.one(ctx, e.ID, err)
			res.add(one)
			if oneErr != nil {
				return res, oneErr
			}
			if one.TimedOut == 0 {
				inARow = 0
				continue
			}
			if inARow++; inARow == 2 {
				return res, fmt.Errorf("claim: two events in a row timed out alone, the database is slow: %w", err)
			}
		}
		return res, nil
	}
	res.add(fastRes)
	res.add(batchRes)
	h.alertUnroutable(ctx, unroutable)
	return res, nil
}

// One hands off a single event in its own transaction; batchErr is the
// error that made its batch fail, recorded if this attempt fails too.
func (h *Handoff) One(ctx context.Context, id int64, batchErr error) (Result, error) {
	return h.one(ctx, id, batchErr)
}

func (h *Handoff) one(ctx context.Context, id int64, batchErr error) (Result, error) {
	var res Result
	conn, err := h.Pool.Acquire(ctx)
	if err != nil {
		return res, fmt.Errorf("claim: acquire connection: %w", err)
	}
	defer conn.Release()

	tctx, cancel := h.txContext(ctx)
	defer cancel()
	tx, events, err := h.begin(tctx, conn.Conn(), claimOneSQL, id, 0, outbox.MaxPayloadBytes)
	if err != nil {
		return res, err
	}
	defer rollback(ctx, tx)
	if len(events) == 0 || events[0].blocked {
		res.Skipped = 1
		return res, finish(tctx, tx, nil, nil, nil)
	}
	res.Claimed = 1
	oneRes, unroutable, err := h.handoff(tctx, tx, events)
	if err == nil {
		h.forgetTimeouts(id)
		res.add(oneRes)
		h.alertUnroutable(ctx, unroutable)
		return res, nil
	}
	if ctx.Err() != nil {
		return res, err
	}
	rollback(ctx, tx)
	if timedOut(ctx, tctx, err) {
		h.reap(ctx, conn.Conn())
		one, err := h.loneTimeout(ctx, events[0], err)
		res.add(one)
		return res, err
	}
	if IsTransient(err) {
		return res, err
	}
	if batchErr != nil && !errors.Is(err, batchErr) {
		err = fmt.Errorf("%w (batch: %w)", err, batchErr)
	}
	charged, err := h.charge(ctx, events[0], err)
	res.add(charged)
	return res, err
}

// TimeoutsBeforeCharge is how many times in a row an event's handoff may
// time out with the event alone in its transaction before the timeout
// counts as a failed attempt of that event (retries+1, backoff, and in the
// end the dead letter). Fewer are not charged: a lone timeout can also be a
// passing slowness of the database.
const TimeoutsBeforeCharge = 3

// loneTimeout records that e's handoff timed out with e alone in its
// transaction; the TimeoutsBeforeCharge-th time in a row it is charged to e.
// The count lives in this Handoff (a restart forgets it).
func (h *Handoff) loneTimeout(ctx context.Context, e Event, cause error) (Result, error) {
	res := Result{TimedOut: 1}
	h.mu.Lock()
	if h.timeouts == nil || len(h.timeouts) > 10000 {
		h.timeouts = map[int64]int{}
	}
	h.timeouts[e.ID]++
	n := h.timeouts[e.ID]
	if n >= TimeoutsBeforeCharge {
		delete(h.timeouts, e.ID)
	}
	h.mu.Unlock()
	if n < TimeoutsBeforeCharge {
		return res, nil
	}
	charged, err := h.charge(ctx, e, fmt.Errorf("handoff timed out %d times in a row with the event alone in its transaction (the River insert or the update of this event blocks or is too slow): %w", n, cause))
	res.add(charged)
	return res, err
}

// charge records a failed attempt of e (recordFailure) and counts it as
// retried or, past the last attempt, dead-lettered.
func (h *Handoff) charge(ctx context.Context, e Event, cause error) (Result, error) {
	var res Result
	failed, err := h.recordFailure(ctx, e, cause)
	switch {
	case err != nil:
	case failed:
		res.DeadLettered = 1
	default:
		res.Retried = 1
	}
	return res, err
}

func (h *Handoff) forgetTimeouts(id int64) {
	h.mu.Lock()
	delete(h.timeouts, id)
	h.mu.Unlock()
}

// reap ends the server session of a transaction that timed out when the
// client gave up on it (pgx closes the connection when the cancel request
// does not take effect in time): the session may still run the blocked
// statement and hold the claimed rows' locks, and the event-by-event retry
// and the next batch would skip them (SKIP LOCKED) until it ends.
func (h *Handoff) reap(ctx context.Context, conn *pgx.Conn) {
	if !conn.IsClosed() {
		return // rolled back: the locks are gone
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	_, _ = h.Pool.Exec(rctx, `SELECT pg_terminate_backend($1, 5000)`, int32(conn.PgConn().PID()))
}

// txContext bounds one transaction by Timeout.
func (h *Handoff) txContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if h.Timeout > 0 {
		return context.WithTimeout(ctx, h.Timeout)
	}
	return context.WithCancel(ctx)
}

// timedOut reports whether err ended a transaction because it ran out of
// time (its own deadline tctx, or the server's statement_timeout or
// lock_timeout) while the caller's ctx is still live.
func timedOut(ctx, tctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	if tctx.Err() != nil {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "57014" || pgErr.Code == "55P03"
	}
	return errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err)
}

// begin opens the batch transaction and claims, in one round trip.
func (h *Handoff) begin(ctx context.Context, conn *pgx.Conn, sql string, args ...any) (pgx.Tx, []Event, error) {
	return h.beginWith(ctx, conn, scanEvent, sql, args...)
}

// beginWith is begin for a claim whose rows scan reads.
func (h *Handoff) beginWith(ctx context.Context, conn *pgx.Conn, scan pgx.RowToFunc[Event], sql string, args ...any) (pgx.Tx, []Event, error) {
	tx, events, err := beginAndClaim(ctx, conn, h.setupSQL(), scan, sql, args...)
	if err != nil {
		return nil, nil, fmt.Errorf("claim: %w", err)
	}
	return tx, events, nil
}

// scanEvent reads one claimed row without judging it: the payload as bytes
// (pgx copies the bytes for a *[]byte target, where a json.RawMessage
// target would run encoding/json over them), the times as pgtype values
// (a stored ±infinity cannot be scanned into a time.Time). Whatever makes
// the row impossible to hand off is recorded in fault, for that row alone.
func scanEvent(row pgx.CollectableRow) (Event, error) {
	return scanEventWith(row)
}

// scanEventWith is scanEvent for a row with more columns after the claim's,
// scanned into extra.
func scanEventWith(row pgx.CollectableRow, extra ...any) (Event, error) {
	var (
		e                  Event
		created, scheduled pgtype.Timestamptz
		traceContext       *string
		position           *int64
		isBlocked, soon    *bool
		size               int
	)
	dest := append([]any{&e.ID, &e.Type, &e.TenantID, (*[]byte)(&e.Payload), &size, &e.DispatchKey, &e.Retries, &created, &scheduled, &traceContext, &e.OrderingKey, &position, &e.more, &isBlocked, &soon}, extra...)
	if err := row.Scan(dest...); err != nil {
		return e, err
	}
	if position != nil {
		e.OrderingPosition = *position
	}
	e.blocked = isBlocked != nil && *isBlocked
	e.soon = soon != nil && *soon
	if traceContext != nil {
		e.TraceContext = *traceContext
	}
	// In UTC, whatever the process's time zone: the job args carry
	// created_at as encoding/json writes it, and the one-statement claim
	// (fastSQL) writes it in UTC too.
	e.CreatedAt, e.ScheduledAt = created.Time.UTC(), scheduled.Time
	switch {
	case created.InfinityModifier != pgtype.Finite:
		e.fault = "created_at is infinite: the job args cannot carry it"
	case e.CreatedAt.Year() < 0 || e.CreatedAt.Year() > 9999:
		e.fault = fmt.Sprintf("created_at %s is outside years 0..9999: the job args cannot carry it", created.Time.Format(time.RFC3339))
	case scheduled.InfinityModifier != pgtype.Finite:
		e.fault = "scheduled_at is infinite"
	default:
		e.fault = rowFault(e.Payload, size)
	}
	return e, nil
}

// rowFault checks a payload of size bytes (its JSON text; the claim sends
// no payload, nil, when it is too large) against the payload rule, the one Publish and
// outbox_publish enforce: at most outbox.MaxPayloadBytes of JSON text and
// nested at most jsonlimit.MaxDepth levels. Rows from older versions or
// from writers that bypassed the rule can break it; such a row is
// dead-lettered instead of handed off, since no retry can fix it and a
// worker could not decode its args. It returns "" for a good payload.
func rowFault(payload []byte, size int) string {
	const rule = "; the payload rule is at most %d bytes and %d levels of nesting: fix the producer; the event is dead-lettered without a River job"
	if size > outbox.MaxPayloadBytes || payload == nil {
		return fmt.Sprintf("payload is %d bytes"+rule, size, outbox.MaxPayloadBytes, jsonlimit.MaxDepth)
	}
	if jsonlimit.Exceeds(payload, jsonlimit.MaxDepth) {
		return fmt.Sprintf("payload is nested deeper than %d levels"+rule, jsonlimit.MaxDepth, outbox.MaxPayloadBytes, jsonlimit.MaxDepth)
	}
	return ""
}

// handoff routes events, inserts their jobs, and marks them done or failed
// and commits, in tx. It returns the unroutable events for alerting.
func (h *Handoff) handoff(ctx context.Context, tx pgx.Tx, events []Event) (Result, []Event, error) {
	var (
		res        Result
		unroutable []Event
		broken     []Event
		final      []queued
		params     = make([]river.InsertManyParams, 0, len(events))
		jobEvent   = make([]int64, 0, len(events))
		// jobPos is each job's place among its event's jobs (route order).
		jobPos = make([]int, 0, len(events))
		// stopped holds the ordering keys whose event in this batch was
		// failed at once (broken or unroutable): their later events wait.
		stopped map[orderingScope]bool
		// locks says which key row each job of params locks (see
		// insertOrder); anyKeyed is set when any does.
		locks    = make([]jobLock, 0, len(events))
		anyKeyed bool
		keyDone  keyTally
		// hold lists the blocked events that wait for an event that is
		// not about to move (holdSQL).
		hold []int64
		// lineWrites: the jobs go in with handoffLineSQL (canLine).
		lineWrites bool
	)
	events = inKeyOrder(events)
	for i := range events {
		e := &events[i]
		scope, keyed := scopeOf(e)
		if e.blocked || (keyed && stopped[scope]) {
			res.Blocked++
			res.BlockedSoon = res.BlockedSoon || e.soon
			if !e.soon {
				hold = append(hold, e.ID)
			}
			continue
		}
		if e.fault != "" {
			broken = append(broken, *e)
			if keyed {
				stopped = stop(stopped, scope)
			}
			continue
		}
		rule, ok := h.Routes.Match(e.Type)
		if !ok {
			unroutable = append(unroutable, *e)
			if keyed {
				stopped = stop(stopped, scope)
			}
			continue
		}
		args := outboxriver.EventArgs{
			EventID:      e.ID,
			EventType:    e.Type,
			TenantID:     e.TenantID,
			Payload:      e.Payload,
			DispatchKey:  e.DispatchKey,
			CreatedAt:    e.CreatedAt,
			TraceContext: e.TraceContext,
			OrderingKey:  e.OrderingKey,
		}
		if keyed {
			args.OrderingPosition = e.OrderingPosition
		}
		// One job per queue of the rule, shaped by the route (kind, args,
		// priority, max attempts, tags) and carrying the event in its
		// metadata; in the rule's order, so river_job_ids keeps route order.
		for k, p := range outboxriver.JobParams(rule, args) {
			params = append(params, p)
			jobEvent = append(jobEvent, e.ID)
			jobPos = append(jobPos, k)
			locks = append(locks, jobLock{keyed: keyed, lock: lockorder.Key{Tenant: scope.tenant, OrderingKey: scope.key, Queue: p.InsertOpts.Queue}})
			anyKeyed = anyKeyed || keyed
		}
		res.Done++
		res.Handed = append(res.Handed, Handed{ID: e.ID, Type: e.Type, Route: rule.Prefix, CreatedAt: e.CreatedAt})
		if keyed {
			keyDone.add(&res, scope)
		}
	}
	var counts [4]int64 // jobs inserted, events marked done, job ids recorded, queues announced
	if len(params) > 0 {
		order := make([]int, len(params))
		for i := range order {
			order[i] = i
		}
		if anyKeyed {
			order = insertOrder(locks)
		}
		var cols jobColumns
		for _, j := range order {
			if err := cols.add(jobEvent[j], jobPos[j], params[j]); err != nil {
				return res, nil, fmt.Errorf("event %d: %w", jobEvent[j], err)
			}
		}
		stmt := handoffSQL
		if anyKeyed {
			var err error
			if lineWrites, err = h.canLine(ctx, tx); err != nil {
				return res, nil, err
			}
			if lineWrites {
				stmt = handoffLineSQL
			}
		}
		final = append(final, queued{what: "insert River jobs and mark events done", sql: stmt, args: cols.sqlArgs(), row: []any{&counts[0], &counts[1], &counts[2], &counts[3]}})
		res.Jobs = len(params)
	}
	if len(unroutable) > 0 {
		ids := make([]int64, len(unroutable))
		for i, e := range unroutable {
			ids[i] = e.ID
		}
		final = append(final, queued{what: "mark unroutable", sql: markUnroutableSQL, args: []any{ids}})
		res.Unroutable = len(unroutable)
	}
	if len(broken) > 0 {
		ids := make([]int64, len(broken))
		msgs := make([]string, len(broken))
		for i, e := range broken {
			ids[i], msgs[i] = e.ID, e.fault
		}
		final = append(final, queued{what: "dead-letter broken rows", sql: markBrokenSQL, args: []any{ids, msgs}})
		res.Broken = len(broken)
	}
	var (
		held     int64
		holdStmt *optional
	)
	if len(hold) > 0 {
		// After the statements above: holdSQL reads what they wrote.
		ok, err := h.canHold(ctx, tx)
		if err != nil {
			return res, nil, err
		}
		if ok {
			// Optional: the hold only spares later claims a look at
			// events that cannot move yet. When it fails, the batch's
			// handoff commits without it and its events stay due, as on a
			// schema before 021; holds are then off for a while, so a hold
			// that keeps failing costs neither a savepoint's rollback nor a
			// warning per batch.
			holdStmt = &optional{
				queued: queued{what: "hold back events for their key", sql: holdSQL, args: []any{hold, holdFor.Seconds()}, row: []any{&held}},
				onFail: func(err error) {
					held = 0 // Scan may have set it before an error after the row
					h.holds.turnOff()
					h.logger().Warn("outbox: holding back events for their ordering key failed; the batch is handed off without it, they stay due, and holds are off for a minute",
						slog.Int("events", len(hold)), slog.String("error", err.Error()))
				},
			}
		}
	}
	check := func() error {
		if len(params) > 0 && (counts[0] != int64(len(params)) || counts[1] != int64(res.Done) || counts[2] != int64(len(params))) {
			return fmt.Errorf("insert River jobs and mark events done: %d jobs inserted for %d, %d events marked done for %d, %d job ids recorded for %d",
				counts[0], len(params), counts[1], res.Done, counts[2], len(params))
		}
		return nil
	}
	if err := finish(ctx, tx, final, holdStmt, check); err != nil {
		if lineWrites && lineLost(err) {
			// The grant or the line's columns went away after canLine
			// looked (a REVOKE, a restore without privileges): this batch
			// fails and is handed off again, through the trigger.
			h.line.turnOff()
			h.logger().Warn("outbox: writing ordered jobs into their key's line failed; the handoff sends every job through the ordering trigger for a while",
				slog.String("error", err.Error()), slog.Duration("for", featureRecheck))
		}
		return res, nil, err
	}
	res.Held = int(held)
	h.alertBroken(ctx, broken)
	return res, unroutable, nil
}

// lineLost reports whether err is a missing privilege, table or column:
// what handoffLineSQL meets when the schema lost what canLine found.
func lineLost(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "42501" || pgErr.Code == "42P01" || pgErr.Code == "42703")
}

// schemaFeature remembers whether the schema has what a newer migration
// brings: not looked at yet (featureUnknown), there (featureOn), or
// missing until checkAt (Unix ns), when has looks again (featureOff).
type schemaFeature struct {
	state   atomic.Int32
	checkAt atomic.Int64
}

// The states of a schemaFeature.
const (
	featureUnknown int32 = iota
	featureOn
	featureOff
)

// featureRecheck is how long a feature stays off before has looks at the
// schema again.
const featureRecheck = time.Minute

// has reports whether the feature is there: it asks look once, in tx, and
// when the answer is no (or after turnOff) again after featureRecheck.
func (f *schemaFeature) has(ctx context.Context, tx pgx.Tx, look func(context.Context, schemacheck.Querier) (bool, error)) (bool, error) {
	switch f.state.Load() {
	case featureOn:
		return true, nil
	case featureOff:
		if time.Now().UnixNano() < f.checkAt.Load() {
			return false, nil
		}
	}
	ok, err := look(ctx, tx)
	if err != nil {
		return false, err
	}
	if ok {
		f.state.Store(featureOn)
	} else {
		f.turnOff()
	}
	return ok, nil
}

// turnOff turns the feature off for featureRecheck.
func (f *schemaFeature) turnOff() {
	f.checkAt.Store(time.Now().Add(featureRecheck).UnixNano())
	f.state.Store(featureOff)
}

// canHold reports whether batches hold events back (holdSQL): whether the
// schema has migration 021, which it needs. On an older schema, or after a
// hold failed (holds.turnOff), it looks again after featureRecheck.
// Meanwhile held events are claimed at every poll, as before 021.
func (h *Handoff) canHold(ctx context.Context, tx pgx.Tx) (bool, error) {
	return h.holds.has(ctx, tx, schemacheck.HeldFrom)
}

// canLine reports whether the handoff writes its ordered jobs' rows of
// their key's line itself (handoffLineSQL): whether the schema has
// migration 025 and the role may insert into outbox_ordering_wait. On an
// older schema (or without the grant) it looks again after
// featureRecheck; meanwhile every job goes through River's insert and the
// enqueue trigger, as before 025.
func (h *Handoff) canLine(ctx context.Context, tx pgx.Tx) (bool, error) {
	return h.line.has(ctx, tx, schemacheck.LineWrites)
}

// jobLock is the key row an ordered job locks when it is inserted: the
// ordering trigger locks the row of its (tenant, key, queue).
type jobLock struct {
	keyed bool
	lock  lockorder.Key
}

// insertOrder returns the order in which to insert the jobs whose locks
// are given (indexes into them): jobs without a key first, then the
// ordered ones in lockorder's order. The sort is stable and inKeyOrder has
// put each key's events in position order, so a key's jobs stay in
// position order. The ordering triggers lock each key's row in the order
// of the insert, and the ordered completion middleware locks its keys in
// the same order (package lockorder), so that a batch and a completion
// that share two keys queue behind each other instead of deadlocking
// (Postgres would break the cycle after deadlock_timeout, a second in
// which both keys stand still).
func insertOrder(locks []jobLock) []int {
	order := make([]int, len(locks))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		x, y := locks[a], locks[b]
		if x.keyed != y.keyed {
			if !x.keyed {
				return -1
			}
			return 1
		}
		return lockorder.Compare(x.lock, y.lock)
	})
	return order
}

// orderingScope is an ordering key with its tenant ("" for none).
type orderingScope struct{ tenant, key string }

// keyTally counts a batch's handed-off events per ordering key and keeps
// Result.TopKey and TopKeyDone on the key with the most. The zero value is
// ready to use.
type keyTally struct{ done map[orderingScope]int }

// add counts one handed-off event of scope in res.
func (t *keyTally) add(res *Result, scope orderingScope) {
	if t.done == nil {
		t.done = map[orderingScope]int{}
	}
	t.done[scope]++
	if n := t.done[scope]; n > res.TopKeyDone {
		res.TopKey, res.TopKeyDone = Key{TenantID: scope.tenant, OrderingKey: scope.key}, n
	}
}

func scopeOf(e *Event) (orderingScope, bool) {
	if e.OrderingKey == nil {
		return orderingScope{}, false
	}
	return orderingScope{tenant: deref(e.TenantID), key: *e.OrderingKey}, true
}

func stop(m map[orderingScope]bool, s orderingScope) map[orderingScope]bool {
	if m == nil {
		m = map[orderingScope]bool{}
	}
	m[s] = true
	return m
}

// inKeyOrder puts the events of each ordering key in position order,
// within the slots they hold in claim order ((scheduled_at, id), which the
// position follows except when two producers of a key raced between
// taking an id and taking the key's lock): their jobs are inserted, and so
// queued behind each other, in this order. Events without a key keep their
// place.
func inKeyOrder(events []Event) []Event {
	var slots map[orderingScope][]int
	for i := range events {
		if s, ok := scopeOf(&events[i]); ok {
			if slots == nil {
				slots = map[orderingScope][]int{}
			}
			slots[s] = append(slots[s], i)
		}
	}
	for _, idx := range slots {
		inOrder := true
		for j := 1; j < len(idx); j++ {
			if events[idx[j]].OrderingPosition < events[idx[j-1]].OrderingPosition {
				inOrder = false
				break
			}
		}
		if inOrder {
			continue
		}
		group := make([]Event, len(idx))
		for j, i := range idx {
			group[j] = events[i]
		}
		slices.SortStableFunc(group, func(a, b Event) int { return cmp.Compare(a.OrderingPosition, b.OrderingPosition) })
		for j, i := range idx {
			events[i] = group[j]
		}
	}
	return events
}

func (h *Handoff) alertBroken(ctx context.Context, events []Event) {
	if h.Alerter == nil {
		return
	}
	for _, e := range events {
		h.Alerter.Alert(ctx, alert.Alert{
			Reason:    alert.DeadLetter,
			Message:   fmt.Sprintf("event %d (%s) cannot be handed off and is dead-lettered", e.ID, e.Type),
			EventID:   e.ID,
			EventType: e.Type,
			TenantID:  deref(e.TenantID),
			Retries:   e.Retries + 1,
			Err:       e.fault,
		})
	}
}

func (h *Handoff) alertUnroutable(ctx context.Context, events []Event) {
	if h.Alerter == nil {
		return
	}
	for _, e := range events {
		h.Alerter.Alert(ctx, alert.Alert{
			Reason:    alert.Unroutable,
			Message:   "no route matches event type " + e.Type + "; the event is failed",
			EventID:   e.ID,
			EventType: e.Type,
			TenantID:  deref(e.TenantID),
		})
	}
}

// recordFailure writes one failed attempt; it reports whether the event is
// now dead-lettered.
func (h *Handoff) recordFailure(ctx context.Context, e Event, cause error) (bool, error) {
	msg := truncateUTF8(cause.Error(), 2000)
	var (
		status   string
		retries  int
		typ      string
		tenantID *string
	)
	err := h.Pool.QueryRow(ctx, recordFailureSQL, e.ID, msg, h.MaxRetries).Scan(&status, &retries, &typ, &tenantID)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil // handed off or changed by someone else meanwhile
	}
	if err != nil {
		return false, fmt.Errorf("claim: record failure of event %d: %w", e.ID, err)
	}
	if status != "failed" {
		return false, nil
	}
	if h.Alerter != nil {
		h.Alerter.Alert(ctx, alert.Alert{
			Reason:    alert.DeadLetter,
			Message:   fmt.Sprintf("event %d (%s) failed %d times and is dead-lettered", e.ID, typ, retries),
			EventID:   e.ID,
			EventType: typ,
			TenantID:  deref(tenantID),
			Retries:   retries,
			Err:       msg,
		})
	}
	return true, nil
}

// IsTransient reports whether err says the database or the connection is
// at fault rather than the event: connection loss, a cancelled or timed-out
// statement, a lock or serialization conflict, resource exhaustion, the
// server shutting down. Such failures are not charged to the events.
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || pgconn.SafeToRetry(err) || pgconn.Timeout(err) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code[:2] {
		case "08", // connection exception
			"40", // transaction rollback: serialization failure, deadlock
			"53", // insufficient resources
			"57", // operator intervention: query_canceled (statement_timeout), admin shutdown
			"58": // system error
			return true
		}
		return pgErr.Code == "55P03" // lock_not_available (lock_timeout)
	}
	// Not a server error: the connection broke (EOF, reset) mid-batch.
	var connErr *pgconn.ConnectError
	return errors.As(err, &connErr) || isNetError(err)
}

func isNetError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func truncateUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "…"
}
