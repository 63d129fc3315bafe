package admin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/filter"
	outboxriver "github.com/outboxhq/outbox/river"
)

// Limits of ListEvents.
const (
	// DefaultEventListLimit is EventListOpts.Limit when it is 0.
	DefaultEventListLimit = 50
	// MaxEventListLimit is the largest EventListOpts.Limit.
	MaxEventListLimit = 1000
)

// EventListOpts select the events ListEvents returns, newest (highest id)
// first. Every field that is set narrows the list.
type EventListOpts struct {
	// Statuses keeps these statuses; empty means all.
	Statuses []string
	// TypePrefix keeps event types starting with this ("mail.").
	TypePrefix string
	// Tenant keeps this tenant id, exactly.
	Tenant string
	// Since and Until bound created_at: at or after Since, before Until.
	Since, Until *time.Time
	// Before is the keyset cursor: only events with a smaller id (the
	// previous page's EventPage.Next). 0 starts at the newest event.
	Before int64
	// Limit is the page size, 1..MaxEventListLimit; 0 means
	// DefaultEventListLimit.
	Limit int
}

// EventSummary is one row of the event list (no payload).
type EventSummary struct {
	ID          int64      `json:"id"`
	Type        string     `json:"event_type"`
	TenantID    *string    `json:"tenant_id"`
	Status      string     `json:"status"`
	Retries     int        `json:"retries"`
	LastError   *string    `json:"last_error"`
	CreatedAt   time.Time  `json:"created_at"`
	ScheduledAt time.Time  `json:"scheduled_at"`
	ProcessedAt *time.Time `json:"processed_at"`
}

// EventPage is one page of ListEvents.
type EventPage struct {
	Events []EventSummary `json:"events"`
	// Next is the cursor of the next (older) page, for
	// EventListOpts.Before; 0 when this page is the last.
	Next int64 `json:"next"`
}

// eventListSQL pages through outbox_event by id, newest first: the keyset
// (id < $1) plus ORDER BY id DESC LIMIT walks the primary key backwards and
// stops after one page, whatever the table's size, without an OFFSET. The
// filters are the selection's predicate (filter.Predicate: ids unused) plus
// the status list. A filter that matches few rows makes the walk longer (it
// reads the newer non-matching rows to find a page); failed and cancelled
// events are found through outbox_event_dead_idx instead when the planner
// sees that cheaper. $1 cursor, $2 statuses, $3..$8 filter.Predicate's
// arguments shifted by two, $9 limit.
//
// It runs in QueryExecModeExec (an unnamed statement, planned with the
// actual values each time), so an unset filter ($n IS NULL) is folded away
// instead of being kept in a generic plan cached on the connection.
const eventListSQL = `
SELECT id, event_type, tenant_id, status::text, retries, last_error, created_at, scheduled_at, processed_at
FROM outbox_event
WHERE ($1::bigint IS NULL OR id < $1::bigint)
  AND ($2::outbox_status[] IS NULL OR status = ANY($2::outbox_status[]))
  AND ($3::bigint[] IS NULL OR id = ANY($3::bigint[]))
  AND ($4::text IS NULL OR starts_with(event_type, $4::text))
  AND ($5::text IS NULL OR tenant_id = $5::text)
  AND ($6::timestamptz IS NULL OR created_at >= $6::timestamptz)
  AND ($7::timestamptz IS NULL OR created_at < $7::timestamptz)
  AND ($8::text IS NULL OR strpos(last_error, $8::text) > 0)
ORDER BY id DESC
LIMIT $9`

// CheckEventList validates opts and returns them with the defaults filled
// in, or a *SelectionError that names the field.
func CheckEventList(opts EventListOpts) (EventListOpts, error) {
	if opts.Limit == 0 {
		opts.Limit = DefaultEventListLimit
	}
	if opts.Limit < 1 || opts.Limit > MaxEventListLimit {
		return opts, &SelectionError{Flag: "limit", Msg: fmt.Sprintf("%d is out of range: use 1 to %d", opts.Limit, MaxEventListLimit)}
	}
	if opts.Before < 0 {
		return opts, &SelectionError{Flag: "before", Msg: "must be a positive event id"}
	}
	for _, st := range opts.Statuses {
		if !slices.Contains(filter.Statuses, st) {
			return opts, &SelectionError{Flag: "status", Msg: fmt.Sprintf("%q is not a status; use one or more of %s", st, strings.Join(filter.Statuses, ", "))}
		}
	}
	for flag, v := range map[string]string{"type-prefix": opts.TypePrefix, "tenant": opts.Tenant} {
		if v == "" {
			continue
		}
		if err := checkText(flag, v); err != nil {
			return opts, err
		}
	}
	return opts, nil
}

