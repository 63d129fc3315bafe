package main

// explain: flags and rendering; admin.Client.Explain does the work.

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/plural"
	"github.com/outboxhq/outbox/route"
)

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
	opts := admin.ExplainOpts{RoutesFile: *routesFile}
	if *routesFile != "" {
		if opts.Routes, err = route.Load(*routesFile); err != nil {
			return usagef("--routes: %v", err)
		}
	}
	cl, err := c.admin(ctx)
	if err != nil {
		return err
	}
	res, err := cl.Explain(ctx, id, opts)
	if err != nil {
		return err
	}
	if c.jsonOut {
		return c.printJSON(res)
	}
	printExplain(c.stdout, res)
	return nil
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

func printExplain(w io.Writer, res *admin.Explanation) {
	e := res.Event
	// Every value from the database goes through clean (escape.go).
	fmt.Fprintf(w, "event %d  %s  status %s\n", e.ID, clean(e.Type), clean(e.Status))
	fmt.Fprintf(w, "  tenant        %s\n", clean(orDash(e.TenantID)))
	fmt.Fprintf(w, "  dispatch key  %s\n", clean(orDash(e.DispatchKey)))
	if e.OrderingKey != nil && e.OrderingPosition != nil {
		fmt.Fprintf(w, "  ordering key  %s  position %d\n", clean(*e.OrderingKey), *e.OrderingPosition)
	}
	fmt.Fprintf(w, "  created       %s\n", fmtTime(&e.CreatedAt))
	if e.ProcessedAt != nil {
		fmt.Fprintf(w, "  handed off    %s  (%s after created)\n", fmtTime(e.ProcessedAt), e.ProcessedAt.Sub(e.CreatedAt).Round(time.Microsecond))
	} else {
		fmt.Fprintf(w, "  scheduled     %s\n", fmtTime(&e.ScheduledAt))
		if e.HeldFrom != nil {
			fmt.Fprintf(w, "  held from     %s  (its own due time; moved to wait for an earlier event of its key)\n", fmtTime(e.HeldFrom))
		}
	}
	fmt.Fprintf(w, "  retries       %d\n", e.Retries)
	if e.LastError != nil {
		fmt.Fprintf(w, "  last error    %s\n", clean(*e.LastError))
	}
	// The payload as stored: embedded JSON, or the text encoding/json
	// could not carry.
	stored := string(e.Payload)
	if e.PayloadText != nil {
		stored = *e.PayloadText
	}
	payload := stored
	if len(payload) > 300 {
		payload = payload[:300] + "… (" + strconv.Itoa(len(stored)) + " bytes; --json shows all)"
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
			fmt.Fprintf(w, "  job %d  %s\n", j.ID, clean(j.MissingNote))
			continue
		}
		fmt.Fprintf(w, "  job %d  queue %s  state %s  attempt %d/%d\n", j.ID, clean(j.Queue), clean(j.State), j.Attempt, j.MaxAttempts)
		if j.InLine {
			fmt.Fprintln(w, "      waits in its key's line, not in River yet: River inserts it with this id when its turn comes")
		}
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

	if res.Ordering != nil {
		fmt.Fprintln(w)
		printOrdering(w, e, res.Ordering)
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

// printOrdering says what a keyed event waits for: in the outbox, the
// earlier unfinished events of its key; in River, per queue, the key's head.
func printOrdering(w io.Writer, e admin.EventDetail, o *admin.OrderingDetail) {
	fmt.Fprintf(w, "order of key %s (position %d):\n", clean(o.Key), o.Position)
	switch {
	case e.Status == "done" || e.Status == "cancelled":
		fmt.Fprintf(w, "  outbox: %s; nothing waits for it there\n", map[string]string{"done": "handed off", "cancelled": "cancelled"}[e.Status])
	case o.WaitsFor != nil:
		verb := "waits"
		if e.Status == "failed" {
			verb = "would wait, if requeued,"
		}
		fmt.Fprintf(w, "  outbox: %s for event %d (%s), the nearest of %s of its key still unfinished\n",
			verb, o.WaitsFor.ID, clean(o.WaitsFor.Status), plural.Of(o.EarlierUnfinished, "earlier event", "earlier events"))
		if f := o.FirstFailed; f != nil {
			fmt.Fprintf(w, "  outbox: event %d failed (dead-lettered) and holds the key: requeue it (outboxctl requeue --id %d) or cancel it (outboxctl cancel --id %d)\n", f.ID, f.ID, f.ID)
		}
	default:
		fmt.Fprintln(w, "  outbox: no earlier event of its key is unfinished: nothing holds it back")
	}
	for _, q := range o.Queues {
		fmt.Fprintf(w, "  queue %s: job %d %s: %s\n", clean(q.Queue), q.JobID, clean(q.JobState), clean(q.Note))
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
