package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/route"
)

// ExplainOpts are the options of Explain.
type ExplainOpts struct {
	// Routes, when set, are matched against the event's type now
	// (Explanation.Routes); nil leaves Explanation.Routes nil.
	Routes *route.Table
	// RoutesFile names where Routes came from, reported in RouteMatch.File.
	RoutesFile string
	// JobRetention is the shortest time River's cleaner keeps a finalized
	// job (the least of the workers' CompletedJobRetentionPeriod,
	// CancelledJobRetentionPeriod and DiscardedJobRetentionPeriod); it tells
	// a job deleted early from one the cleaner may have removed
	// (JobDetail.Missing). 0 means River's default, DefaultJobRetention.
	JobRetention time.Duration
}

// DefaultJobRetention is River's shortest default retention of a finalized
// job: completed and cancelled jobs are kept 24 h (discarded ones 7 days).
const DefaultJobRetention = 24 * time.Hour

// Why a recorded River job is missing from river_job (JobDetail.Missing).
// No record says who deleted a job, so these name the evidence, not a
// certainty.
const (
	// MissingAfterCompletion: a receipt of the receiver says the job
	// completed; the row was deleted afterwards (the cleaner, or by hand).
	MissingAfterCompletion = "deleted_after_completion"
	// MissingBeforeRetention: the event was handed off less than the
	// retention ago, so River's cleaner cannot have removed the job yet, and
	// no receipt says it completed: it was deleted by hand (River UI, SQL)
	// and may never have run.
	MissingBeforeRetention = "deleted_before_retention"
	// MissingAfterRetention: the handoff is older than the retention and no
	// receipt says the job completed: most likely River's cleaner removed
	// it after it finished, but a deletion by hand cannot be ruled out.
	MissingAfterRetention = "missing_after_retention"
)

// Explanation is what happened to one event: its row, the routes it matches
// now, its River jobs and its receivers' receipts.
type Explanation struct {
	Event EventDetail `json:"event"`
	// Routes is nil when no routes were given.
	Routes *RouteMatch `json:"routes"`
	// Jobs are the River jobs the handoff recorded, in the recorded order.
	Jobs []JobDetail `json:"jobs"`
	// Receipts are the receivers' outbox_receipt rows, by receiver.
	Receipts []Receipt `json:"receipts"`
	// Ordering is what the event waits for in its key's order; nil for an
	// event without an ordering key.
	Ordering *OrderingDetail `json:"ordering"`
	// AsOf is the database's clock when the event was read.
	AsOf time.Time `json:"as_of"`
}

// EventDetail is one outbox_event row.
type EventDetail struct {
	ID          int64     `json:"id"`
	Type        string    `json:"event_type"`
	TenantID    *string   `json:"tenant_id"`
	DispatchKey *string   `json:"dispatch_key"`
	Status      string    `json:"status"`
	Retries     int       `json:"retries"`
	LastError   *string   `json:"last_error"`
	CreatedAt   time.Time `json:"created_at"`
	ScheduledAt time.Time `json:"scheduled_at"`
	// HeldFrom is the event's own due time when the dispatcher moved
	// ScheduledAt to wait for an earlier event of its ordering key
	// (migration 021, docs/ordering.md "Held in the outbox"); nil when it
	// was never moved, was put back, is due again, or is no longer pending.
	HeldFrom    *time.Time `json:"held_from,omitempty"`
	LockedUntil *time.Time `json:"locked_until"`
	ProcessedAt *time.Time `json:"processed_at"`
	// OrderingKey and OrderingPosition are nil for an event without an
	// ordering key; the position orders the events of one (tenant, key).
	OrderingKey      *string `json:"ordering_key"`
	OrderingPosition *int64  `json:"ordering_position"`
	// RiverJobIDs are the jobs the handoff inserted (empty before the
	// handoff, and for events handed off before ids were recorded).
	RiverJobIDs []int64 `json:"river_job_ids"`
	// Payload is the stored JSON, as the database prints it; it is nil
	// (and PayloadText holds it) when the payload cannot be embedded in a
	// JSON document (nested deeper than encoding/json accepts).
	Payload     json.RawMessage `json:"payload"`
	PayloadText *string         `json:"payload_text,omitempty"`
}