// ListEvents returns one page of events, newest first, and the cursor of
// the next page. It never returns a nil slice without an error.
func (c *Client) ListEvents(ctx context.Context, opts EventListOpts) (*EventPage, error) {
	opts, err := CheckEventList(opts)
	if err != nil {
		return nil, err
	}
	var before *int64
	if opts.Before > 0 {
		before = &opts.Before
	}
	var statuses []string // nil encodes as NULL
	if len(opts.Statuses) > 0 {
		statuses = opts.Statuses
	}
	f := filter.Filter{TypePrefix: opts.TypePrefix, Tenant: opts.Tenant, Since: opts.Since, Until: opts.Until}
	args := append([]any{pgx.QueryExecModeExec, before, statuses}, f.Args()...)
	// One more row than the page tells whether another page follows.
	args = append(args, opts.Limit+1)
	rows, err := c.pool.Query(ctx, eventListSQL, args...)
	if err != nil {
		return nil, c.explain(ctx, fmt.Errorf("list events (has `outboxctl migrate` run?): %w", err))
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (EventSummary, error) {
		var e EventSummary
		err := r.Scan(&e.ID, &e.Type, &e.TenantID, &e.Status, &e.Retries, &e.LastError, &e.CreatedAt, &e.ScheduledAt, &e.ProcessedAt)
		return e, err
	})
	if err != nil {
		return nil, c.explain(ctx, fmt.Errorf("list events: %w", err))
	}
	page := &EventPage{Events: list}
	if page.Events == nil {
		page.Events = []EventSummary{}
	}
	if len(page.Events) > opts.Limit {
		page.Events = page.Events[:opts.Limit]
		page.Next = page.Events[opts.Limit-1].ID
	}
	return page, nil
}

// eventOfJobSQL finds the event a River job was handed off for: the job's
// outbox metadata (every handoff writes it), else the envelope args of a
// job from before the metadata existed. An ordered job that waits in its
// key's line is not in river_job yet (migration 024): its line row names
// its event. The line has no index on job_id (every handoff and release
// would pay for one): an id that is in neither table, a job River's
// cleaner removed, costs a scan of the line, which holds only waiting
// jobs; fine for an operator's request.
const eventOfJobSQL = `
SELECT coalesce((metadata->>'outbox_event_id')::bigint,
                CASE WHEN kind = $2 THEN (args->>'event_id')::bigint END)
FROM river_job WHERE id = $1
UNION ALL
SELECT w.event_id FROM outbox_ordering_wait w WHERE w.job_id = $1 AND NOT EXISTS (SELECT 1 FROM river_job r WHERE r.id = $1)
LIMIT 1`

// EventOfJob returns the id of the event a River job was handed off for. It
// returns an error wrapping ErrNotFound when no River job has the id, or
// when the job carries no outbox event.
func (c *Client) EventOfJob(ctx context.Context, jobID int64) (int64, error) {
	var id *int64
	err := c.pool.QueryRow(ctx, eventOfJobSQL, jobID, outboxriver.Kind).Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("job %d: no such job in River (River deletes finalized jobs after its retention period): %w", jobID, ErrNotFound)
	}
	if err != nil {
		return 0, c.explain(ctx, fmt.Errorf("read River job %d: %w", jobID, err))
	}
	if id == nil {
		return 0, fmt.Errorf("job %d of River carries no outbox event (neither metadata nor envelope args): %w", jobID, ErrNotFound)
	}
	return *id, nil
}

// checkText checks a free-text selection value (filter.CheckText: valid
// UTF-8, no NUL, bounded), as a *SelectionError naming flag.
func checkText(flag, v string) error {
	return asSelectionError(filter.CheckText(flag, v))
}

// asSelectionError returns a *filter.Error as the *SelectionError that
// names the same flag, and any other error (or nil) as it is.
func asSelectionError(err error) error {
	if fe, ok := errors.AsType[*filter.Error](err); ok {
		return &SelectionError{Flag: fe.Flag, Msg: fe.Msg}
	}
	return err
}
