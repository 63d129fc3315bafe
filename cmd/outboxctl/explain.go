package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/route"
)

// explainResult is `outboxctl explain --json`.
type explainResult struct {
	Event    explainEvent     `json:"event"`
	Routes   *explainRoutes   `json:"routes"`
	Jobs     []explainJob     `json:"jobs"`
	Receipts []explainReceipt `json:"receipts"`
}

type explainEvent struct {
	ID          int64      `json:"id"`
	Type        string     `json:"event_type"`
	TenantID    *string    `json:"tenant_id"`
	DispatchKey *string    `json:"dispatch_key"`
	Status      string     `json:"status"`
	Retries     int        `json:"retries"`
	LastError   *string    `json:"last_error"`
	CreatedAt   time.Time  `json:"created_at"`
	ScheduledAt time.Time  `json:"scheduled_at"`
	LockedUntil *time.Time `json:"locked_until"`
	ProcessedAt *time.Time `json:"processed_at"`
	RiverJobIDs []int64    `json:"river_job_ids"`
	// Payload is the stored JSON, embedded as it is; it is null (and
	// PayloadText holds it) when the payload cannot be embedded in this
	// document (nested deeper than encoding/json accepts).
	Payload     json.RawMessage `json:"payload"`
	PayloadText *string         `json:"payload_text,omitempty"`
	// payload is the text read from the database, never decoded.
	payload string
}

// explainRoutes is what the routes file says about the event now (the
// routes at handoff time may have been different).
type explainRoutes struct {
	File    string   `json:"file"`
	Matched bool     `json:"matched"`
	Prefix  string   `json:"prefix,omitempty"`
	Queues  []string `json:"queues"`
}

type explainJob struct {
	ID int64 `json:"id"`
	// Found is false when River has deleted the job (its cleaner removes
	// finalized jobs after their retention period, 24 h by default).
	Found       bool            `json:"found"`
	Queue       string          `json:"queue,omitempty"`
	State       string          `json:"state,omitempty"`
	Attempt     int             `json:"attempt"`
	MaxAttempts int             `json:"max_attempts"`
	AttemptedBy []string        `json:"attempted_by"`
	Errors      []explainJobErr `json:"errors"`
	CreatedAt   *time.Time      `json:"created_at,omitempty"`
	ScheduledAt *time.Time      `json:"scheduled_at,omitempty"`
	AttemptedAt *time.Time      `json:"attempted_at,omitempty"`
	FinalizedAt *time.Time      `json:"finalized_at,omitempty"`
}

type explainJobErr struct {
	Attempt int       `json:"attempt"`
	At      time.Time `json:"at"`
	Error   string    `json:"error"`
}

type explainReceipt struct {
	Receiver    string          `json:"receiver"`
	State       string          `json:"state"`
	JobID       *int64          `json:"job_id"`
	Attempt     *int            `json:"attempt"`
	CreatedAt   time.Time       `json:"created_at"`
	CompletedAt *time.Time      `json:"completed_at"`
	ExpiresAt   time.Time       `json:"expires_at"`
	Result      json.RawMessage `json:"result,omitempty"`
}

const explainEventSQL = `
SELECT id, event_type, tenant_id, dispatch_key, status::text, retries, last_error,
       created_at, scheduled_at, locked_until, processed_at, coalesce(river_job_ids, '{}'), payload::text
FROM outbox_event WHERE id = $1`

// explainJobsSQL reads the jobs by primary key: the handoff recorded their
// ids in outbox_event.river_job_ids, so nothing scans river_job by args.
const explainJobsSQL = `
SELECT id, queue, state::text, attempt, max_attempts, coalesce(attempted_by, '{}'),
       coalesce(to_jsonb(errors), '[]'), created_at, scheduled_at, attempted_at, finalized_at
FROM river_job WHERE id = ANY($1::bigint[])`

const explainReceiptsSQL = `
SELECT receiver, state, job_id, attempt, created_at, completed_at, expires_at, result::text
FROM outbox_receipt WHERE event_id = $1 ORDER BY receiver`

