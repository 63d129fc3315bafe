package main

// requeue and cancel: flags and rendering; admin.Client.Requeue and Cancel
// do the work.

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/filter"
	"github.com/outboxhq/outbox/internal/plural"
)

// stuckNote explains which processing events requeue and cancel take.
const stuckNote = "only stuck ones: a NULL or past locked_until; one a dispatcher holds right now is skipped"

func runRequeue(ctx context.Context, c *cli, args []string) error {
	return runChange(ctx, c, "requeue", args)
}

func runCancel(ctx context.Context, c *cli, args []string) error {
	return runChange(ctx, c, "cancel", args)
}

// runChange parses the selection flags of requeue or cancel, runs the
// action and prints its result.
func runChange(ctx context.Context, c *cli, action string, args []string) error {
	fs := c.opsFlags(action)
	rules, rulesAll := admin.CancelStatuses(), admin.CancelStatuses()
	if action == "requeue" {
		rules, rulesAll = admin.RequeueStatuses(false), admin.RequeueStatuses(true)
	}
	var ids, statuses listFlag
	fs.Var(&ids, "id", "event id; repeatable, or comma-separated")
	fs.Var(&statuses, "status", "status to select, comma-separated ("+strings.Join(rulesAll.Eligible, ", ")+"); default "+strings.Join(rules.Default, ",")+" ("+strings.Join(rules.DefaultByID, ",")+" with --id); processing: "+stuckNote)
	typePrefix := fs.String("type-prefix", "", "event types starting with this (e.g. mail. or billing.invoice.)")
	tenant := fs.String("tenant", "", "tenant id (exact)")
	since := fs.String("since", "", "created at or after: RFC 3339, a date, or an age (2h, 3d)")
	until := fs.String("until", "", "created before: RFC 3339, a date, or an age (2h, 3d)")
	errContains := fs.String("error-contains", "", "last_error contains this text (case-sensitive)")
	limit := fs.Int("limit", admin.DefaultLimit, fmt.Sprintf("most events changed per run (1..%d)", admin.MaxLimit))
	all := fs.Bool("all", false, "allow a selection by status alone (every failed event)")
	dryRun := fs.Bool("dry-run", false, "report what would change, change nothing")
	actor := fs.String("actor", defaultActor(), "who runs this, recorded in the audit (default: the OS user)")
	allowReplay := new(bool)
	if action == "requeue" {
		allowReplay = fs.Bool("allow-replay", false, "allow requeueing done events (receivers get them again)")
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q (flags go before nothing else; see --help)", fs.Arg(0))
	}

	sel := admin.Selection{TypePrefix: *typePrefix, Tenant: *tenant, ErrorContains: *errContains, Limit: *limit, All: *all}
	if *limit == 0 {
		return usagef("--limit: 0 is out of range: use 1 to %d", admin.MaxLimit)
	}
	for _, v := range ids {
		got, err := filter.ParseIDs(v)
		if err != nil {
			return &usageError{err.Error()}
		}
		sel.IDs = append(sel.IDs, got...)
	}
	for _, v := range statuses {
		got, err := filter.ParseStatuses(v)
		if err != nil {
			return &usageError{err.Error()}
		}
		for _, s := range got {
			if !slices.Contains(sel.Statuses, s) {
				sel.Statuses = append(sel.Statuses, s)
			}
		}
	}
	now := time.Now()
	for _, tf := range []struct {
		name string
		v    string
		dst  **time.Time
	}{{"since", *since, &sel.Since}, {"until", *until, &sel.Until}} {
		if tf.v == "" {
			continue
		}
		t, err := filter.ParseTime(tf.name, tf.v, now)
		if err != nil {
			return &usageError{err.Error()}
		}
		*tf.dst = &t
	}
	// Refuse a bad selection before connecting (exit 2).
	requeueOpts := admin.RequeueOpts{Actor: *actor, DryRun: *dryRun, AllowReplay: *allowReplay}
	cancelOpts := admin.CancelOpts{Actor: *actor, DryRun: *dryRun}
	var err error
	if action == "requeue" {
		_, err = admin.CheckRequeue(sel, requeueOpts)
	} else {
		_, err = admin.CheckCancel(sel, cancelOpts)
	}
	if err != nil {
		return err
	}

	cl, err := c.admin(ctx)
	if err != nil {
		return err
	}
	var res *admin.ChangeResult
	if action == "requeue" {
		res, err = cl.Requeue(ctx, sel, requeueOpts)
	} else {
		res, err = cl.Cancel(ctx, sel, cancelOpts)
	}
	if err != nil {
		return err
	}
	if res.Warning != "" {
		fmt.Fprintf(c.stderr, "outboxctl %s: warning: %s\n", action, res.Warning)
	}
	if c.jsonOut {
		return c.printJSON(res)
	}
	printChange(c.stdout, res)
	return nil
}

func printChange(w io.Writer, r *admin.ChangeResult) {
	verb := map[string]string{"requeue": "requeued", "cancel": "cancelled"}[r.Action]
	if r.DryRun {
		verb = "would be " + verb
	}
	fmt.Fprintf(w, "%s %s", plural.Of(r.Affected, "event", "events"), verb)
	if len(r.From) > 0 {
		fmt.Fprintf(w, " (from %s)", formatCounts(r.From))
	}
	fmt.Fprintln(w)
	if len(r.IDs) > 0 {
		shown := r.IDs[:min(len(r.IDs), 20)]
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
		fmt.Fprintf(w, "%d more match beyond --limit=%d or were locked: run again to continue\n", r.Remaining, r.Selection.Limit)
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
