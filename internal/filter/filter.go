// Package filter parses and checks the event selection that outboxctl's
// requeue and cancel take (--id, --status, --type-prefix, --tenant,
// --since, --until, --error-contains, --limit, --all), and turns it into the
// arguments of one constant, parameterised SQL predicate (Predicate). No user
// input is ever spliced into SQL text.
//
// It is a package of its own, free of I/O, so that it can be fuzzed.
package filter

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Statuses of outbox_event, in the enum's order.
var Statuses = []string{"pending", "processing", "done", "failed", "cancelled"}

// Limits of the selection.
const (
	// DefaultLimit is the most events one command changes unless --limit says otherwise.
	DefaultLimit = 1000
	// MaxLimit is the largest --limit.
	MaxLimit = 100000
	// MaxIDs is the most --id flags.
	MaxIDs = 10000
	// maxText bounds --type-prefix, --tenant and --error-contains.
	maxText = 1024
)

// Filter is a parsed selection. The zero value selects nothing narrower than
// "every event"; Check refuses that unless All is set.
type Filter struct {
	IDs           []int64    `json:"ids,omitempty"`
	Statuses      []string   `json:"statuses,omitempty"`
	TypePrefix    string     `json:"type_prefix,omitempty"`
	Tenant        string     `json:"tenant,omitempty"`
	Since         *time.Time `json:"since,omitempty"`
	Until         *time.Time `json:"until,omitempty"`
	ErrorContains string     `json:"error_contains,omitempty"`
	Limit         int        `json:"limit"`
	All           bool       `json:"all,omitempty"`
}

// Narrowed reports whether anything but --status restricts the selection.
// A selection by status alone ("every failed event") is a bulk action.
func (f *Filter) Narrowed() bool {
	return len(f.IDs) > 0 || f.TypePrefix != "" || f.Tenant != "" || f.Since != nil || f.Until != nil || f.ErrorContains != ""
}

// Error is a selection the command refuses; Flag names the offending flag.
type Error struct {
	Flag string
	Msg  string
}

func (e *Error) Error() string {
	if e.Flag == "" {
		return e.Msg
	}
	return "--" + e.Flag + ": " + e.Msg
}

func errf(flag, format string, a ...any) error {
	return &Error{Flag: flag, Msg: fmt.Sprintf(format, a...)}
}

// ParseID parses one --id value.
func ParseID(s string) (int64, error) {
	id, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || id < 1 {
		return 0, errf("id", "%q is not an event id (a positive integer)", s)
	}
	return id, nil
}

// ParseIDs parses a comma-separated list of ids (one --id flag may carry
// several: --id 12,13).
func ParseIDs(s string) ([]int64, error) {
	var out []int64
	for part := range strings.SplitSeq(s, ",") {
		id, err := ParseID(part)
		if err != nil {
			return nil, err
		}
		out = append(out, id)
	}
	return out, nil
}

// ParseStatuses parses a comma-separated --status value.
func ParseStatuses(s string) ([]string, error) {
	var out []string
	for part := range strings.SplitSeq(s, ",") {
		st := strings.ToLower(strings.TrimSpace(part))
		if !slices.Contains(Statuses, st) {
			return nil, errf("status", "%q is not a status; use one or more of %s, comma-separated", part, strings.Join(Statuses, ", "))
		}
		if !slices.Contains(out, st) {
			out = append(out, st)
		}
	}
	return out, nil
}

// ParseTime parses --since/--until: an RFC 3339 time
// (2024-05-01T10:00:00Z), a date (2024-05-01, midnight UTC), or an age
// before now: a Go duration (90m, 2h30m) or a number of days (3d).
func ParseTime(flag, s string, now time.Time) (time.Time, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return time.Time{}, errf(flag, "empty time; use RFC 3339 (2024-05-01T10:00:00Z), a date (2024-05-01) or an age (2h, 3d)")
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if t, err := time.Parse(time.DateOnly, s); err == nil {
		return t, nil
	}
	if days, ok := strings.CutSuffix(s, "d"); ok {
		if n, err := strconv.Atoi(days); err == nil && n >= 0 && n <= 36500 {
			return now.Add(-time.Duration(n) * 24 * time.Hour), nil
		}
	}
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, errf(flag, "%q is not a time; use RFC 3339 (2024-05-01T10:00:00Z), a date (2024-05-01) or an age before now (90m, 2h, 3d)", s)
}

