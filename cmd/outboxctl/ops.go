package main

// The operator commands: requeue, cancel, stats, retention, audit.
// See docs/operations.md for the runbook that uses them.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/filter"
	"github.com/outboxhq/outbox/retention"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// opsFlags is c.flags plus --database-url (default $DATABASE_URL).
func (c *cli) opsFlags(name string) *flag.FlagSet {
	fs := c.flags(name)
	// A Func flag shows no default in --help: the URL may hold a password.
	fs.Func("database-url", "Postgres connection string (default $DATABASE_URL)", func(v string) error {
		c.dbURL = v
		return nil
	})
	return fs
}

// defaultActor is the OS user running outboxctl.
func defaultActor() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	for _, k := range []string{"USER", "LOGNAME"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return "unknown"
}

func checkActor(actor string) error {
	if actor == "" || len(actor) > 256 || strings.ContainsRune(actor, 0) {
		return usagef("--actor must be 1 to 256 bytes without NUL characters")
	}
	return nil
}

// listFlag collects a repeatable flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// ---------------------------------------------------------------------------
// requeue and cancel

// selectAction is requeue or cancel.
type selectAction struct {
	name  string
	verb  string // past tense for messages
	rules func(allowReplay bool, byID bool) filter.Rules
	// sql runs the action's audited function (migration 007): it counts
	// what the selection matches, changes up to the limit and writes the
	// audit row in one transaction, or, for a dry run, changes and records
	// nothing. $1 actor, $2 dry run, $3 statuses, $4..$9 filter.Predicate's
	// $1..$6, $10 the limit, $11 extra audit detail, $12 (requeue only)
	// allow replay.
	sql string
}

// requeueSQL calls outbox_requeue: failed, cancelled, stuck processing
// (or, with --allow-replay, done) events go back to pending with the full
// retry budget, due now, unlocked, not processed; last_error is kept so the
// history stays visible. The status change fires the wake trigger at
// commit. Rows locked by someone else right now are skipped (SKIP LOCKED)
// and reported.
const requeueSQL = `
SELECT affected, event_ids, from_statuses, skipped, remaining, audit_id
FROM outbox_requeue(actor => $1, dry_run => $2, statuses => $3, ids => $4, type_prefix => $5, tenant_id => $6,
                    since => $7, until => $8, error_contains => $9, max_events => $10, extra => $11, allow_replay => $12)`

// cancelSQL calls outbox_cancel: pending, failed and stuck processing
// events become cancelled. A pending event that a dispatcher is handing off
// right now is row-locked: SKIP LOCKED leaves it and it is reported as
// locked.
const cancelSQL = `
SELECT affected, event_ids, from_statuses, skipped, remaining, audit_id
FROM outbox_cancel(actor => $1, dry_run => $2, statuses => $3, ids => $4, type_prefix => $5, tenant_id => $6,
                   since => $7, until => $8, error_contains => $9, max_events => $10, extra => $11)`

const auditInsertSQL = `
INSERT INTO outbox_audit (actor, action, filter, affected, detail)
VALUES ($1, $2, $3, $4, $5)
RETURNING id, at`

// stuckNote explains which processing events requeue and cancel take.
const stuckNote = "only stuck ones: a NULL or past locked_until; one a dispatcher holds right now is skipped"

var requeueAction = selectAction{
	name: "requeue",
	verb: "requeued",
	rules: func(allowReplay, byID bool) filter.Rules {
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
	},
	sql: requeueSQL,
}

var cancelAction = selectAction{
	name: "cancel",
	verb: "cancelled",
	rules: func(_, byID bool) filter.Rules {
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
	},
	sql: cancelSQL,
}

// selectResult is what requeue and cancel report.
type selectResult struct {
	Action   string         `json:"action"`
	DryRun   bool           `json:"dry_run"`
	Affected int            `json:"affected"`
	IDs      []int64        `json:"ids"`
	From     map[string]int `json:"from"`
	Skipped  map[string]int `json:"skipped"`
	// Remaining eligible events matched the filter beyond --limit (or
	// were locked); run again to continue.
	Remaining int           `json:"remaining"`
	Filter    filter.Filter `json:"filter"`
	Actor     string        `json:"actor"`
	AuditID   int64         `json:"audit_id,omitempty"`
	Warning   string        `json:"warning,omitempty"`
}

