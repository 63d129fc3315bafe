package admin

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/outboxhq/outbox/internal/filter"
	"github.com/outboxhq/outbox/internal/plural"
)

// Limits of a Selection.
const (
	// DefaultLimit is the most events one Requeue or Cancel changes when
	// Selection.Limit is 0.
	DefaultLimit = filter.DefaultLimit
	// MaxLimit is the largest Selection.Limit.
	MaxLimit = filter.MaxLimit
	// MaxIDs is the most ids one Selection may name.
	MaxIDs = filter.MaxIDs
)

// Selection picks the events that Requeue or Cancel change. Every field
// that is set narrows the selection; text is matched exactly (no
// wildcards). Its JSON form is the "filter" that outboxctl prints.
type Selection struct {
	// IDs are event ids. With ids, a missing id is reported in
	// ChangeResult.Skipped as "not_found".
	IDs []int64 `json:"ids,omitempty"`
	// Statuses to change; empty means the action's default (StatusRules).
	Statuses []string `json:"statuses,omitempty"`
	// TypePrefix: event types starting with this ("mail.").
	TypePrefix string `json:"type_prefix,omitempty"`
	// Tenant: this tenant id, exactly.
	Tenant string `json:"tenant,omitempty"`
	// Since and Until bound created_at: at or after Since, before Until.
	Since *time.Time `json:"since,omitempty"`
	Until *time.Time `json:"until,omitempty"`
	// ErrorContains: last_error contains this text (case-sensitive).
	ErrorContains string `json:"error_contains,omitempty"`
	// Limit is the most events changed by one call, 1..MaxLimit; 0 means
	// DefaultLimit. Events beyond it are counted in ChangeResult.Remaining.
	Limit int `json:"limit"`
	// All allows a selection by status alone ("every failed event"); without
	// it such a selection is refused.
	All bool `json:"all,omitempty"`
}

func (s Selection) filter() filter.Filter {
	return filter.Filter{IDs: slices.Clone(s.IDs), Statuses: slices.Clone(s.Statuses), TypePrefix: s.TypePrefix, Tenant: s.Tenant,
		Since: s.Since, Until: s.Until, ErrorContains: s.ErrorContains, Limit: s.Limit, All: s.All}
}

func fromFilter(f filter.Filter) Selection {
	return Selection{IDs: f.IDs, Statuses: f.Statuses, TypePrefix: f.TypePrefix, Tenant: f.Tenant,
		Since: f.Since, Until: f.Until, ErrorContains: f.ErrorContains, Limit: f.Limit, All: f.All}
}

// StatusRules say which statuses an action may select.
type StatusRules struct {
	// Eligible are the statuses the action changes. A processing event is
	// changed only when it is stuck: its locked_until is NULL or past (one a
	// dispatcher holds right now is skipped).
	Eligible []string
	// Default are the statuses selected when Selection.Statuses is empty
	// and Selection.IDs is not set.
	Default []string
	// DefaultByID are the statuses selected when Selection.Statuses is
	// empty and Selection.IDs is set.
	DefaultByID []string
}

// RequeueStatuses are the rules of Requeue: failed, cancelled and stuck
// processing events, and done events with allowReplay. The default is
// failed (failed, cancelled, processing and, with allowReplay, done for a
// selection by id).
func RequeueStatuses(allowReplay bool) StatusRules {
	r := requeueRules(allowReplay, false)
	return StatusRules{Eligible: r.Eligible, Default: r.Default, DefaultByID: requeueRules(allowReplay, true).Default}
}

// CancelStatuses are the rules of Cancel: pending, failed and stuck
// processing events. The default is pending and failed (and processing for
// a selection by id).
func CancelStatuses() StatusRules {
	r := cancelRules(false)
	return StatusRules{Eligible: r.Eligible, Default: r.Default, DefaultByID: cancelRules(true).Default}
}

func requeueRules(allowReplay, byID bool) filter.Rules {
	r := filter.Rules{
		Action:   "requeue",
		Eligible: []string{"failed", "cancelled", "processing"},
		Refused: map[string]string{
			"pending": "they are waiting for the dispatcher already",
			"done":    "they were handed to River already; replaying them delivers every event again, so add --allow-replay if every receiver is idempotent (dedupes on event_id)",
		},
		Default: []string{"failed"},
	}
	if byID {
		r.Default = []string{"failed", "cancelled", "processing"}
	}
	if allowReplay {
		delete(r.Refused, "done")
		r.Eligible = append(r.Eligible, "done")
		if byID {
			r.Default = append(r.Default, "done")
		}
	}
	return r
}

