package admin

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Limits of AuditList.
const (
	// DefaultAuditLimit is AuditOpts.Limit when it is 0.
	DefaultAuditLimit = 50
	// MaxAuditLimit is the largest AuditOpts.Limit.
	MaxAuditLimit = 10000
)

// AuditOpts select the audit rows AuditList returns.
type AuditOpts struct {
	// Limit is the most rows returned, 1..MaxAuditLimit; 0 means
	// DefaultAuditLimit.
	Limit int
	// Action, when set, keeps only this action (requeue, cancel,
	// retention).
	Action string
	// Since, when set, keeps only actions at or after it.
	Since *time.Time
	// EventID, when set, keeps only the actions that name this event: in
	// their selection by id, or among the changed ids they list (the first
	// 100 of an action; a larger change by filter may not name it).
	EventID int64
}

// AuditEntry is one recorded operator action (an outbox_audit row).
type AuditEntry struct {
	ID int64     `json:"id"`
	At time.Time `json:"at"`
	// Actor is who ran it, as they named themselves; DBUser is the
	// database role that ran it (session_user), which they cannot choose.
	Actor  string `json:"actor"`
	DBUser string `json:"db_user"`
	Action string `json:"action"`
	// Filter is the selection (or the retention settings) as stored;
	// Detail holds what the action reported (skipped, from, ids, host, …).
	// Each is the stored JSON as the database prints it, or a JSON string
	// holding it when encoding/json cannot carry it.
	Filter   json.RawMessage `json:"filter"`
	Affected int64           `json:"affected"`
	Detail   json.RawMessage `json:"detail"`
}

const auditListSQL = `
SELECT id, at, actor, db_user, action, filter::text, affected, detail::text
FROM outbox_audit
WHERE ($1::text IS NULL OR action = $1::text)
  AND ($2::timestamptz IS NULL OR at >= $2::timestamptz)
  AND ($4::bigint IS NULL OR filter->'ids' @> to_jsonb($4::bigint) OR detail->'ids' @> to_jsonb($4::bigint))
ORDER BY at DESC, id DESC
LIMIT $3`

// CheckAudit validates opts for AuditList and returns them with the
// defaults filled in, or a *SelectionError.
func CheckAudit(opts AuditOpts) (AuditOpts, error) {
	if opts.Limit == 0 {
		opts.Limit = DefaultAuditLimit
	}
	if opts.Limit < 1 || opts.Limit > MaxAuditLimit {
		return opts, &SelectionError{Flag: "limit", Msg: fmt.Sprintf("%d is out of range: use 1 to %d", opts.Limit, MaxAuditLimit)}
	}
	return opts, nil
}

// AuditList returns the recorded operator actions, newest first. It never
// returns a nil slice without an error.
func (c *Client) AuditList(ctx context.Context, opts AuditOpts) ([]AuditEntry, error) {
	opts, err := CheckAudit(opts)
	if err != nil {
		return nil, err
	}
	var action *string
	if opts.Action != "" {
		action = &opts.Action
	}
	var eventID *int64
	if opts.EventID != 0 {
		eventID = &opts.EventID
	}
	rows, err := c.pool.Query(ctx, auditListSQL, action, opts.Since, opts.Limit, eventID)
	if err != nil {
		return nil, c.explain(ctx, fmt.Errorf("read outbox_audit (has `outboxctl migrate` run?): %w", err))
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (AuditEntry, error) {
		// filter and detail are read as text and embedded only when
		// encoding/json accepts them (see embedJSON).
		var a AuditEntry
		var filterText, detailText string
		err := r.Scan(&a.ID, &a.At, &a.Actor, &a.DBUser, &a.Action, &filterText, &a.Affected, &detailText)
		a.Filter, a.Detail = embedJSON(filterText), embedJSON(detailText)
		return a, err
	})
	if err != nil {
		return nil, c.explain(ctx, fmt.Errorf("read outbox_audit: %w", err))
	}
	if list == nil {
		list = []AuditEntry{}
	}
	return list, nil
}