func runRequeue(ctx context.Context, c *cli, args []string) error {
	return runSelect(ctx, c, requeueAction, args)
}

func runCancel(ctx context.Context, c *cli, args []string) error {
	return runSelect(ctx, c, cancelAction, args)
}

func runSelect(ctx context.Context, c *cli, a selectAction, args []string) error {
	fs := c.opsFlags(a.name)
	var ids, statuses listFlag
	fs.Var(&ids, "id", "event id; repeatable, or comma-separated")
	fs.Var(&statuses, "status", "status to select, comma-separated ("+strings.Join(a.rules(true, false).Eligible, ", ")+"); default "+strings.Join(a.rules(false, false).Default, ",")+" ("+strings.Join(a.rules(false, true).Default, ",")+" with --id); processing: "+stuckNote)
	typePrefix := fs.String("type-prefix", "", "event types starting with this (e.g. mail. or billing.invoice.)")
	tenant := fs.String("tenant", "", "tenant id (exact)")
	since := fs.String("since", "", "created at or after: RFC 3339, a date, or an age (2h, 3d)")
	until := fs.String("until", "", "created before: RFC 3339, a date, or an age (2h, 3d)")
	errContains := fs.String("error-contains", "", "last_error contains this text (case-sensitive)")
	limit := fs.Int("limit", filter.DefaultLimit, fmt.Sprintf("most events changed per run (1..%d)", filter.MaxLimit))
	all := fs.Bool("all", false, "allow a selection by status alone (every failed event)")
	dryRun := fs.Bool("dry-run", false, "report what would change, change nothing")
	actor := fs.String("actor", defaultActor(), "who runs this, recorded in the audit (default: the OS user)")
	var allowReplay *bool
	if a.name == "requeue" {
		allowReplay = fs.Bool("allow-replay", false, "allow requeueing done events (receivers get them again)")
	} else {
		allowReplay = new(bool)
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q (flags go before nothing else; see --help)", fs.Arg(0))
	}
	if err := checkActor(*actor); err != nil {
		return err
	}

	f := filter.Filter{TypePrefix: *typePrefix, Tenant: *tenant, ErrorContains: *errContains, Limit: *limit, All: *all}
	if *limit == 0 {
		return usagef("--limit: 0 is out of range: use 1 to %d", filter.MaxLimit)
	}
	for _, v := range ids {
		got, err := filter.ParseIDs(v)
		if err != nil {
			return &usageError{err.Error()}
		}
		f.IDs = append(f.IDs, got...)
	}
	for _, v := range statuses {
		got, err := filter.ParseStatuses(v)
		if err != nil {
			return &usageError{err.Error()}
		}
		for _, s := range got {
			if !slices.Contains(f.Statuses, s) {
				f.Statuses = append(f.Statuses, s)
			}
		}
	}
	now := time.Now()
	for _, tf := range []struct {
		name string
		v    string
		dst  **time.Time
	}{{"since", *since, &f.Since}, {"until", *until, &f.Until}} {
		if tf.v == "" {
			continue
		}
		t, err := filter.ParseTime(tf.name, tf.v, now)
		if err != nil {
			return &usageError{err.Error()}
		}
		*tf.dst = &t
	}
	if err := f.Check(a.rules(*allowReplay, len(f.IDs) > 0)); err != nil {
		return &usageError{err.Error()}
	}

	pool, err := c.db(ctx)
	if err != nil {
		return err
	}
	res, err := applySelect(ctx, pool, a, f, *actor, *dryRun, *allowReplay)
	if err != nil {
		return err
	}
	if res.From["done"] > 0 {
		would := "are"
		if res.From["done"] == 1 {
			would = "is"
		}
		if res.DryRun {
			would = "would be"
		}
		res.Warning = fmt.Sprintf("%s %s replayed: River gets a new job for each, so every receiver sees them again; receivers must be idempotent (dedupe on event_id)", plural(res.From["done"], "done event", "done events"), would)
		fmt.Fprintf(c.stderr, "outboxctl %s: warning: %s\n", a.name, res.Warning)
	}
	if c.jsonOut {
		return c.printJSON(res)
	}
	printSelect(c.stdout, a, res)
	return nil
}