// RouteMatch is what the routes say about the event now (the routes at
// handoff time may have been different).
type RouteMatch struct {
	File    string   `json:"file"`
	Matched bool     `json:"matched"`
	Prefix  string   `json:"prefix,omitempty"`
	Queues  []string `json:"queues"`
}

// JobDetail is one River job of the event.
type JobDetail struct {
	ID int64 `json:"id"`
	// Found is false when the job is no longer in river_job (River's
	// cleaner removes finalized jobs after their retention period, 24 h by
	// default, and an operator may delete one by hand); the fields below
	// are then empty but for Missing and MissingNote.
	Found bool `json:"found"`
	// Missing, for a job not found, is what the evidence says about it:
	// MissingAfterCompletion, MissingBeforeRetention or
	// MissingAfterRetention; MissingNote says it in a sentence.
	Missing     string     `json:"missing,omitempty"`
	MissingNote string     `json:"missing_note,omitempty"`
	Queue       string     `json:"queue,omitempty"`
	State       string     `json:"state,omitempty"`
	Attempt     int        `json:"attempt"`
	MaxAttempts int        `json:"max_attempts"`
	AttemptedBy []string   `json:"attempted_by"`
	Errors      []JobError `json:"errors"`
	CreatedAt   *time.Time `json:"created_at,omitempty"`
	ScheduledAt *time.Time `json:"scheduled_at,omitempty"`
	AttemptedAt *time.Time `json:"attempted_at,omitempty"`
	FinalizedAt *time.Time `json:"finalized_at,omitempty"`
	// InLine is true for an ordered job that waits in its key's line
	// (outbox_ordering_wait) and is not in river_job yet: its State reads
	// pending, and River inserts it, with this id, when its turn comes
	// (docs/ordering.md, "How it works").
	InLine bool `json:"in_line,omitempty"`
}

// JobError is one failed attempt of a River job.
type JobError struct {
	Attempt int       `json:"attempt"`
	At      time.Time `json:"at"`
	Error   string    `json:"error"`
}

// Receipt is one receiver's outbox_receipt row for the event.
type Receipt struct {
	Receiver    string     `json:"receiver"`
	State       string     `json:"state"`
	JobID       *int64     `json:"job_id"`
	Attempt     *int       `json:"attempt"`
	CreatedAt   time.Time  `json:"created_at"`
	CompletedAt *time.Time `json:"completed_at"`
	ExpiresAt   time.Time  `json:"expires_at"`
	// Result is the receiver's stored result; text that is not valid JSON
	// is given as a JSON string.
	Result json.RawMessage `json:"result,omitempty"`
}

// explainEventSQL reads held_from through to_jsonb, so that it reads a
// schema before migration 021 too (as NULL), and only while the event is
// held: pending and not due yet, as the held count of the backlog metrics
// has it (a hold that ran out leaves held_from until the event's next
// write).
const explainEventSQL = `
SELECT id, event_type, tenant_id, dispatch_key, status::text, retries, last_error,
       created_at, scheduled_at, locked_until, processed_at, coalesce(river_job_ids, '{}'), payload::text, now(),
       ordering_key, ordering_position,
       CASE WHEN status = 'pending' AND scheduled_at > now() THEN (to_jsonb(e) ->> 'held_from')::timestamptz END
FROM outbox_event e WHERE id = $1`

