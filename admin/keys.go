package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox"
)

// Limits of Keys.
const (
	// DefaultKeysLimit is KeysFilter.Limit when it is 0.
	DefaultKeysLimit = 100
	// MaxKeysLimit is the largest KeysFilter.Limit.
	MaxKeysLimit = 10000
)

// What holds an ordering key back (KeyAttention.Kind).
const (
	// KeyParked: the head job of the key in a queue was discarded or
	// cancelled (or deleted when its turn came); the key's later jobs wait
	// in its line until an operator unparks it (Unpark).
	KeyParked = "parked"
	// KeyHeadMissing: the key's head job is no longer in river_job but the
	// key was never parked (the job was deleted by hand before it
	// finished): its later jobs wait and nothing will release them by itself.
	KeyHeadMissing = "head_missing"
	// KeyHeldInOutbox: an event of the key failed (dead-lettered) in the
	// outbox and later events of the key wait behind it there, never handed
	// off; requeue or cancel the failed event to let them go.
	KeyHeldInOutbox = "held_in_outbox"
)

// KeysFilter selects the ordering keys Keys lists. Every field that is set
// narrows the list; text is matched exactly.
type KeysFilter struct {
	// Tenant keeps the keys of this tenant; "" means every tenant (and no
	// tenant).
	Tenant string `json:"tenant,omitempty"`
	// Key keeps this ordering key.
	Key string `json:"ordering_key,omitempty"`
	// Queue keeps the keys of this River queue (it leaves out keys held in
	// the outbox, which have no queue yet).
	Queue string `json:"queue,omitempty"`
	// ParkedOnly keeps parked keys only (KeyParked).
	ParkedOnly bool `json:"parked_only,omitempty"`
	// Limit is the most keys returned, 1..MaxKeysLimit; 0 means
	// DefaultKeysLimit. KeyList.More says when more matched.
	Limit int `json:"limit"`
}

// KeyList is what Keys returns.
type KeyList struct {
	// Keys are sorted oldest first (by Since), then by tenant, key and
	// queue.
	Keys []KeyAttention `json:"keys"`
	// More is true when more keys matched beyond Filter.Limit.
	More bool `json:"more"`
	// Filter is the filter as run, defaults filled in.
	Filter KeysFilter `json:"filter"`
	// AsOf is the database's clock when the keys were read.
	AsOf time.Time `json:"as_of"`
}

// KeyAttention is one ordering key whose later events wait for an operator:
// in one River queue (KeyParked, KeyHeadMissing) or in the outbox
// (KeyHeldInOutbox).
type KeyAttention struct {
	Kind string `json:"kind"`
	// TenantID is nil for the events without a tenant.
	TenantID    *string `json:"tenant_id"`
	OrderingKey string  `json:"ordering_key"`
	// Queue is the River queue; "" for a key held in the outbox.
	Queue string `json:"queue,omitempty"`
	// Since is when the key was parked; for a head missing, when that job
	// became the head; for a key held in the outbox, the failed event's
	// scheduled_at (the due time of its last attempt).
	Since time.Time `json:"since"`
	// ParkedState is why a parked key is parked: the head job was
	// discarded, cancelled or deleted.
	ParkedState string `json:"parked_state,omitempty"`
	// Head is what holds the key: its head job (and event), or the failed
	// event in the outbox.
	Head KeyHead `json:"head"`
	// Waiting is how many jobs (in the outbox: pending events) of the key
	// wait behind the head; OldestWaitingSince is when the oldest of them
	// started waiting (the event's created_at in the outbox), nil when none.
	Waiting            int64      `json:"waiting"`
	OldestWaitingSince *time.Time `json:"oldest_waiting_since"`
	// OldestWaitingAgeS is AsOf minus OldestWaitingSince in seconds; 0
	// when nothing waits.
	OldestWaitingAgeS float64 `json:"oldest_waiting_age_s"`
}