// applySelect runs the action's audited function (outbox_requeue or
// outbox_cancel, migration 007), which counts what the filter matches,
// changes up to the limit and writes the audit row in one transaction. A
// dry run selects (and locks, for the moment of the call) exactly the rows
// the real run would change, changes nothing and writes no audit row, so
// it draws no audit id either.
func applySelect(ctx context.Context, pool *pgxpool.Pool, a selectAction, f filter.Filter, actor string, dryRun, allowReplay bool) (*selectResult, error) {
	res := &selectResult{Action: a.name, DryRun: dryRun, Filter: f, Actor: actor,
		IDs: []int64{}, From: map[string]int{}, Skipped: map[string]int{}}
	extra := map[string]any{}
	if host, err := os.Hostname(); err == nil {
		extra["host"] = host
	}
	extraJSON, err := json.Marshal(extra)
	if err != nil {
		return nil, err
	}
	args := append([]any{actor, dryRun, f.Statuses}, f.Args()...)
	args = append(args, f.Limit, extraJSON)
	if a.name == "requeue" {
		args = append(args, allowReplay)
	}
	var auditID *int64
	err = pool.QueryRow(ctx, a.sql, args...).Scan(&res.Affected, &res.IDs, &res.From, &res.Skipped, &res.Remaining, &auditID)
	if err != nil {
		return nil, fmt.Errorf("%s (has `outboxctl migrate` run?): %w", a.name, err)
	}
	if auditID != nil {
		res.AuditID = *auditID
	}
	return res, nil
}

func firstN(ids []int64, n int) []int64 {
	if len(ids) > n {
		return ids[:n]
	}
	return ids
}

func printSelect(w io.Writer, a selectAction, r *selectResult) {
	verb := a.verb
	if r.DryRun {
		verb = "would be " + a.verb
	}
	fmt.Fprintf(w, "%s %s", plural(r.Affected, "event", "events"), verb)
	if len(r.From) > 0 {
		fmt.Fprintf(w, " (from %s)", formatCounts(r.From))
	}
	fmt.Fprintln(w)
	if len(r.IDs) > 0 {
		shown := firstN(r.IDs, 20)
		s := make([]string, len(shown))
		for i, id := range shown {
			s[i] = strconv.FormatInt(id, 10)
		}
		more := ""
		if len(r.IDs) > len(shown) {
			more = fmt.Sprintf(" … and %d more (--json lists all)", len(r.IDs)-len(shown))
		}
		fmt.Fprintf(w, "ids: %s%s\n", strings.Join(s, ", "), more)
	}
	if len(r.Skipped) > 0 {
		fmt.Fprintf(w, "skipped: %s\n", formatCounts(r.Skipped))
	}
	if r.Remaining > 0 {
		fmt.Fprintf(w, "%d more match beyond --limit=%d or were locked: run again to continue\n", r.Remaining, r.Filter.Limit)
	}
	if r.DryRun {
		fmt.Fprintln(w, "dry run: nothing changed, nothing recorded")
	} else {
		fmt.Fprintf(w, "recorded as audit #%d by %s\n", r.AuditID, clean(r.Actor))
	}
}

func formatCounts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%d %s", m[k], k)
	}
	return strings.Join(parts, ", ")
}

// ---------------------------------------------------------------------------
// stats

// behindAfter is how long past due a pending event counts as "behind".
const behindAfter = 60 * time.Second

