package main

// retention run: flags and rendering; admin.Client.RetentionRun does the
// work.

import (
	"context"
	"fmt"
	"time"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/plural"
	"github.com/outboxhq/outbox/retention"
)

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
	opts := admin.RetentionOpts{MaxAge: time.Duration(*hours) * time.Hour, BatchSize: *batch, DryRun: *dryRun,
		Actor: *actor, RunBy: "outboxctl " + *actor}
	if err := admin.CheckRetention(opts); err != nil {
		return err
	}
	cl, err := c.admin(ctx)
	if err != nil {
		return err
	}
	res, err := cl.RetentionRun(ctx, opts)
	if err != nil {
		return err
	}
	if c.jsonOut {
		return c.printJSON(map[string]any{"job": res.Job, "deleted": res.Deleted, "batches": res.Batches,
			"cutoff": res.Cutoff, "dry_run": res.DryRun, "audit_id": res.AuditID})
	}
	if res.DryRun {
		fmt.Fprintf(c.stdout, "dry run: %s processed before %s would be deleted; nothing changed\n", plural.Of(res.Deleted, "done event", "done events"), res.Cutoff.Format(time.RFC3339))
		return nil
	}
	fmt.Fprintf(c.stdout, "deleted %s processed before %s in %s; recorded as audit #%d\n",
		plural.Of(res.Deleted, "done event", "done events"), res.Cutoff.Format(time.RFC3339), plural.Of(res.Batches, "batch", "batches"), res.AuditID)
	return nil
}