// KeyHead is the job or event that holds a key.
type KeyHead struct {
	// EventID is the head's event (nil for a job inserted without one).
	EventID  *int64 `json:"event_id"`
	Position int64  `json:"position"`
	// JobID is the head job; nil for a key held in the outbox. JobFound is
	// false when river_job no longer has it (River's cleaner deletes
	// discarded jobs after 7 days by default, or it was deleted by hand).
	JobID    *int64 `json:"job_id"`
	JobFound bool   `json:"job_found"`
	// State is the head job's River state, or, for a key held in the
	// outbox, the event's status (failed).
	State string `json:"state,omitempty"`
	// Attempt and MaxAttempts are the job's; for a key held in the outbox,
	// Attempt is the event's failed dispatch attempts (retries).
	Attempt     int `json:"attempt"`
	MaxAttempts int `json:"max_attempts,omitempty"`
	// LastError is the job's last recorded error (river_job.errors), or the
	// event's last_error.
	LastError *string `json:"last_error"`
}

// keysSQL lists the keys that need an operator, oldest first: the rows of
// outbox_ordering_key that are parked or whose head job is gone, and, per
// (tenant, key), the first failed keyed event in the outbox that has later
// pending or processing events of its key. Both outbox_event scans are
// served by the partial index outbox_event_ordering_idx (its predicate
// covers failed, pending and processing keyed rows). $1 tenant, $2 key, $3
// queue (NULL: any), $4 parked only, $5 the limit (one more is read to tell
// whether more matched).
const keysSQL = `
WITH river_keys AS (
    SELECT CASE WHEN k.parked_at IS NOT NULL THEN 'parked' ELSE 'head_missing' END AS kind,
           k.tenant_id, k.ordering_key, k.queue, coalesce(k.parked_at, k.head_since) AS since, k.parked_state,
           k.head_event_id, k.head_position, k.head_job_id, r.id IS NOT NULL AS job_found, r.state::text AS state,
           coalesce(r.attempt, 0) AS attempt, coalesce(r.max_attempts, 0) AS max_attempts,
           r.errors[array_length(r.errors, 1)]->>'error' AS last_error,
           w.waiting, w.oldest
    FROM outbox_ordering_key k
    LEFT JOIN river_job r ON r.id = k.head_job_id
    LEFT JOIN LATERAL (
        SELECT count(*) AS waiting, min(x.since) AS oldest FROM outbox_ordering_wait x
        WHERE x.tenant_id = k.tenant_id AND x.ordering_key = k.ordering_key AND x.queue = k.queue) w ON true
    WHERE (k.parked_at IS NOT NULL OR (NOT $4::boolean AND r.id IS NULL))
      AND ($1::text IS NULL OR k.tenant_id = $1::text)
      AND ($2::text IS NULL OR k.ordering_key = $2::text)
      AND ($3::text IS NULL OR k.queue = $3::text)
),
first_failed AS (
    SELECT DISTINCT ON (coalesce(e.tenant_id, ''), e.ordering_key)
           coalesce(e.tenant_id, '') AS tenant_id, e.ordering_key, e.id, e.ordering_position, e.scheduled_at, e.retries, e.last_error
    FROM outbox_event e
    WHERE e.ordering_key IS NOT NULL AND e.status = 'failed'
      AND NOT $4::boolean AND $3::text IS NULL
      AND ($1::text IS NULL OR coalesce(e.tenant_id, '') = $1::text)
      AND ($2::text IS NULL OR e.ordering_key = $2::text)
    ORDER BY coalesce(e.tenant_id, ''), e.ordering_key, e.ordering_position
),
held AS (
    SELECT 'held_in_outbox' AS kind, f.tenant_id, f.ordering_key, NULL::text AS queue, f.scheduled_at AS since, NULL::text AS parked_state,
           f.id AS head_event_id, f.ordering_position AS head_position, NULL::bigint AS head_job_id, false AS job_found, 'failed' AS state,
           f.retries AS attempt, 0 AS max_attempts, f.last_error, w.n AS waiting, w.oldest
    FROM first_failed f
    CROSS JOIN LATERAL (
        SELECT count(*) AS n, min(x.created_at) AS oldest FROM outbox_event x
        WHERE coalesce(x.tenant_id, '') = f.tenant_id AND x.ordering_key = f.ordering_key
          AND x.ordering_position > f.ordering_position AND x.status IN ('pending', 'processing')) w
    WHERE w.n > 0
)
SELECT kind, nullif(tenant_id, ''), ordering_key, coalesce(queue, ''), since, coalesce(parked_state, ''),
       head_event_id, head_position, head_job_id, job_found, coalesce(state, ''), attempt, max_attempts, last_error,
       waiting, oldest, coalesce(extract(epoch FROM now() - oldest)::float8, 0), now()
FROM (SELECT * FROM river_keys UNION ALL SELECT * FROM held) a
ORDER BY since, tenant_id, ordering_key, queue NULLS FIRST
LIMIT $5`