func cancelRules(byID bool) filter.Rules {
	r := filter.Rules{
		Action:   "cancel",
		Eligible: []string{"pending", "failed", "processing"},
		Refused: map[string]string{
			"done":      "they were handed to River already; cancel or discard the River job instead",
			"cancelled": "they are cancelled already",
		},
		Default: []string{"pending", "failed"},
	}
	if byID {
		r.Default = []string{"pending", "failed", "processing"}
	}
	return r
}

// RequeueOpts are the options of Requeue.
type RequeueOpts struct {
	// Actor is who runs it, recorded in the audit: 1 to 256 bytes, no NUL.
	// Required.
	Actor string
	// DryRun reports what would change and changes and records nothing.
	DryRun bool
	// AllowReplay allows requeueing done events: River gets a new job for
	// each, so every receiver sees them again (ChangeResult.Warning).
	AllowReplay bool
}

// CancelOpts are the options of Cancel.
type CancelOpts struct {
	// Actor is who runs it, recorded in the audit: 1 to 256 bytes, no NUL.
	// Required.
	Actor string
	// DryRun reports what would change and changes and records nothing.
	DryRun bool
}

// ChangeResult is what Requeue and Cancel report.
type ChangeResult struct {
	// Action is "requeue" or "cancel".
	Action string `json:"action"`
	DryRun bool   `json:"dry_run"`
	// Affected events were (for a dry run: would be) changed; IDs lists
	// them in id order.
	Affected int     `json:"affected"`
	IDs      []int64 `json:"ids"`
	// From counts the changed events by their status before the change.
	From map[string]int `json:"from"`
	// Skipped counts matched events left alone, by reason: a status the
	// action does not change, "locked" (a dispatcher held the row), or, for
	// a selection by id, "not_found".
	Skipped map[string]int `json:"skipped"`
	// Remaining eligible events matched the selection beyond its Limit (or
	// were locked); call again to continue.
	Remaining int `json:"remaining"`
	// Selection is the selection as run, defaults filled in.
	Selection Selection `json:"filter"`
	Actor     string    `json:"actor"`
	// AuditID is the outbox_audit row of the change; 0 for a dry run.
	AuditID int64 `json:"audit_id,omitempty"`
	// Warning is set when done events are (would be) replayed.
	Warning string `json:"warning,omitempty"`
}

// CheckRequeue validates sel and opts for Requeue and returns sel with its
// defaults filled in (Limit, Statuses). It returns a *SelectionError for a
// selection Requeue refuses. Requeue calls it; call it yourself to refuse
// bad input before connecting.
func CheckRequeue(sel Selection, opts RequeueOpts) (Selection, error) {
	return check(sel, opts.Actor, requeueRules(opts.AllowReplay, len(sel.IDs) > 0))
}

// CheckCancel is CheckRequeue for Cancel.
func CheckCancel(sel Selection, opts CancelOpts) (Selection, error) {
	return check(sel, opts.Actor, cancelRules(len(sel.IDs) > 0))
}

func check(sel Selection, actor string, rules filter.Rules) (Selection, error) {
	if err := checkActor(actor); err != nil {
		return sel, err
	}
	for _, st := range sel.Statuses {
		if !slices.Contains(filter.Statuses, st) {
			return sel, &SelectionError{Flag: "status", Msg: fmt.Sprintf("%q is not a status; use one or more of %s", st, strings.Join(filter.Statuses, ", "))}
		}
	}
	f := sel.filter()
	if err := f.Check(rules); err != nil {
		return sel, asSelectionError(err)
	}
	return fromFilter(f), nil
}