// explainJobsSQL reads the jobs by primary key: the handoff recorded their
// ids in outbox_event.river_job_ids, so nothing scans river_job by args.
// An ordered job that waits in its key's line is not in river_job yet
// (migration 024): it is read from outbox_ordering_wait, by the event's key
// ($2 tenant, $3 key: the line's primary key), as pending and in_line. The
// line's job columns are read through to_jsonb (once per row, c), so
// that a schema before 024, whose line has none of them, reads no row.
const explainJobsSQL = `
SELECT id, queue, state::text, attempt, max_attempts, coalesce(attempted_by, '{}'),
       coalesce(to_jsonb(errors), '[]'), created_at, scheduled_at, attempted_at, finalized_at, false
FROM river_job WHERE id = ANY($1::bigint[])
UNION ALL
SELECT w.job_id, w.queue, 'pending', 0, (c ->> 'max_attempts')::int, '{}', '[]',
       (c ->> 'created_at')::timestamptz, NULL, NULL, NULL, true
FROM outbox_ordering_wait w CROSS JOIN LATERAL to_jsonb(w) AS c
WHERE $3::text IS NOT NULL AND w.tenant_id = coalesce($2, '') AND w.ordering_key = $3 AND w.job_id = ANY($1::bigint[])
  AND c ->> 'kind' IS NOT NULL`

const explainReceiptsSQL = `
SELECT receiver, state, job_id, attempt, created_at, completed_at, expires_at, result::text
FROM outbox_receipt WHERE event_id = $1 ORDER BY receiver`

// Explain reads one event, its River jobs (by the ids the handoff
// recorded) and its receipts, and matches opts.Routes against its type. It
// returns ErrNotFound when no row has the id.
func (c *Client) Explain(ctx context.Context, id int64, opts ExplainOpts) (*Explanation, error) {
	res, err := c.explainEvent(ctx, id)
	if err != nil {
		return nil, c.explain(ctx, err)
	}
	if opts.Routes != nil {
		r := &RouteMatch{File: opts.RoutesFile, Queues: []string{}}
		if rule, ok := opts.Routes.Match(res.Event.Type); ok {
			r.Matched, r.Prefix, r.Queues = true, rule.Prefix, rule.Queues
		}
		res.Routes = r
	}
	retention := opts.JobRetention
	if retention <= 0 {
		retention = DefaultJobRetention
	}
	res.judgeMissing(retention)
	return res, nil
}

// judgeMissing fills in Missing and MissingNote of the jobs not found.
// River's cleaner deletes a job only once it has been finalized for longer
// than the retention, and a job is finalized after it was inserted, that is
// after the handoff (processed_at): a job missing sooner than that after the
// handoff was not removed by the cleaner. A receipt of the job that
// completed shows that it ran, whoever deleted it.
func (res *Explanation) judgeMissing(retention time.Duration) {
	completed := map[int64]bool{}
	for _, r := range res.Receipts {
		if r.JobID != nil && r.State == "done" {
			completed[*r.JobID] = true
		}
	}
	handedOff := res.Event.ProcessedAt
	for i := range res.Jobs {
		j := &res.Jobs[i]
		if j.Found {
			continue
		}
		switch {
		case completed[j.ID]:
			j.Missing = MissingAfterCompletion
			j.MissingNote = "not in river_job; a receipt of its receiver says it completed (state done), so it ran and was deleted afterwards (by River's cleaner or by hand)"
		case handedOff != nil && res.AsOf.Sub(*handedOff) < retention:
			j.Missing = MissingBeforeRetention
			j.MissingNote = fmt.Sprintf("not in river_job, handed off %s ago, sooner than River keeps finalized jobs (%s), and no receipt says it completed: it was deleted by hand (River UI or SQL) and may never have run; check the receiver, and requeue the event with --allow-replay if its work is lost",
				res.AsOf.Sub(*handedOff).Round(time.Second), retention)
		default:
			j.Missing = MissingAfterRetention
			j.MissingNote = fmt.Sprintf("not in river_job, handed off more than %s ago: most likely River's cleaner removed it after it finished (no record tells this from a deletion by hand)", retention)
		}
	}
}

