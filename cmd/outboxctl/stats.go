package main

// stats: flags and rendering; admin.Client.Stats does the work.

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/config"
	"github.com/outboxhq/outbox/internal/filter"
	"github.com/outboxhq/outbox/internal/plural"
	"github.com/outboxhq/outbox/route"
)

func runStats(ctx context.Context, c *cli, args []string) error {
	fs := c.opsFlags("stats")
	def := admin.DefaultThresholds()
	check := fs.Bool("check", false, "exit 1 when an alert threshold is crossed (for cron and probes)")
	stalledAfter := fs.Duration("stalled-after", admin.DefaultStalledAfter, "a River job running longer than this is stalled")
	routesFile := fs.String("routes", os.Getenv("OUTBOX_ROUTES_FILE"), "routes file, to list routes whose queue no worker works (default $OUTBOX_ROUTES_FILE)")
	worked := fs.String("worked-queues", os.Getenv("OUTBOX_WORKED_QUEUES"), "comma-separated River queues that some worker group works (default $OUTBOX_WORKED_QUEUES)")
	maxBehind := fs.Int64("max-behind", def.MaxBehind, "alert when more pending events than this are due for over 60s")
	maxStalled := fs.Int64("max-stalled", def.MaxStalled, "alert when more River jobs than this are stalled")
	maxFailed := fs.Int64("max-failed", def.MaxFailed, "alert when more events than this are failed (dead-lettered or unroutable); the default 0 alerts on any; -1: off")
	maxDiscarded := fs.Int64("max-discarded", def.MaxDiscarded, "alert when more outbox River jobs than this are discarded (-1: off)")
	maxParked := fs.Int64("max-parked", def.MaxParked, "alert when more ordering keys than this are parked; the default 0 alerts on any (list them with outboxctl keys); -1: off")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	if *stalledAfter <= 0 {
		return usagef("--stalled-after must be positive, got %s", *stalledAfter)
	}
	opts := admin.StatsOpts{StalledAfter: *stalledAfter,
		Thresholds: admin.Thresholds{MaxBehind: *maxBehind, MaxStalled: *maxStalled, MaxFailed: *maxFailed, MaxDiscarded: *maxDiscarded, MaxParked: *maxParked}}
	if *routesFile != "" {
		var err error
		if opts.Routes, err = route.Load(*routesFile); err != nil {
			return usagef("--routes: %v", err)
		}
	}
	if strings.TrimSpace(*worked) != "" {
		opts.WorkedQueues, opts.WorkedQueuesSource = []string{}, "--worked-queues"
		for q := range strings.SplitSeq(*worked, ",") {
			if q = strings.TrimSpace(q); q != "" {
				if err := route.ValidateQueueName(q); err != nil {
					return usagef("--worked-queues: %v", err)
				}
				opts.WorkedQueues = append(opts.WorkedQueues, q)
			}
		}
	}

	cl, err := c.admin(ctx)
	if err != nil {
		return err
	}
	// Without an explicit list, the worked queues come from the declared
	// worker groups (OUTBOX_WORKER_GROUPS), else (admin.StatsOpts) from the
	// queues River workers have reported recently in river_queue.
	if opts.WorkedQueues == nil && opts.Routes != nil {
		if spec := os.Getenv("OUTBOX_WORKER_GROUPS"); strings.TrimSpace(spec) != "" {
			groups, err := config.ParseGroups(spec)
			if err != nil {
				return usagef("OUTBOX_WORKER_GROUPS: %v", err)
			}
			opts.WorkedQueues, opts.WorkedQueuesSource = []string{}, "OUTBOX_WORKER_GROUPS"
			for _, g := range groups {
				opts.WorkedQueues = append(opts.WorkedQueues, g.QueueNames()...)
			}
		}
	}
	res, err := cl.Stats(ctx, opts)
	if err != nil {
		return err
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

func printStats(w io.Writer, r *admin.Stats) {
	fmt.Fprintf(w, "events: ")
	var parts []string
	for _, s := range filter.Statuses {
		parts = append(parts, fmt.Sprintf("%s %d", s, r.Events[s]))
	}
	fmt.Fprintln(w, strings.Join(parts, ", "))
	fmt.Fprintf(w, "pending: %d due, %d scheduled", r.PendingDue, r.PendingScheduled)
	if r.PendingHeld > 0 {
		fmt.Fprintf(w, " (%d of them held for their ordering key)", r.PendingHeld)
	}
	if r.NextScheduledDueAt != nil {
		fmt.Fprintf(w, " (next due %s)", r.NextScheduledDueAt.UTC().Format(time.RFC3339))
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "oldest due pending: %.1fs; pending due for more than 60s: %d\n", r.OldestDuePendingAgeS, r.PendingDueOver60s)
	printOrderingStats(w, r.Ordering)
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

// printOrderingStats prints the ordering keys' line: one short line when
// ordering is unused.
func printOrderingStats(w io.Writer, o admin.OrderingStats) {
	if o.Keys == 0 && o.HeldKeys == 0 {
		fmt.Fprintln(w, "ordering keys: none in flight")
		return
	}
	fmt.Fprintf(w, "ordering keys: %d in flight, %d parked (%d discarded, %d cancelled, %d deleted); %s waiting (%d behind parked keys); oldest wait %.1fs (behind a parked key %.1fs)\n",
		o.Keys, o.Parked, o.ParkedByState["discarded"], o.ParkedByState["cancelled"], o.ParkedByState["deleted"],
		plural.Of(o.Waiting, "job", "jobs"), o.WaitingParked, o.OldestWaitS, o.OldestParkedWaitS)
	if o.HeldKeys > 0 {
		fmt.Fprintf(w, "ordering keys held in the outbox behind a failed event: %d (requeue or cancel the failed event)\n", o.HeldKeys)
	}
}