// CheckKeys validates f for Keys and returns it with its defaults filled
// in, or a *SelectionError.
func CheckKeys(f KeysFilter) (KeysFilter, error) {
	if f.Limit == 0 {
		f.Limit = DefaultKeysLimit
	}
	if f.Limit < 1 || f.Limit > MaxKeysLimit {
		return f, &SelectionError{Flag: "limit", Msg: fmt.Sprintf("%d is out of range: use 1 to %d", f.Limit, MaxKeysLimit)}
	}
	for _, t := range []struct{ flag, v string }{{"tenant", f.Tenant}, {"key", f.Key}, {"queue", f.Queue}} {
		if err := checkText(t.flag, t.v); err != nil {
			return f, err
		}
	}
	return f, nil
}

// Keys lists the ordering keys whose later events wait for an operator:
// parked keys, keys whose head job no longer exists, and keys held in the
// outbox by a failed event. It never returns a nil Keys without an error.
func (c *Client) Keys(ctx context.Context, f KeysFilter) (*KeyList, error) {
	f, err := CheckKeys(f)
	if err != nil {
		return nil, err
	}
	res := &KeyList{Keys: []KeyAttention{}, Filter: f}
	rows, err := c.pool.Query(ctx, keysSQL, nullIfEmpty(f.Tenant), nullIfEmpty(f.Key), nullIfEmpty(f.Queue), f.ParkedOnly, f.Limit+1)
	if err != nil {
		return nil, c.explain(ctx, fmt.Errorf("read ordering keys (has `outboxctl migrate` run?): %w", err))
	}
	for rows.Next() {
		var k KeyAttention
		h := &k.Head
		if err := rows.Scan(&k.Kind, &k.TenantID, &k.OrderingKey, &k.Queue, &k.Since, &k.ParkedState,
			&h.EventID, &h.Position, &h.JobID, &h.JobFound, &h.State, &h.Attempt, &h.MaxAttempts, &h.LastError,
			&k.Waiting, &k.OldestWaitingSince, &k.OldestWaitingAgeS, &res.AsOf); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read ordering keys: %w", err)
		}
		res.Keys = append(res.Keys, k)
	}
	if err := rows.Err(); err != nil {
		return nil, c.explain(ctx, fmt.Errorf("read ordering keys: %w", err))
	}
	if len(res.Keys) > f.Limit {
		res.Keys, res.More = res.Keys[:f.Limit], true
	}
	return res, nil
}

// keySummarySQL counts the keys that need an operator, for an overview:
// parked keys, and keys whose head job is gone (never parked).
const keySummarySQL = `
SELECT count(*) FILTER (WHERE k.parked_at IS NOT NULL),
       count(*) FILTER (WHERE k.parked_at IS NULL AND NOT EXISTS (SELECT 1 FROM river_job r WHERE r.id = k.head_job_id)),
       min(k.parked_at)
FROM outbox_ordering_key k`

// KeySummary counts the ordering keys in River that need an operator.
type KeySummary struct {
	Parked      int `json:"parked"`
	HeadMissing int `json:"head_missing"`
	// OldestParkedAt is when the longest-parked key was parked; nil when
	// none is.
	OldestParkedAt *time.Time `json:"oldest_parked_at"`
}