func runExplain(ctx context.Context, c *cli, args []string) error {
	fs := c.flags("explain")
	routesFile := fs.String("routes", os.Getenv("OUTBOX_ROUTES_FILE"), "routes file, to show the routes the event matches now (default $OUTBOX_ROUTES_FILE)")
	if err := parse(fs, args); err != nil {
		return err
	}
	// The id may come before or after the flags.
	if fs.NArg() == 0 {
		return usagef("give an event id: outboxctl explain <event-id> [--json] [--routes FILE]")
	}
	idArg := fs.Arg(0)
	if err := parse(fs, fs.Args()[1:]); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q: explain takes one event id", fs.Arg(0))
	}
	id, err := strconv.ParseInt(idArg, 10, 64)
	if err != nil || id <= 0 {
		return usagef("event id %q is not a positive whole number", idArg)
	}
	var routes *route.Table
	if *routesFile != "" {
		if routes, err = route.Load(*routesFile); err != nil {
			return usagef("--routes: %v", err)
		}
	}
	pool, err := c.db(ctx)
	if err != nil {
		return err
	}
	res, err := explain(ctx, pool, id)
	if err != nil {
		return err
	}
	if routes != nil {
		r := &explainRoutes{File: *routesFile, Queues: []string{}}
		if rule, ok := routes.Match(res.Event.Type); ok {
			r.Matched, r.Prefix, r.Queues = true, rule.Prefix, rule.Queues
		}
		res.Routes = r
	}
	if c.jsonOut {
		return c.printJSON(res)
	}
	printExplain(c.stdout, res)
	return nil
}

// errEventNotFound is the message for an unknown id.
func errEventNotFound(id int64) error {
	return fmt.Errorf("event %d not found: no outbox_event row has this id (it never existed, or retention purged it after it was done)", id)
}