// requeueSQL calls outbox_requeue: failed, cancelled, stuck processing
// (or, with allow replay, done) events go back to pending with the full
// retry budget, due now, unlocked, not processed; last_error is kept so the
// history stays visible. The status change fires the wake trigger at
// commit. Rows locked by someone else right now are skipped (SKIP LOCKED)
// and reported. $1 actor, $2 dry run, $3 statuses, $4..$9 the selection
// (filter.Filter.Args), $10 the limit, $11 extra audit detail, $12 allow
// replay.
const requeueSQL = `
SELECT affected, event_ids, from_statuses, skipped, remaining, audit_id
FROM outbox_requeue(actor => $1, dry_run => $2, statuses => $3, ids => $4, type_prefix => $5, tenant_id => $6,
                    since => $7, until => $8, error_contains => $9, max_events => $10, extra => $11, allow_replay => $12)`

// cancelSQL calls outbox_cancel: pending, failed and stuck processing
// events become cancelled. A pending event that a dispatcher is handing off
// right now is row-locked: SKIP LOCKED leaves it and it is reported as
// locked. Its parameters are requeueSQL's without $12.
const cancelSQL = `
SELECT affected, event_ids, from_statuses, skipped, remaining, audit_id
FROM outbox_cancel(actor => $1, dry_run => $2, statuses => $3, ids => $4, type_prefix => $5, tenant_id => $6,
                   since => $7, until => $8, error_contains => $9, max_events => $10, extra => $11)`

// Requeue puts the selected failed, cancelled and stuck processing events
// (and, with opts.AllowReplay, done events) back to pending with the full
// retry budget, due now; last_error is kept. It changes at most sel.Limit
// events, skips rows a dispatcher holds right now, and writes one audit row
// in the same transaction. A dry run selects (and locks, for the moment of
// the call) exactly the rows a real run would change, and changes and
// records nothing.
func (c *Client) Requeue(ctx context.Context, sel Selection, opts RequeueOpts) (*ChangeResult, error) {
	sel, err := CheckRequeue(sel, opts)
	if err != nil {
		return nil, err
	}
	res, err := c.change(ctx, "requeue", requeueSQL, sel, opts.Actor, opts.DryRun, []any{opts.AllowReplay})
	if err != nil {
		return nil, err
	}
	if n := res.From["done"]; n > 0 {
		would := "are"
		if n == 1 {
			would = "is"
		}
		if res.DryRun {
			would = "would be"
		}
		res.Warning = fmt.Sprintf("%s %s replayed: River gets a new job for each, so every receiver sees them again; receivers must be idempotent (dedupe on event_id)", plural.Of(n, "done event", "done events"), would)
	}
	return res, nil
}

// Cancel moves the selected pending, failed and stuck processing events to
// cancelled, like Requeue: at most sel.Limit events, rows a dispatcher
// holds right now skipped, one audit row, nothing changed by a dry run.
func (c *Client) Cancel(ctx context.Context, sel Selection, opts CancelOpts) (*ChangeResult, error) {
	sel, err := CheckCancel(sel, opts)
	if err != nil {
		return nil, err
	}
	return c.change(ctx, "cancel", cancelSQL, sel, opts.Actor, opts.DryRun, nil)
}

// change runs one audited function (migration 007), which counts what the
// selection matches, changes up to the limit and writes the audit row in one
// transaction. A dry run writes no audit row, so it draws no audit id.
func (c *Client) change(ctx context.Context, action, query string, sel Selection, actor string, dryRun bool, more []any) (*ChangeResult, error) {
	res := &ChangeResult{Action: action, DryRun: dryRun, Selection: sel, Actor: actor,
		IDs: []int64{}, From: map[string]int{}, Skipped: map[string]int{}}
	extra := map[string]any{}
	if host, err := os.Hostname(); err == nil {
		extra["host"] = host
	}
	extraJSON, err := json.Marshal(extra)
	if err != nil {
		return nil, err
	}
	f := sel.filter()
	args := append([]any{actor, dryRun, f.Statuses}, f.Args()...)
	args = append(args, f.Limit, extraJSON)
	args = append(args, more...)
	var auditID *int64
	err = c.pool.QueryRow(ctx, query, args...).Scan(&res.Affected, &res.IDs, &res.From, &res.Skipped, &res.Remaining, &auditID)
	if err != nil {
		return nil, c.explain(ctx, fmt.Errorf("%s (has `outboxctl migrate` run?): %w", action, err))
	}
	if auditID != nil {
		res.AuditID = *auditID
	}
	return res, nil
}
