package main

// keys and unpark: flags and rendering; admin.Client.Keys and Unpark do
// the work.

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/plural"
)

func runKeys(ctx context.Context, c *cli, args []string) error {
	fs := c.opsFlags("keys")
	tenant := fs.String("tenant", "", "tenant id (exact)")
	key := fs.String("key", "", "ordering key (exact)")
	queue := fs.String("queue", "", "River queue (exact); leaves out keys held in the outbox")
	parked := fs.Bool("parked", false, "parked keys only")
	limit := fs.Int("limit", admin.DefaultKeysLimit, fmt.Sprintf("most keys listed (1..%d)", admin.MaxKeysLimit))
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	if *limit == 0 {
		return usagef("--limit: 0 is out of range: use 1 to %d", admin.MaxKeysLimit)
	}
	f := admin.KeysFilter{Tenant: *tenant, Key: *key, Queue: *queue, ParkedOnly: *parked, Limit: *limit}
	if _, err := admin.CheckKeys(f); err != nil {
		return err
	}
	cl, err := c.admin(ctx)
	if err != nil {
		return err
	}
	res, err := cl.Keys(ctx, f)
	if err != nil {
		return err
	}
	if c.jsonOut {
		return c.printJSON(res)
	}
	printKeys(c.stdout, res)
	return nil
}

// printKeys prints one row per key, oldest first. Keys, tenants, queues
// and errors come from producers and workers: every one goes through clean.
func printKeys(w io.Writer, res *admin.KeyList) {
	if len(res.Keys) == 0 {
		fmt.Fprintln(w, "no ordering key waits for an operator")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SINCE\tKIND\tTENANT\tKEY\tQUEUE\tHEAD\tWAITING\tOLDEST WAIT\tLAST ERROR")
	for _, k := range res.Keys {
		kind := k.Kind
		if k.ParkedState != "" {
			kind += " (" + k.ParkedState + ")"
		}
		queue := k.Queue
		if queue == "" {
			queue = "(outbox)"
		}
		lastErr := "-"
		if k.Head.LastError != nil {
			lastErr = truncate(firstLine(*k.Head.LastError), 80)
		}
		wait := "-"
		if k.OldestWaitingSince != nil {
			wait = (time.Duration(k.OldestWaitingAgeS * float64(time.Second))).Round(time.Second).String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", fmtTime(&k.Since), kind, clean(orDash(k.TenantID)), clean(k.OrderingKey),
			clean(queue), headText(k), k.Waiting, wait, clean(lastErr))
	}
	_ = tw.Flush()
	if res.More {
		fmt.Fprintf(w, "more keys match beyond --limit=%d: narrow with --tenant, --key or --queue, or raise --limit\n", res.Filter.Limit)
	}
	fmt.Fprintln(w, "parked: outboxctl unpark --key K [--tenant T] --retry|--skip; held in the outbox: requeue or cancel the failed event (--id)")
}

// headText names what holds a key: the head job and its event, or the
// failed event in the outbox.
func headText(k admin.KeyAttention) string {
	event := "-"
	if k.Head.EventID != nil {
		event = strconv.FormatInt(*k.Head.EventID, 10)
	}
	if k.Head.JobID == nil {
		return fmt.Sprintf("event %s %s (%s)", event, k.Head.State, plural.Of(k.Head.Attempt, "attempt", "attempts"))
	}
	if !k.Head.JobFound {
		return fmt.Sprintf("job %d (event %s) gone", *k.Head.JobID, event)
	}
	return fmt.Sprintf("job %d (event %s) %s %d/%d", *k.Head.JobID, event, clean(k.Head.State), k.Head.Attempt, k.Head.MaxAttempts)
}

// truncate cuts s to at most n bytes on a rune boundary, marking the cut;
// a shorter s is returned as it is.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && s[n]&0xC0 == 0x80 {
		n--
	}
	return s[:n] + "…"
}

func runUnpark(ctx context.Context, c *cli, args []string) error {
	fs := c.opsFlags("unpark")
	key := fs.String("key", "", "the parked ordering key (required)")
	tenant := fs.String("tenant", "", "its tenant (omit for events without one)")
	queue := fs.String("queue", "", "unpark in this River queue only (default: every queue where the key is parked)")
	retry := fs.Bool("retry", false, "run the parked head job again (one more attempt if it had none left)")
	skip := fs.Bool("skip", false, "leave the parked head job as it is and release the next job of the key")
	dryRun := fs.Bool("dry-run", false, "report what would change, change nothing")
	reason := fs.String("reason", "", "why, recorded in the audit")
	actor := fs.String("actor", defaultActor(), "who runs this, recorded in the audit (default: the OS user)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	var action string
	switch {
	case *retry && *skip:
		return usagef("give one of --retry and --skip, not both")
	case *retry:
		action = admin.UnparkRetry
	case *skip:
		action = admin.UnparkSkip
	default:
		return usagef("give --retry (run the parked head job again) or --skip (leave it and release the next job of the key)")
	}
	req := admin.UnparkRequest{Actor: *actor, Key: *key, Tenant: *tenant, Queue: *queue, Action: action, DryRun: *dryRun, Reason: *reason}
	// Refuse a bad request before connecting (exit 2).
	if err := admin.CheckUnpark(req); err != nil {
		return err
	}
	cl, err := c.admin(ctx)
	if err != nil {
		return err
	}
	res, err := cl.Unpark(ctx, req)
	if err != nil {
		return err
	}
	if c.jsonOut {
		return c.printJSON(res)
	}
	printUnpark(c.stdout, res)
	return nil
}

func printUnpark(w io.Writer, r *admin.UnparkResult) {
	verb := map[string]string{admin.UnparkRetry: "retried", admin.UnparkSkip: "skipped"}[r.Request.Action]
	if r.Request.DryRun {
		verb = "would be " + verb
	}
	who := ""
	if r.Request.Tenant != "" {
		who = " of tenant " + clean(r.Request.Tenant)
	}
	fmt.Fprintf(w, "key %s%s: the parked head %s in %s\n", clean(r.Request.Key), who, verb, plural.Of(len(r.Keys), "queue", "queues"))
	for _, k := range r.Keys {
		event := "-"
		if k.HeadEventID != nil {
			event = strconv.FormatInt(*k.HeadEventID, 10)
		}
		fmt.Fprintf(w, "  %s  head job %d (event %s) %s, %s waiting\n", clean(k.Queue), k.HeadJobID, event, clean(k.ParkedState), plural.Of(k.Waiting, "job", "jobs"))
	}
	if r.Request.DryRun {
		fmt.Fprintln(w, "dry run: nothing changed, nothing recorded")
	} else {
		fmt.Fprintf(w, "recorded as audit #%d by %s\n", r.AuditID, clean(r.Request.Actor))
	}
}