func explain(ctx context.Context, pool *pgxpool.Pool, id int64) (*explainResult, error) {
	res := &explainResult{Jobs: []explainJob{}, Receipts: []explainReceipt{}}
	e := &res.Event
	err := pool.QueryRow(ctx, explainEventSQL, id).Scan(&e.ID, &e.Type, &e.TenantID, &e.DispatchKey, &e.Status, &e.Retries, &e.LastError,
		&e.CreatedAt, &e.ScheduledAt, &e.LockedUntil, &e.ProcessedAt, &e.RiverJobIDs, &e.payload)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errEventNotFound(id)
	}
	if err != nil {
		return nil, fmt.Errorf("read event %d: %w", id, err)
	}
	// The payload is read as text, never decoded (a row nested deeper than
	// encoding/json accepts must still be explained); it is embedded in
	// --json output when encoding/json can carry it, else given as text.
	if raw := json.RawMessage(e.payload); json.Valid(raw) {
		e.Payload = raw
	} else {
		e.PayloadText = &e.payload
	}

	found := map[int64]explainJob{}
	if len(e.RiverJobIDs) > 0 {
		rows, err := pool.Query(ctx, explainJobsSQL, e.RiverJobIDs)
		if err != nil {
			return nil, fmt.Errorf("read River jobs %v: %w", e.RiverJobIDs, err)
		}
		for rows.Next() {
			var (
				j              = explainJob{Found: true}
				rawErrs        []byte
				created, sched time.Time
			)
			if err := rows.Scan(&j.ID, &j.Queue, &j.State, &j.Attempt, &j.MaxAttempts, &j.AttemptedBy, &rawErrs,
				&created, &sched, &j.AttemptedAt, &j.FinalizedAt); err != nil {
				rows.Close()
				return nil, fmt.Errorf("read River jobs: %w", err)
			}
			j.CreatedAt, j.ScheduledAt = &created, &sched
			j.Errors = []explainJobErr{}
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
			j = explainJob{ID: jid, AttemptedBy: []string{}, Errors: []explainJobErr{}}
		}
		res.Jobs = append(res.Jobs, j)
	}

	rows, err := pool.Query(ctx, explainReceiptsSQL, id)
	if err != nil {
		return nil, fmt.Errorf("read receipts of event %d: %w", id, err)
	}
	for rows.Next() {
		var r explainReceipt
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

func fmtTime(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05.000Z")
}

func orDash(s *string) string {
	if s == nil {
		return "-"
	}
	return *s
}

func printExplain(w io.Writer, res *explainResult) {
	e := res.Event
	// Every value from the database goes through clean (escape.go).
	fmt.Fprintf(w, "event %d  %s  status %s\n", e.ID, clean(e.Type), clean(e.Status))
	fmt.Fprintf(w, "  tenant        %s\n", clean(orDash(e.TenantID)))
	fmt.Fprintf(w, "  dispatch key  %s\n", clean(orDash(e.DispatchKey)))
	fmt.Fprintf(w, "  created       %s\n", fmtTime(&e.CreatedAt))
	if e.ProcessedAt != nil {
		fmt.Fprintf(w, "  handed off    %s  (%s after created)\n", fmtTime(e.ProcessedAt), e.ProcessedAt.Sub(e.CreatedAt).Round(time.Microsecond))
	} else {
		fmt.Fprintf(w, "  scheduled     %s\n", fmtTime(&e.ScheduledAt))
	}
	fmt.Fprintf(w, "  retries       %d\n", e.Retries)
	if e.LastError != nil {
		fmt.Fprintf(w, "  last error    %s\n", clean(*e.LastError))
	}
	payload := e.payload
	if len(payload) > 300 {
		payload = payload[:300] + "… (" + strconv.Itoa(len(e.payload)) + " bytes; --json shows all)"
	}
	fmt.Fprintf(w, "  payload       %s\n", clean(payload))

	fmt.Fprintln(w)
	switch r := res.Routes; {
	case r == nil:
		fmt.Fprintln(w, "routes: not checked (give --routes FILE or set OUTBOX_ROUTES_FILE)")
	case !r.Matched:
		fmt.Fprintf(w, "routes (%s): no rule matches %s now\n", clean(r.File), clean(e.Type))
	default:
		fmt.Fprintf(w, "routes (%s): prefix %q → %s\n", clean(r.File), r.Prefix, clean(strings.Join(r.Queues, ", ")))
	}

	fmt.Fprintln(w)
	switch {
	case len(res.Jobs) == 0 && e.Status == "done":
		fmt.Fprintln(w, "River jobs: none recorded (the event was handed off before job ids were recorded)")
	case len(res.Jobs) == 0:
		fmt.Fprintf(w, "River jobs: none (the event is %s, not handed off)\n", clean(e.Status))
	default:
		fmt.Fprintf(w, "River jobs (%d):\n", len(res.Jobs))
	}
	for _, j := range res.Jobs {
		if !j.Found {
			fmt.Fprintf(w, "  job %d  not in river_job: River deleted it after its retention period (finalized jobs are kept 24 h by default)\n", j.ID)
			continue
		}
		fmt.Fprintf(w, "  job %d  queue %s  state %s  attempt %d/%d\n", j.ID, clean(j.Queue), clean(j.State), j.Attempt, j.MaxAttempts)
		fmt.Fprintf(w, "      created %s  attempted %s  finalized %s\n", fmtTime(j.CreatedAt), fmtTime(j.AttemptedAt), fmtTime(j.FinalizedAt))
		if j.State == "retryable" || j.State == "scheduled" {
			fmt.Fprintf(w, "      next run %s\n", fmtTime(j.ScheduledAt))
		}
		if len(j.AttemptedBy) > 0 {
			fmt.Fprintf(w, "      worked by %s\n", clean(strings.Join(distinct(j.AttemptedBy), ", ")))
		}
		for _, er := range j.Errors {
			fmt.Fprintf(w, "      error, attempt %d at %s: %s\n", er.Attempt, fmtTime(&er.At), clean(firstLine(er.Error)))
		}
	}

	fmt.Fprintln(w)
	if len(res.Receipts) == 0 {
		fmt.Fprintln(w, "receipts: none (no receiver recorded an idempotent effect for this event)")
		return
	}
	fmt.Fprintf(w, "receipts (%d):\n", len(res.Receipts))
	for _, r := range res.Receipts {
		job := "-"
		if r.JobID != nil {
			job = strconv.FormatInt(*r.JobID, 10)
			if r.Attempt != nil {
				job += fmt.Sprintf(" (attempt %d)", *r.Attempt)
			}
		}
		fmt.Fprintf(w, "  %s  %s by job %s  at %s  expires %s\n", clean(r.Receiver), clean(r.State), job, fmtTime(r.CompletedAt), fmtTime(&r.ExpiresAt))
		if len(r.Result) > 0 && string(r.Result) != "null" {
			fmt.Fprintf(w, "      result %s\n", clean(string(r.Result)))
		}
	}
}

// distinct lists each worker once, in the order of their first attempt,
// with the number of attempts when it ran more than one (River's
// attempted_by has one entry per attempt; --json keeps them all).
func distinct(workers []string) []string {
	var order []string
	n := map[string]int{}
	for _, w := range workers {
		if n[w] == 0 {
			order = append(order, w)
		}
		n[w]++
	}
	for i, w := range order {
		if n[w] > 1 {
			order[i] = fmt.Sprintf("%s (%d attempts)", w, n[w])
		}
	}
	return order
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i] + " …"
	}
	return s
}