// KeySummary counts the parked keys and the keys whose head job is gone
// (Keys lists them, and the keys held in the outbox).
func (c *Client) KeySummary(ctx context.Context) (KeySummary, error) {
	var s KeySummary
	err := c.pool.QueryRow(ctx, keySummarySQL).Scan(&s.Parked, &s.HeadMissing, &s.OldestParkedAt)
	if err != nil {
		return s, c.explain(ctx, fmt.Errorf("count ordering keys (has `outboxctl migrate` run?): %w", err))
	}
	return s, nil
}

// The actions of Unpark (UnparkRequest.Action).
const (
	// UnparkRetry makes the parked head job available again (one more
	// attempt if it had none left); the key stays held until it finishes.
	UnparkRetry = "retry"
	// UnparkSkip leaves the head job as it is and releases the next
	// waiting job of the key.
	UnparkSkip = "skip"
)

// MaxReasonBytes is the longest UnparkRequest.Reason.
const MaxReasonBytes = 1000

// UnparkRequest says which parked key Unpark lets go on, and how.
type UnparkRequest struct {
	// Actor is who runs it, recorded in the audit: 1 to 256 bytes, no NUL.
	// Required.
	Actor string `json:"actor"`
	// Key is the ordering key (required); Tenant its tenant ("" for the
	// events without one).
	Key    string `json:"ordering_key"`
	Tenant string `json:"tenant,omitempty"`
	// Queue unparks the key in this River queue only; "" means in every
	// queue where it is parked.
	Queue string `json:"queue,omitempty"`
	// Action is UnparkRetry or UnparkSkip. Required.
	Action string `json:"action"`
	// DryRun reports what would change and changes and records nothing.
	DryRun bool `json:"dry_run"`
	// Reason is recorded in the audit (at most MaxReasonBytes).
	Reason string `json:"reason,omitempty"`
}

// UnparkResult is what Unpark reports.
type UnparkResult struct {
	// Request is the request as run.
	Request UnparkRequest `json:"request"`
	// Keys are the parked (tenant, key, queue) rows that were (for a dry
	// run: would be) unparked, by queue.
	Keys []UnparkedKey `json:"keys"`
	// AuditID is the outbox_audit row of the change; 0 for a dry run.
	AuditID int64 `json:"audit_id,omitempty"`
}

// UnparkedKey is one queue of an unparked key, as it was before.
type UnparkedKey struct {
	Queue       string `json:"queue"`
	HeadJobID   int64  `json:"head_job_id"`
	HeadEventID *int64 `json:"head_event_id"`
	ParkedState string `json:"parked_state"`
	// Waiting is how many jobs of the key waited behind the head.
	Waiting int64 `json:"waiting"`
}

// ErrNotParked is returned (wrapped in a *NotParkedError; test with
// errors.Is) when Unpark finds no parked key to unpark.
var ErrNotParked = errors.New("admin: the ordering key is not parked")

// NotParkedError says why Unpark found nothing to unpark, and what to do.
type NotParkedError struct {
	Key, Tenant, Queue string
	// HeldByEvent is the failed event that holds the key in the outbox
	// (requeue or cancel it instead); 0 when none does.
	HeldByEvent int64
	// Why is the finding, in a sentence.
	Why string
}

// Error names the key and says what was found.
func (e *NotParkedError) Error() string {
	where := ""
	if e.Tenant != "" {
		where += fmt.Sprintf(" of tenant %q", e.Tenant)
	}
	if e.Queue != "" {
		where += fmt.Sprintf(" in queue %q", e.Queue)
	}
	return fmt.Sprintf("ordering key %q%s is not parked: %s", e.Key, where, e.Why)
}

// Is makes errors.Is(err, ErrNotParked) true.
func (e *NotParkedError) Is(target error) bool { return target == ErrNotParked }

