package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/outboxhq/outbox/retention"
)

// RetentionOpts are the options of RetentionRun.
type RetentionOpts struct {
	// MaxAge: done events processed longer ago than this are deleted. At
	// least an hour (OUTBOX_DONE_RETENTION_HOURS; outbox_purge_done refuses
	// a later cutoff).
	MaxAge time.Duration
	// BatchSize is the most rows deleted per transaction, clamped to
	// 1..10000; 0 means 1000.
	BatchSize int
	// DryRun counts what a run would delete, deletes and records nothing.
	DryRun bool
	// Actor is who runs it, recorded in the audit: 1 to 256 bytes, no NUL.
	// Required.
	Actor string
	// RunBy is recorded in outbox_job_run.last_run_by; empty means
	// "admin " + Actor.
	RunBy string
}

// RetentionResult reports one retention run.
type RetentionResult struct {
	// Job is the retention job's name in outbox_job_run.
	Job string `json:"job"`
	// Deleted done events (for a dry run: that a run now would delete).
	Deleted int64 `json:"deleted"`
	// Batches committed.
	Batches int `json:"batches"`
	// Cutoff: done events processed before it were (would be) deleted.
	Cutoff time.Time `json:"cutoff"`
	DryRun bool      `json:"dry_run"`
	// ReceiptsDeleted counts receiver receipts past their TTL deleted by
	// the same run (for a dry run: that would be).
	ReceiptsDeleted int64 `json:"receipts_deleted"`
	// AuditID is the outbox_audit row of the run; 0 for a dry run.
	AuditID int64 `json:"audit_id"`
}

// CheckRetention validates opts for RetentionRun, or returns a
// *SelectionError.
func CheckRetention(opts RetentionOpts) error {
	if opts.MaxAge < time.Hour {
		return &SelectionError{Flag: "hours", Msg: fmt.Sprintf("the age must be at least an hour, got %s", opts.MaxAge)}
	}
	return checkActor(opts.Actor)
}

const auditInsertSQL = `
INSERT INTO outbox_audit (actor, action, filter, affected, detail)
VALUES ($1, $2, $3, $4, $5)
RETURNING id, at`

// RetentionRun deletes the done events processed more than opts.MaxAge ago
// now, batch by batch, under the retention job's lock (the one outboxd's
// runner takes), and records the run in the audit. It returns an error
// wrapping retention.ErrLocked when another process runs the job. A dry
// run counts instead and records nothing.
func (c *Client) RetentionRun(ctx context.Context, opts RetentionOpts) (*RetentionResult, error) {
	if err := CheckRetention(opts); err != nil {
		return nil, err
	}
	runBy := opts.RunBy
	if runBy == "" {
		runBy = "admin " + opts.Actor
	}
	cfg := retention.Config{MaxAge: opts.MaxAge, BatchSize: opts.BatchSize, RunBy: runBy}
	r, err := retention.Run(ctx, c.pool, cfg, opts.DryRun)
	if errors.Is(err, retention.ErrLocked) {
		return nil, fmt.Errorf("%w; try again when it has finished", err)
	}
	if err != nil {
		return nil, c.explain(ctx, err)
	}
	res := &RetentionResult{Job: retention.JobName, Deleted: r.Deleted, Batches: r.Batches, Cutoff: r.Cutoff,
		DryRun: r.DryRun, ReceiptsDeleted: r.ReceiptsDeleted}
	if opts.DryRun {
		return res, nil
	}
	filterJSON, err := json.Marshal(map[string]any{"hours": opts.MaxAge.Hours(), "batch_size": retention.ClampBatchSize(opts.BatchSize)})
	if err != nil {
		return nil, err
	}
	detailJSON, err := json.Marshal(map[string]any{"batches": r.Batches, "cutoff": r.Cutoff})
	if err != nil {
		return nil, err
	}
	var at time.Time
	if err := c.pool.QueryRow(ctx, auditInsertSQL, opts.Actor, "retention", filterJSON, r.Deleted, detailJSON).Scan(&res.AuditID, &at); err != nil {
		return nil, c.explain(ctx, fmt.Errorf("retention deleted %d rows but the audit row failed: %w", r.Deleted, err))
	}
	return res, nil
}