// statusCountsSQL counts every status, zeros included.
const statusCountsSQL = `
SELECT s::text, count(e.id)
FROM unnest(enum_range(NULL::outbox_status)) AS s
LEFT JOIN outbox_event e ON e.status = s
GROUP BY s ORDER BY s`

// pendingSQL reads the lag of the dispatcher through the claim index
// (status = 'pending', ordered by scheduled_at): the age of the oldest due
// event (since it became due) and how many are due for more than $1 s.
const pendingSQL = `
SELECT coalesce(extract(epoch FROM now() - min(scheduled_at)), 0)::float8,
       count(*) FILTER (WHERE scheduled_at <= now() - make_interval(secs => $1))
FROM outbox_event WHERE status = 'pending' AND scheduled_at <= now()`

// riverQueuesSQL counts the outbox's River jobs per queue and state;
// stalled are running jobs attempted more than $2 s ago.
const riverQueuesSQL = `
SELECT queue,
       count(*) FILTER (WHERE state = 'available'),
       count(*) FILTER (WHERE state = 'running'),
       count(*) FILTER (WHERE state = 'retryable'),
       count(*) FILTER (WHERE state = 'discarded'),
       count(*) FILTER (WHERE state = 'running' AND attempted_at < now() - make_interval(secs => $2))
FROM river_job
WHERE kind = $1 AND state IN ('available', 'running', 'retryable', 'discarded')
GROUP BY queue ORDER BY queue`

type queueStats struct {
	Queue     string `json:"queue"`
	Available int64  `json:"available"`
	Running   int64  `json:"running"`
	Retryable int64  `json:"retryable"`
	Discarded int64  `json:"discarded"`
	Stalled   int64  `json:"stalled"`
	Worked    *bool  `json:"worked,omitempty"`
}

type unworkedRoute struct {
	Prefix string `json:"prefix"`
	Queue  string `json:"queue"`
}

type statsAlert struct {
	Name      string  `json:"name"`
	Value     float64 `json:"value"`
	Threshold float64 `json:"threshold"`
	Message   string  `json:"message"`
}

type statsResult struct {
	Events                map[string]int64 `json:"events"`
	OldestDuePendingAgeS  float64          `json:"oldest_due_pending_age_seconds"`
	PendingDueOver60s     int64            `json:"pending_due_over_60s"`
	Queues                []queueStats     `json:"queues"`
	StalledAfterS         float64          `json:"stalled_after_seconds"`
	WorkedQueuesKnown     bool             `json:"worked_queues_known"`
	WorkedQueuesSource    string           `json:"worked_queues_source,omitempty"`
	UnworkedRoutes        []unworkedRoute  `json:"unworked_routes"`
	Alerts                []statsAlert     `json:"alerts"`
	RetentionLastFinished *time.Time       `json:"retention_last_finished_at"`
}