// CheckUnpark validates req for Unpark, or returns a *SelectionError that
// names the field by its outboxctl flag.
func CheckUnpark(req UnparkRequest) error {
	if err := checkActor(req.Actor); err != nil {
		return err
	}
	if req.Key == "" || len(req.Key) > outbox.MaxOrderingKeyBytes || strings.ContainsRune(req.Key, 0) {
		return &SelectionError{Flag: "key", Msg: fmt.Sprintf("the ordering key is required: 1 to %d bytes without NUL characters", outbox.MaxOrderingKeyBytes)}
	}
	if len(req.Tenant) > outbox.MaxTenantIDBytes || strings.ContainsRune(req.Tenant, 0) {
		return &SelectionError{Flag: "tenant", Msg: fmt.Sprintf("must be at most %d bytes without NUL characters", outbox.MaxTenantIDBytes)}
	}
	if len(req.Queue) > 64 || strings.ContainsRune(req.Queue, 0) {
		return &SelectionError{Flag: "queue", Msg: "must be a River queue name (at most 64 bytes)"}
	}
	if len(req.Reason) > MaxReasonBytes || strings.ContainsRune(req.Reason, 0) {
		return &SelectionError{Flag: "reason", Msg: fmt.Sprintf("must be at most %d bytes without NUL characters", MaxReasonBytes)}
	}
	if req.Action != UnparkRetry && req.Action != UnparkSkip {
		return &SelectionError{Msg: fmt.Sprintf("action must be retry (--retry: run the parked head job again) or skip (--skip: leave it and release the next job of the key), got %q", req.Action)}
	}
	return nil
}

// unparkSQL calls outbox_unpark (migration 011): it locks the parked rows
// of the key, retries or skips each head, and writes one audit row, in one
// transaction; a dry run locks and reports the same rows and changes and
// records nothing.
const unparkSQL = `
SELECT o_queue, o_head_job_id, o_head_event_id, o_parked_state, o_waiting, o_audit_id
FROM outbox_unpark(actor => $1, dry_run => $2, ordering_key => $3, action => $4, tenant_id => $5, queue => $6, reason => $7)`

// missingHeadsSQL lists which of the given head jobs river_job no longer
// has: a dry run of a retry refuses them as the real run would.
const missingHeadsSQL = `
SELECT h FROM unnest($1::bigint[]) AS h WHERE NOT EXISTS (SELECT 1 FROM river_job r WHERE r.id = h) ORDER BY h`

// keyRowsSQL reads every queue's row of one key, for NotParkedError.
const keyRowsSQL = `
SELECT k.queue, k.head_job_id, r.state::text, k.parked_at IS NOT NULL
FROM outbox_ordering_key k LEFT JOIN river_job r ON r.id = k.head_job_id
WHERE k.tenant_id = $1 AND k.ordering_key = $2
ORDER BY k.queue`

// firstFailedSQL finds the failed event that holds a key in the outbox.
const firstFailedSQL = `
SELECT e.id FROM outbox_event e
WHERE coalesce(e.tenant_id, '') = $1 AND e.ordering_key = $2 AND e.status = 'failed'
ORDER BY e.ordering_position LIMIT 1`