// CheckText checks a free-text flag value (type prefix, tenant, error text).
func CheckText(flag, s string) error {
	switch {
	case !utf8.ValidString(s):
		return errf(flag, "not valid UTF-8")
	case strings.ContainsRune(s, 0):
		return errf(flag, "contains a NUL character")
	case len(s) > maxText:
		return errf(flag, "%d bytes; the limit is %d", len(s), maxText)
	}
	return nil
}

// Rules say which statuses an action may change.
type Rules struct {
	// Action names the command in messages ("requeue").
	Action string
	// Eligible are the statuses the action changes.
	Eligible []string
	// Refused maps a status the action never touches to the reason.
	Refused map[string]string
	// Default are the statuses selected when --status is not given.
	Default []string
}

// Check validates f against the rules of an action and fills in defaults
// (Limit, Statuses). It returns an *Error for a selection to refuse.
func (f *Filter) Check(r Rules) error {
	if f.Limit == 0 {
		f.Limit = DefaultLimit
	}
	if f.Limit < 1 || f.Limit > MaxLimit {
		return errf("limit", "%d is out of range: use 1 to %d", f.Limit, MaxLimit)
	}
	if len(f.IDs) > MaxIDs {
		return errf("id", "%d ids; the limit is %d per run", len(f.IDs), MaxIDs)
	}
	for _, fl := range []struct{ name, v string }{{"type-prefix", f.TypePrefix}, {"tenant", f.Tenant}, {"error-contains", f.ErrorContains}} {
		if err := CheckText(fl.name, fl.v); err != nil {
			return err
		}
	}
	if f.Since != nil && f.Until != nil && !f.Since.Before(*f.Until) {
		return errf("since", "%s is not before --until %s", f.Since.Format(time.RFC3339), f.Until.Format(time.RFC3339))
	}
	if len(f.Statuses) == 0 {
		f.Statuses = slices.Clone(r.Default)
	}
	for _, st := range f.Statuses {
		if why, refused := r.Refused[st]; refused {
			return errf("status", "%s never touches %s events: %s", r.Action, st, why)
		}
		if !slices.Contains(r.Eligible, st) {
			return errf("status", "%s cannot change %s events; it takes %s", r.Action, st, strings.Join(r.Eligible, ", "))
		}
	}
	if !f.Narrowed() && !f.All {
		return &Error{Msg: fmt.Sprintf("refusing to %s every %s event without a filter: narrow the selection with --id, --type-prefix, --tenant, --since, --until or --error-contains, or pass --all to mean it (at most --limit=%d events per run)",
			r.Action, strings.Join(f.Statuses, "/"), f.Limit)}
	}
	return nil
}

// Predicate is the WHERE clause of every selection: one constant text whose
// parameters Args fills ($1..$6). A NULL parameter leaves its condition out;
// the type prefix is matched with starts_with (no LIKE wildcards to escape)
// and the error text with strpos.
const Predicate = `($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
  AND ($2::text IS NULL OR starts_with(event_type, $2::text))
  AND ($3::text IS NULL OR tenant_id = $3::text)
  AND ($4::timestamptz IS NULL OR created_at >= $4::timestamptz)
  AND ($5::timestamptz IS NULL OR created_at < $5::timestamptz)
  AND ($6::text IS NULL OR strpos(last_error, $6::text) > 0)`

// Args returns the parameters of Predicate, in order ($1..$6).
func (f *Filter) Args() []any {
	var ids []int64 // nil slice encodes as NULL
	if len(f.IDs) > 0 {
		ids = f.IDs
	}
	return []any{ids, nullText(f.TypePrefix), nullText(f.Tenant), f.Since, f.Until, nullText(f.ErrorContains)}
}

func nullText(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}