func runStats(ctx context.Context, c *cli, args []string) error {
	fs := c.opsFlags("stats")
	check := fs.Bool("check", false, "exit 1 when an alert threshold is crossed (for cron and probes)")
	stalledAfter := fs.Duration("stalled-after", 10*time.Minute, "a River job running longer than this is stalled")
	routesFile := fs.String("routes", os.Getenv("OUTBOX_ROUTES_FILE"), "routes file, to list routes whose queue no worker works (default $OUTBOX_ROUTES_FILE)")
	worked := fs.String("worked-queues", os.Getenv("OUTBOX_WORKED_QUEUES"), "comma-separated River queues that some worker group works (default $OUTBOX_WORKED_QUEUES)")
	maxBehind := fs.Int64("max-behind", 1000, "alert when more pending events than this are due for over 60s")
	maxStalled := fs.Int64("max-stalled", 0, "alert when more River jobs than this are stalled")
	maxFailed := fs.Int64("max-failed", 0, "alert when more events than this are failed (dead-lettered or unroutable); the default 0 alerts on any; -1: off")
	maxDiscarded := fs.Int64("max-discarded", -1, "alert when more outbox River jobs than this are discarded (-1: off)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	if *stalledAfter <= 0 {
		return usagef("--stalled-after must be positive, got %s", *stalledAfter)
	}
	var routes *route.Table
	if *routesFile != "" {
		var err error
		if routes, err = route.Load(*routesFile); err != nil {
			return usagef("--routes: %v", err)
		}
	}
	var workedSet []string
	workedKnown := strings.TrimSpace(*worked) != ""
	for q := range strings.SplitSeq(*worked, ",") {
		if q = strings.TrimSpace(q); q != "" {
			if err := route.ValidateQueueName(q); err != nil {
				return usagef("--worked-queues: %v", err)
			}
			workedSet = append(workedSet, q)
		}
	}

	pool, err := c.db(ctx)
	if err != nil {
		return err
	}
	// Without an explicit list, the worked queues come from the declared
	// worker groups (OUTBOX_WORKER_GROUPS), else from the queues River
	// workers have reported recently in river_queue.
	workedSource := "--worked-queues"
	if !workedKnown && routes != nil {
		if spec := os.Getenv("OUTBOX_WORKER_GROUPS"); strings.TrimSpace(spec) != "" {
			groups, err := outboxriver.ParseGroups(spec)
			if err != nil {
				return usagef("OUTBOX_WORKER_GROUPS: %v", err)
			}
			for _, g := range groups {
				workedSet = append(workedSet, g.QueueNames()...)
			}
			workedKnown, workedSource = true, "OUTBOX_WORKER_GROUPS"
		} else {
			active, err := outboxriver.ActiveQueues(ctx, pool, 0)
			if err != nil {
				return err
			}
			workedSet, workedKnown, workedSource = active, true, "river_queue (workers seen recently)"
		}
	}
	res, err := collectStats(ctx, pool, *stalledAfter, routes, workedSet, workedKnown)
	if err != nil {
		return err
	}
	if workedKnown {
		res.WorkedQueuesSource = workedSource
	}

	alertIf := func(name string, value, threshold float64, msg string) {
		if threshold >= 0 && value > threshold {
			res.Alerts = append(res.Alerts, statsAlert{Name: name, Value: value, Threshold: threshold, Message: msg})
		}
	}
	var stalled, discarded int64
	for _, q := range res.Queues {
		stalled += q.Stalled
		discarded += q.Discarded
	}
	alertIf("dispatcher_behind", float64(res.PendingDueOver60s), float64(*maxBehind),
		fmt.Sprintf("%s due for more than 60s (oldest %.0fs): the dispatcher is behind or down", plural(res.PendingDueOver60s, "pending event is", "pending events are"), res.OldestDuePendingAgeS))
	alertIf("river_jobs_stalled", float64(stalled), float64(*maxStalled),
		fmt.Sprintf("%s been running for more than %s", plural(stalled, "outbox River job has", "outbox River jobs have"), *stalledAfter))
	alertIf("events_failed", float64(res.Events["failed"]), float64(*maxFailed),
		fmt.Sprintf("%s failed (dead-lettered or unroutable): fix the cause, then requeue or cancel it", plural(res.Events["failed"], "event is", "events are")))
	alertIf("river_jobs_discarded", float64(discarded), float64(*maxDiscarded),
		fmt.Sprintf("%s discarded: the receiver gave up", plural(discarded, "outbox River job is", "outbox River jobs are")))
	if len(res.UnworkedRoutes) > 0 {
		alertIf("routes_unworked", float64(len(res.UnworkedRoutes)), 0,
			plural(len(res.UnworkedRoutes), "route sends jobs to a queue that no worker group works", "routes send jobs to queues that no worker group works"))
	}

	if c.jsonOut {
		if err := c.printJSON(res); err != nil {
			return err
		}
	} else {
		printStats(c.stdout, res)
	}
	if *check && len(res.Alerts) > 0 {
		names := make([]string, len(res.Alerts))
		for i, a := range res.Alerts {
			names[i] = a.Name
		}
		// The JSON document above already lists the alerts: keep Main from
		// printing a second one for the exit-1 error.
		c.jsonOut = false
		return &checkFailed{names: names}
	}
	return nil
}