// Unpark lets a parked ordering key go on: UnparkRetry runs its head job
// again, UnparkSkip leaves it and releases the next waiting job. It
// changes only parked keys, and writes one audit row in the same
// transaction; a dry run changes and records nothing. It returns a
// *SelectionError for a request refused (by CheckUnpark, or because a
// deleted head cannot be retried), and a *NotParkedError (ErrNotParked)
// when the key is not parked, saying what holds it instead: a key held in
// the outbox by a failed event is let go by requeueing or cancelling that
// event.
func (c *Client) Unpark(ctx context.Context, req UnparkRequest) (*UnparkResult, error) {
	if err := CheckUnpark(req); err != nil {
		return nil, err
	}
	res := &UnparkResult{Request: req, Keys: []UnparkedKey{}}
	// At READ COMMITTED whatever the session's default: a skip whose
	// release finds the key's line empty waits for the handoffs that hold
	// the key's row and looks again for the jobs they queued, which only a
	// READ COMMITTED statement sees (docs/ordering.md, "Limits").
	err := pgx.BeginTxFunc(ctx, c.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, unparkSQL, req.Actor, req.DryRun, req.Key, req.Action,
			nullIfEmpty(req.Tenant), nullIfEmpty(req.Queue), nullIfEmpty(req.Reason))
		if err != nil {
			return err
		}
		var auditID *int64
		for rows.Next() {
			var k UnparkedKey
			if err := rows.Scan(&k.Queue, &k.HeadJobID, &k.HeadEventID, &k.ParkedState, &k.Waiting, &auditID); err != nil {
				rows.Close()
				return err
			}
			res.Keys = append(res.Keys, k)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		if auditID != nil {
			res.AuditID = *auditID
		}
		if len(res.Keys) == 0 {
			return c.notParked(ctx, tx, req)
		}
		if req.DryRun && req.Action == UnparkRetry {
			heads := make([]int64, len(res.Keys))
			for i, k := range res.Keys {
				heads[i] = k.HeadJobID
			}
			var missing []int64
			rows, err := tx.Query(ctx, missingHeadsSQL, heads)
			if err != nil {
				return err
			}
			if missing, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
				return err
			}
			if len(missing) > 0 {
				return &SelectionError{Flag: "retry", Msg: fmt.Sprintf("the head job %d of key %q no longer exists (River's cleaner deletes old discarded jobs) and cannot be retried: skip it (--skip), and requeue its event (--allow-replay) if it must still run", missing[0], req.Key)}
			}
		}
		return nil
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "22023" && strings.HasPrefix(pgErr.Message, "outbox_unpark: ") {
			msg := strings.TrimPrefix(pgErr.Message, "outbox_unpark: ")
			if pgErr.Hint != "" {
				msg += ": " + pgErr.Hint
			}
			return nil, &SelectionError{Flag: req.Action, Msg: msg}
		}
		var se *SelectionError
		var np *NotParkedError
		if errors.As(err, &se) || errors.As(err, &np) {
			return nil, err
		}
		return nil, c.explain(ctx, fmt.Errorf("unpark (has `outboxctl migrate` run?): %w", err))
	}
	return res, nil
}

// notParked finds out why a key has nothing parked and returns a
// *NotParkedError that says so.
func (c *Client) notParked(ctx context.Context, tx pgx.Tx, req UnparkRequest) error {
	np := &NotParkedError{Key: req.Key, Tenant: req.Tenant, Queue: req.Queue}
	if err := tx.QueryRow(ctx, firstFailedSQL, req.Tenant, req.Key).Scan(&np.HeldByEvent); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return err
	}
	if np.HeldByEvent != 0 {
		np.Why = fmt.Sprintf("it is held in the outbox by event %d, which failed (dead-lettered), and its later events wait behind it there: requeue that event (outboxctl requeue --id %d) or cancel it (outboxctl cancel --id %d)", np.HeldByEvent, np.HeldByEvent, np.HeldByEvent)
		return np
	}
	rows, err := tx.Query(ctx, keyRowsSQL, req.Tenant, req.Key)
	if err != nil {
		return err
	}
	var parts []string
	var parkedElsewhere []string
	for rows.Next() {
		var (
			queue  string
			head   int64
			state  *string
			parked bool
		)
		if err := rows.Scan(&queue, &head, &state, &parked); err != nil {
			rows.Close()
			return err
		}
		switch {
		case parked:
			parkedElsewhere = append(parkedElsewhere, queue)
		case state == nil:
			parts = append(parts, fmt.Sprintf("in queue %q its head job %d no longer exists but the key was never parked (the job was deleted before it finished), so its later jobs wait; unpark cannot release such a key", queue, head))
		default:
			parts = append(parts, fmt.Sprintf("in queue %q its head job %d is %s (a job that is retrying holds its key)", queue, head, *state))
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	switch {
	case len(parkedElsewhere) > 0:
		np.Why = fmt.Sprintf("it is parked in queue %s: name that queue (--queue) or leave --queue out", strings.Join(quoteAll(parkedElsewhere), ", "))
	case len(parts) > 0:
		np.Why = strings.Join(parts, "; ")
	default:
		np.Why = "no unfinished job and no failed event has this key (keys are scoped per tenant: check --tenant)"
	}
	return np
}

func quoteAll(s []string) []string {
	q := make([]string, len(s))
	for i, v := range s {
		q[i] = fmt.Sprintf("%q", v)
	}
	return q
}

// nullIfEmpty is nil for "" (SQL NULL), else s.
func nullIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}