func (c *Client) explainEvent(ctx context.Context, id int64) (*Explanation, error) {
	res := &Explanation{Jobs: []JobDetail{}, Receipts: []Receipt{}}
	e := &res.Event
	var payload string
	err := c.pool.QueryRow(ctx, explainEventSQL, id).Scan(&e.ID, &e.Type, &e.TenantID, &e.DispatchKey, &e.Status, &e.Retries, &e.LastError,
		&e.CreatedAt, &e.ScheduledAt, &e.LockedUntil, &e.ProcessedAt, &e.RiverJobIDs, &payload, &res.AsOf,
		&e.OrderingKey, &e.OrderingPosition, &e.HeldFrom)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, &notFoundError{id: id}
	}
	if err != nil {
		return nil, fmt.Errorf("read event %d: %w", id, err)
	}
	// The payload is read as text, never decoded (a row nested deeper than
	// encoding/json accepts must still be explained); it is embedded when
	// encoding/json can carry it, else given as text.
	if raw := json.RawMessage(payload); json.Valid(raw) {
		e.Payload = raw
	} else {
		e.PayloadText = &payload
	}

	found := map[int64]JobDetail{}
	if len(e.RiverJobIDs) > 0 {
		rows, err := c.pool.Query(ctx, explainJobsSQL, e.RiverJobIDs, e.TenantID, e.OrderingKey)
		if err != nil {
			return nil, fmt.Errorf("read River jobs %v: %w", e.RiverJobIDs, err)
		}
		for rows.Next() {
			var (
				j       = JobDetail{Found: true}
				rawErrs []byte
			)
			if err := rows.Scan(&j.ID, &j.Queue, &j.State, &j.Attempt, &j.MaxAttempts, &j.AttemptedBy, &rawErrs,
				&j.CreatedAt, &j.ScheduledAt, &j.AttemptedAt, &j.FinalizedAt, &j.InLine); err != nil {
				rows.Close()
				return nil, fmt.Errorf("read River jobs: %w", err)
			}
			j.Errors = []JobError{}
			if err := json.Unmarshal(rawErrs, &j.Errors); err != nil {
				rows.Close()
				return nil, fmt.Errorf("read errors of River job %d: %w", j.ID, err)
			}
			found[j.ID] = j
		}
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("read River jobs: %w", err)
		}
	}
	for _, jid := range e.RiverJobIDs {
		j, ok := found[jid]
		if !ok {
			j = JobDetail{ID: jid, AttemptedBy: []string{}, Errors: []JobError{}}
		}
		res.Jobs = append(res.Jobs, j)
	}

	rows, err := c.pool.Query(ctx, explainReceiptsSQL, id)
	if err != nil {
		return nil, fmt.Errorf("read receipts of event %d: %w", id, err)
	}
	for rows.Next() {
		var r Receipt
		var result *string
		if err := rows.Scan(&r.Receiver, &r.State, &r.JobID, &r.Attempt, &r.CreatedAt, &r.CompletedAt, &r.ExpiresAt, &result); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read receipts: %w", err)
		}
		if result != nil {
			r.Result = embedJSON(*result)
		}
		res.Receipts = append(res.Receipts, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read receipts: %w", err)
	}
	if e.OrderingKey != nil && e.OrderingPosition != nil {
		if res.Ordering, err = c.explainOrdering(ctx, e, res.Jobs); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// embedJSON returns text as JSON to embed in a document: as it is when
// encoding/json accepts it, else as a JSON string holding the text.
func embedJSON(text string) json.RawMessage {
	if raw := json.RawMessage(text); json.Valid(raw) {
		return raw
	}
	quoted, _ := json.Marshal(text)
	return quoted
}

// OrderingDetail is an event's place in the order of its (tenant, ordering
// key): what it waits for in the outbox, and, per River queue, where its
// job stands.
type OrderingDetail struct {
	Key      string `json:"ordering_key"`
	Position int64  `json:"position"`
	// EarlierUnfinished counts the earlier events of the key still pending,
	// processing or failed in the outbox: while there is one, this event is
	// not handed off. WaitsFor is the nearest of them and FirstFailed the
	// first failed one (a dead-lettered event holds its key until it is
	// requeued or cancelled); both nil when there is none.
	EarlierUnfinished int64     `json:"earlier_unfinished"`
	WaitsFor          *EventRef `json:"waits_for"`
	FirstFailed       *EventRef `json:"first_failed"`
	// Queues is, per River job of the event, its place in the key's order
	// in that queue.
	Queues []QueueOrder `json:"queues"`
}

// EventRef names one event of a key.
type EventRef struct {
	ID       int64  `json:"id"`
	Status   string `json:"status"`
	Position int64  `json:"position"`
}

// QueueOrder is where an event's job stands in its key's order in one
// queue.
type QueueOrder struct {
	Queue    string `json:"queue"`
	JobID    int64  `json:"job_id"`
	JobState string `json:"job_state"`
	// InLine is true when the job waits in the key's line, not in River
	// yet (JobDetail.InLine).
	InLine bool `json:"in_line,omitempty"`
	// IsHead is true when this job holds the key in the queue.
	IsHead bool `json:"is_head"`
	// HeadJobID, HeadEventID and HeadState name the key's head in the
	// queue (nil when the key has no unfinished job there); HeadState is ""
	// when the head job no longer exists.
	HeadJobID   *int64 `json:"head_job_id"`
	HeadEventID *int64 `json:"head_event_id"`
	HeadState   string `json:"head_state,omitempty"`
	// Parked is true when the key is parked in the queue (ParkedState:
	// discarded, cancelled or deleted, since ParkedAt).
	Parked      bool       `json:"parked"`
	ParkedState string     `json:"parked_state,omitempty"`
	ParkedAt    *time.Time `json:"parked_at,omitempty"`
	// Ahead counts the jobs of the key that wait before this one (behind
	// the head); Behind counts the key's waiting jobs in all.
	Ahead  int64 `json:"ahead"`
	Behind int64 `json:"waiting"`
	// Note says it in a sentence.
	Note string `json:"note"`
}

// explainOutboxOrderSQL reads the earlier unfinished events of the key:
// how many, the nearest one and the first failed one. The partial index
// outbox_event_ordering_idx serves it. $1 tenant, $2 key, $3 position.
const explainOutboxOrderSQL = `
SELECT count(*),
       (array_agg(id ORDER BY ordering_position DESC))[1], (array_agg(status::text ORDER BY ordering_position DESC))[1],
       max(ordering_position),
       (array_agg(id ORDER BY ordering_position) FILTER (WHERE status = 'failed'))[1],
       min(ordering_position) FILTER (WHERE status = 'failed')
FROM outbox_event
WHERE coalesce(tenant_id, '') = coalesce($1, '') AND ordering_key = $2 AND ordering_position < $3
  AND status IN ('pending', 'processing', 'failed')`

// explainRiverOrderSQL reads the key's head in each of the queues, and how
// many of its waiting jobs come before position $4. $1 tenant, $2 key, $3
// queues.
const explainRiverOrderSQL = `
SELECT k.queue, k.head_job_id, k.head_event_id, coalesce(r.state::text, ''), k.parked_at, coalesce(k.parked_state, ''),
       w.waiting, w.before
FROM outbox_ordering_key k LEFT JOIN river_job r ON r.id = k.head_job_id
CROSS JOIN LATERAL (
    SELECT count(*) AS waiting, count(*) FILTER (WHERE x.position < $4) AS before FROM outbox_ordering_wait x
    WHERE x.tenant_id = k.tenant_id AND x.ordering_key = k.ordering_key AND x.queue = k.queue) w
WHERE k.tenant_id = coalesce($1, '') AND k.ordering_key = $2 AND k.queue = ANY($3::text[])`

// explainOrdering reads where a keyed event stands in its key's order.
func (c *Client) explainOrdering(ctx context.Context, e *EventDetail, jobs []JobDetail) (*OrderingDetail, error) {
	o := &OrderingDetail{Key: *e.OrderingKey, Position: *e.OrderingPosition, Queues: []QueueOrder{}}
	var (
		nearID, failID   *int64
		nearStatus       *string
		nearPos, failPos *int64
	)
	if err := c.pool.QueryRow(ctx, explainOutboxOrderSQL, e.TenantID, o.Key, o.Position).Scan(
		&o.EarlierUnfinished, &nearID, &nearStatus, &nearPos, &failID, &failPos); err != nil {
		return nil, fmt.Errorf("read the order of event %d's key: %w", e.ID, err)
	}
	if nearID != nil {
		o.WaitsFor = &EventRef{ID: *nearID, Status: *nearStatus, Position: *nearPos}
	}
	if failID != nil {
		o.FirstFailed = &EventRef{ID: *failID, Status: "failed", Position: *failPos}
	}

	var queues []string
	for _, j := range jobs {
		if j.Found {
			queues = append(queues, j.Queue)
		}
	}
	if len(queues) == 0 {
		return o, nil
	}
	type keyRow struct {
		head, headEvent *int64
		headState       string
		parkedAt        *time.Time
		parkedState     string
		waiting, ahead  int64
	}
	byQueue := map[string]keyRow{}
	rows, err := c.pool.Query(ctx, explainRiverOrderSQL, e.TenantID, o.Key, queues, o.Position)
	if err != nil {
		return nil, fmt.Errorf("read the ordering keys of event %d: %w", e.ID, err)
	}
	for rows.Next() {
		var q string
		var k keyRow
		if err := rows.Scan(&q, &k.head, &k.headEvent, &k.headState, &k.parkedAt, &k.parkedState, &k.waiting, &k.ahead); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read the ordering keys: %w", err)
		}
		byQueue[q] = k
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the ordering keys: %w", err)
	}
	for _, j := range jobs {
		if !j.Found {
			continue
		}
		q := QueueOrder{Queue: j.Queue, JobID: j.ID, JobState: j.State, InLine: j.InLine}
		k, ok := byQueue[j.Queue]
		if ok {
			q.HeadJobID, q.HeadEventID, q.HeadState = k.head, k.headEvent, k.headState
			q.Parked, q.ParkedState, q.ParkedAt, q.Behind = k.parkedAt != nil, k.parkedState, k.parkedAt, k.waiting
			q.IsHead = *k.head == j.ID
		}
		q.Note = queueNote(q, ok, k.ahead)
		if j.State == "pending" && ok && !q.IsHead {
			q.Ahead = k.ahead
		}
		o.Queues = append(o.Queues, q)
	}
	return o, nil
}