// checkFailed is the exit-1 result of stats --check.
type checkFailed struct{ names []string }

func (e *checkFailed) Error() string {
	return "check failed: " + strings.Join(e.names, ", ")
}

func collectStats(ctx context.Context, pool *pgxpool.Pool, stalledAfter time.Duration, routes *route.Table, worked []string, workedKnown bool) (*statsResult, error) {
	res := &statsResult{Events: map[string]int64{}, Queues: []queueStats{}, UnworkedRoutes: []unworkedRoute{},
		Alerts: []statsAlert{}, StalledAfterS: stalledAfter.Seconds(), WorkedQueuesKnown: workedKnown}
	// One read-only snapshot, so the numbers agree with each other.
	err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadOnly, IsoLevel: pgx.RepeatableRead}, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, statusCountsSQL)
		if err != nil {
			return fmt.Errorf("count events (has `outboxctl migrate` run?): %w", err)
		}
		for rows.Next() {
			var s string
			var n int64
			if err := rows.Scan(&s, &n); err != nil {
				rows.Close()
				return err
			}
			res.Events[s] = n
		}
		if err := rows.Err(); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, pendingSQL, behindAfter.Seconds()).Scan(&res.OldestDuePendingAgeS, &res.PendingDueOver60s); err != nil {
			return fmt.Errorf("read pending lag: %w", err)
		}
		rows, err = tx.Query(ctx, riverQueuesSQL, outboxriver.Kind, stalledAfter.Seconds())
		if err != nil {
			return fmt.Errorf("count River jobs: %w", err)
		}
		for rows.Next() {
			var q queueStats
			if err := rows.Scan(&q.Queue, &q.Available, &q.Running, &q.Retryable, &q.Discarded, &q.Stalled); err != nil {
				rows.Close()
				return err
			}
			res.Queues = append(res.Queues, q)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		// The retention job's last finished run (outbox_job_run, 002).
		err = tx.QueryRow(ctx, `SELECT last_finished_at FROM outbox_job_run WHERE name = $1`, retention.JobName).Scan(&res.RetentionLastFinished)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("read outbox_job_run: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}

	// Route queues with no jobs yet still get a row; with a worked-queue
	// list, every queue says whether someone works it.
	if routes != nil {
		for _, q := range routes.AllQueues() {
			if !slices.ContainsFunc(res.Queues, func(s queueStats) bool { return s.Queue == q }) {
				res.Queues = append(res.Queues, queueStats{Queue: q})
			}
		}
		slices.SortFunc(res.Queues, func(a, b queueStats) int { return strings.Compare(a.Queue, b.Queue) })
	}
	if workedKnown {
		for i := range res.Queues {
			w := slices.Contains(worked, res.Queues[i].Queue)
			res.Queues[i].Worked = &w
		}
		if routes != nil {
			for _, r := range routes.Rules() {
				for _, q := range r.Queues {
					if !slices.Contains(worked, q) {
						res.UnworkedRoutes = append(res.UnworkedRoutes, unworkedRoute{Prefix: r.Prefix, Queue: q})
					}
				}
			}
			slices.SortFunc(res.UnworkedRoutes, func(a, b unworkedRoute) int { return strings.Compare(a.Prefix, b.Prefix) })
		}
	}
	return res, nil
}

func printStats(w io.Writer, r *statsResult) {
	fmt.Fprintf(w, "events: ")
	var parts []string
	for _, s := range filter.Statuses {
		parts = append(parts, fmt.Sprintf("%s %d", s, r.Events[s]))
	}
	fmt.Fprintln(w, strings.Join(parts, ", "))
	fmt.Fprintf(w, "oldest due pending: %.1fs; pending due for more than 60s: %d\n", r.OldestDuePendingAgeS, r.PendingDueOver60s)
	if r.RetentionLastFinished != nil {
		fmt.Fprintf(w, "retention last finished: %s\n", r.RetentionLastFinished.Format(time.RFC3339))
	} else {
		fmt.Fprintln(w, "retention last finished: never")
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "QUEUE\tAVAILABLE\tRUNNING\tRETRYABLE\tDISCARDED\tSTALLED (>%s)\tWORKED\n", time.Duration(r.StalledAfterS*float64(time.Second)))
	for _, q := range r.Queues {
		worked := "?"
		if q.Worked != nil {
			worked = map[bool]string{true: "yes", false: "NO"}[*q.Worked]
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\n", clean(q.Queue), q.Available, q.Running, q.Retryable, q.Discarded, q.Stalled, worked)
	}
	_ = tw.Flush()
	if len(r.Queues) == 0 {
		fmt.Fprintln(w, "(no outbox River jobs; pass --routes to list the route queues)")
	}
	if !r.WorkedQueuesKnown {
		fmt.Fprintln(w, "\nworked queues unknown: pass --routes (and --worked-queues, OUTBOX_WORKED_QUEUES or OUTBOX_WORKER_GROUPS) to find routes nobody works")
	}
	for _, u := range r.UnworkedRoutes {
		fmt.Fprintf(w, "route %q sends to queue %s, which no worker group works\n", u.Prefix, clean(u.Queue))
	}
	fmt.Fprintln(w)
	if len(r.Alerts) == 0 {
		fmt.Fprintln(w, "alerts: none")
	}
	for _, a := range r.Alerts {
		fmt.Fprintf(w, "ALERT %s: %s\n", a.Name, clean(a.Message))
	}
}

// ---------------------------------------------------------------------------
// retention

func runRetention(ctx context.Context, c *cli, args []string) error {
	if len(args) == 0 || args[0] != "run" {
		return usagef("usage: outboxctl retention run [--dry-run] [--json] [--hours N] [--batch-size N]")
	}
	fs := c.opsFlags("retention run")
	dryRun := fs.Bool("dry-run", false, "count what a run would delete, delete nothing")
	hoursDefault, err := envInt("OUTBOX_DONE_RETENTION_HOURS", 720)
	if err != nil {
		return err
	}
	batchDefault, err := envInt("OUTBOX_DONE_RETENTION_BATCH_SIZE", retention.DefaultBatchSize)
	if err != nil {
		return err
	}
	hours := fs.Int("hours", hoursDefault, "delete done events processed more than this many hours ago (default $OUTBOX_DONE_RETENTION_HOURS or 720)")
	batch := fs.Int("batch-size", batchDefault, "rows per batch, clamped to 1..10000 (default $OUTBOX_DONE_RETENTION_BATCH_SIZE or 1000)")
	actor := fs.String("actor", defaultActor(), "who runs this, recorded in the audit (default: the OS user)")
	if err := parse(fs, args[1:]); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	if *hours < 1 {
		return usagef("--hours must be at least 1, got %d", *hours)
	}
	if err := checkActor(*actor); err != nil {
		return err
	}
	pool, err := c.db(ctx)
	if err != nil {
		return err
	}
	cfg := retention.Config{MaxAge: time.Duration(*hours) * time.Hour, BatchSize: *batch, RunBy: "outboxctl " + *actor}
	res, err := retention.Run(ctx, pool, cfg, *dryRun)
	if errors.Is(err, retention.ErrLocked) {
		return fmt.Errorf("%w; try again when it has finished", err)
	}
	if err != nil {
		return err
	}
	var auditID int64
	if !*dryRun {
		filterJSON, _ := json.Marshal(map[string]any{"hours": *hours, "batch_size": retention.ClampBatchSize(*batch)})
		detailJSON, _ := json.Marshal(map[string]any{"batches": res.Batches, "cutoff": res.Cutoff})
		var at time.Time
		if err := pool.QueryRow(ctx, auditInsertSQL, *actor, "retention", filterJSON, res.Deleted, detailJSON).Scan(&auditID, &at); err != nil {
			return fmt.Errorf("retention deleted %d rows but the audit row failed: %w", res.Deleted, err)
		}
	}
	if c.jsonOut {
		return c.printJSON(map[string]any{"job": retention.JobName, "deleted": res.Deleted, "batches": res.Batches,
			"cutoff": res.Cutoff, "dry_run": res.DryRun, "audit_id": auditID})
	}
	if *dryRun {
		fmt.Fprintf(c.stdout, "dry run: %s processed before %s would be deleted; nothing changed\n", plural(res.Deleted, "done event", "done events"), res.Cutoff.Format(time.RFC3339))
		return nil
	}
	fmt.Fprintf(c.stdout, "deleted %s processed before %s in %s; recorded as audit #%d\n",
		plural(res.Deleted, "done event", "done events"), res.Cutoff.Format(time.RFC3339), plural(res.Batches, "batch", "batches"), auditID)
	return nil
}

func envInt(name string, def int) (int, error) {
	v := os.Getenv(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, usagef("%s=%q is not an integer", name, v)
	}
	return n, nil
}

// ---------------------------------------------------------------------------
// audit

type auditRow struct {
	ID       int64           `json:"id"`
	At       time.Time       `json:"at"`
	Actor    string          `json:"actor"`
	DBUser   string          `json:"db_user"`
	Action   string          `json:"action"`
	Filter   json.RawMessage `json:"filter"`
	Affected int64           `json:"affected"`
	Detail   json.RawMessage `json:"detail"`
}

const auditListSQL = `
SELECT id, at, actor, db_user, action, filter::text, affected, detail::text
FROM outbox_audit
WHERE ($1::text IS NULL OR action = $1::text)
  AND ($2::timestamptz IS NULL OR at >= $2::timestamptz)
ORDER BY at DESC, id DESC
LIMIT $3`

func runAudit(ctx context.Context, c *cli, args []string) error {
	fs := c.opsFlags("audit")
	limit := fs.Int("limit", 50, "most rows listed, newest first (1..10000)")
	action := fs.String("action", "", "only this action (requeue, cancel, retention)")
	since := fs.String("since", "", "only actions at or after: RFC 3339, a date, or an age (2h, 3d)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	if *limit < 1 || *limit > 10000 {
		return usagef("--limit: %d is out of range: use 1 to 10000", *limit)
	}
	var sinceT *time.Time
	if *since != "" {
		t, err := filter.ParseTime("since", *since, time.Now())
		if err != nil {
			return &usageError{err.Error()}
		}
		sinceT = &t
	}
	var actionArg *string
	if *action != "" {
		actionArg = action
	}
	pool, err := c.db(ctx)
	if err != nil {
		return err
	}
	rows, err := pool.Query(ctx, auditListSQL, actionArg, sinceT, *limit)
	if err != nil {
		return fmt.Errorf("read outbox_audit (has `outboxctl migrate` run?): %w", err)
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (auditRow, error) {
		// filter and detail are read as text and embedded only when
		// encoding/json accepts them (see embedJSON).
		var a auditRow
		var filterText, detailText string
		err := r.Scan(&a.ID, &a.At, &a.Actor, &a.DBUser, &a.Action, &filterText, &a.Affected, &detailText)
		a.Filter, a.Detail = embedJSON(filterText), embedJSON(detailText)
		return a, err
	})
	if err != nil {
		return fmt.Errorf("read outbox_audit: %w", err)
	}
	if list == nil {
		list = []auditRow{}
	}
	if c.jsonOut {
		return c.printJSON(list)
	}
	if len(list) == 0 {
		fmt.Fprintln(c.stdout, "no audit rows")
		return nil
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tAT\tACTOR\tDB USER\tACTION\tAFFECTED\tFILTER")
	for _, a := range list {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d\t%s\n", a.ID, a.At.Local().Format(time.RFC3339), clean(a.Actor), clean(a.DBUser), clean(a.Action), a.Affected, clean(compactJSON(a.Filter)))
	}
	return tw.Flush()
}

func compactJSON(b []byte) string {
	var v map[string]any
	if json.Unmarshal(b, &v) != nil {
		return string(b)
	}
	out, _ := json.Marshal(v)
	return string(out)
}