// queueNote says where a job stands in its key's order, in a sentence.
func queueNote(q QueueOrder, keyed bool, ahead int64) string {
	parked := ""
	if q.Parked {
		parked = fmt.Sprintf("; the key is parked (head %s since %s): unpark it to go on (outboxctl unpark --retry or --skip)",
			q.ParkedState, q.ParkedAt.UTC().Format(time.RFC3339))
	}
	switch {
	case q.IsHead:
		return fmt.Sprintf("this job is the head of its key: the key's %d later job(s) wait for it to finish%s", q.Behind, parked)
	case q.JobState == "pending" && keyed:
		head := "head job " + fmt.Sprint(*q.HeadJobID)
		if q.HeadEventID != nil {
			head += fmt.Sprintf(" (event %d)", *q.HeadEventID)
		}
		state := q.HeadState
		if state == "" {
			state = "no longer in river_job"
		}
		line := ""
		if q.InLine {
			line = " (in the key's line, not in River yet: River inserts it when its turn comes)"
		}
		return fmt.Sprintf("waits behind %s, which is %s, with %d other job(s) of the key ahead of it%s%s", head, state, ahead, line, parked)
	case q.JobState == "pending":
		return "pending, but its key has no unfinished job in this queue: nothing will release it (report this)"
	case !keyed || q.JobState == "completed":
		return "its turn is over: no job of its key waits for it in this queue"
	default:
		return "its turn is over"
	}
}
