// Package retention purges old done outbox events: the daily job
// "outbox-done-retention".
//
// It deletes rows with status done whose processed_at is older than MaxAge,
// in batches of at most BatchSize rows (clamped to 1..10000), each batch its
// own short transaction that locks its rows with FOR UPDATE SKIP LOCKED, so a
// large first run drains gradually and never waits on (or blocks) the
// dispatcher. failed and cancelled rows are never deleted: they wait for an
// operator. Deleting a done row releases its dispatch_key: a producer that
// publishes the same key afterwards creates a new event.
//
// One process at a time: every run, from any number of outboxd instances or
// from `outboxctl retention run`, first takes a session advisory lock on a
// dedicated connection (pg_try_advisory_lock); a run that finds the lock held
// is skipped with ErrLocked. The Runner, which outboxd starts, wakes every
// CheckInterval, and under the lock runs only when the last finished run
// recorded in outbox_job_run is older than Interval (a day), so the cadence
// survives restarts and is shared by all instances.
package retention

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/service"
)

// JobName is the job's name in outbox_job_run, in logs and in the audit.
const JobName = "outbox-done-retention"

// Batch size bounds (OUTBOX_DONE_RETENTION_BATCH_SIZE is clamped to them).
const (
	MinBatchSize     = 1
	MaxBatchSize     = 10000
	DefaultBatchSize = 1000
)

// lockClass is the first key of the job's advisory lock; the second is
// derived from the schema that holds outbox_event, so several outbox
// schemas run their own.
const lockClass = 1868720217

// ErrLocked means another process is running the job right now.
var ErrLocked = errors.New("retention: another process is running " + JobName + " (advisory lock held); this run was skipped")

// Config configures Run and the Runner.
type Config struct {
	// MaxAge: done rows whose processed_at is older are deleted. Required
	// (OUTBOX_DONE_RETENTION_HOURS).
	MaxAge time.Duration
	// BatchSize is the most rows deleted per transaction, clamped to
	// 1..10000. 0 means 1000.
	BatchSize int
	// Pause between batches, to leave the database breathing room on a
	// large first run. 0 means none.
	Pause time.Duration
	// BatchTimeout bounds one batch. 0 means 60 s.
	BatchTimeout time.Duration
	// RunBy is recorded in outbox_job_run.last_run_by ("outboxd 123@host").
	RunBy string
	// Logger; nil discards.
	Logger *slog.Logger
	// OnBatch, if set, is called after each committed batch with the rows
	// it deleted (tests, metrics). It must be quick.
	OnBatch func(deleted int)

	// beforeCommit is a test hook run inside each batch transaction, after
	// the delete and before the commit.
	beforeCommit func()
}

// ClampBatchSize applies the 1..10000 clamp (0 means the default).
func ClampBatchSize(n int) int {
	if n == 0 {
		return DefaultBatchSize
	}
	return min(max(n, MinBatchSize), MaxBatchSize)
}

func (c *Config) setDefaults() error {
	if c.MaxAge <= 0 {
		return fmt.Errorf("retention: MaxAge must be positive (OUTBOX_DONE_RETENTION_HOURS), got %s", c.MaxAge)
	}
	c.BatchSize = ClampBatchSize(c.BatchSize)
	if c.BatchTimeout <= 0 {
		c.BatchTimeout = 60 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Result reports one run.
type Result struct {
	// Deleted rows (for a dry run: rows that a run now would delete).
	Deleted int64 `json:"deleted"`
	// Batches committed.
	Batches int `json:"batches"`
	// Cutoff: done rows processed before it were (would be) deleted.
	Cutoff time.Time `json:"cutoff"`
	// DryRun is true when nothing was deleted on purpose.
	DryRun bool `json:"dry_run"`
	// ReceiptsDeleted counts receiver receipts and claims past their TTL
	// (outbox_receipt) deleted by the same run (for a dry run: that would be).
	ReceiptsDeleted int64 `json:"receipts_deleted"`
}

// deleteBatchSQL deletes one batch through outbox_purge_done (migration
// 007), a SECURITY DEFINER function, so that neither outbox_dispatcher nor
// outbox_operator needs DELETE on outbox_event (a grant that could not be
// limited to done rows). Its CTE picks the oldest done rows past the cutoff
// through the partial index outbox_event_done_idx and locks them with SKIP
// LOCKED (a row an operator is requeueing right now is left for the next
// run); LIMIT in the CTE bounds the batch exactly. The status is part of the
// predicate, so failed and cancelled rows can never match.
const deleteBatchSQL = `SELECT outbox_purge_done($1, $2)`

// purgeReceiptsSQL deletes one batch of expired receipts through
// outbox_purge_receipts (migration 007; the statement is
// the one outboxriver.PurgeReceipts runs), so the operator needs no DELETE on
// outbox_receipt.
const purgeReceiptsSQL = `SELECT outbox_purge_receipts($1)`

// countSQL counts what a run would delete (the dry run), with the same
// predicate as deleteBatchSQL.
const countSQL = `SELECT count(*) FROM outbox_event WHERE status = 'done' AND processed_at < $1`

// cutoffSQL takes the cutoff from the database's clock, like every other
// time in the outbox.
const cutoffSQL = `SELECT now() - make_interval(secs => $1)`

// tableSchemaSQL names the schema that holds the outbox_event this
// connection resolves: the lock key follows the table, not
// current_schema(), which is the first existing schema of the search_path
// (a "$user" schema that holds no outbox tables would give every run its
// own key, and two runs on one table would both delete).
const tableSchemaSQL = `(SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = 'outbox_event'::regclass)`

const lockSQL = `SELECT pg_try_advisory_lock($1, hashtext('outbox_retention:' || ` + tableSchemaSQL + `))`
const unlockSQL = `SELECT pg_advisory_unlock($1, hashtext('outbox_retention:' || ` + tableSchemaSQL + `))`

// holderSQL names the backend that holds the lock, for the error message.
const holderSQL = `
SELECT coalesce(a.application_name, '') || ' pid ' || l.pid || coalesce(' from ' || host(a.client_addr), '')
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1::int::oid
  AND l.objid = hashtext('outbox_retention:' || ` + tableSchemaSQL + `)::oid AND l.objsubid = 2
LIMIT 1`

const markStartedSQL = `
INSERT INTO outbox_job_run (name, last_started_at, last_run_by) VALUES ($1, now(), $2)
ON CONFLICT (name) DO UPDATE SET last_started_at = now(), last_run_by = $2`

const markFinishedSQL = `
UPDATE outbox_job_run SET last_finished_at = CASE WHEN $3::text IS NULL THEN now() ELSE last_finished_at END,
    last_affected = $2, last_error = $3
WHERE name = $1`

// dueSQL reports whether the last finished run is older than $2 seconds
// (or there was none).
const dueSQL = `
SELECT NOT EXISTS (SELECT 1 FROM outbox_job_run
                   WHERE name = $1 AND last_finished_at > now() - make_interval(secs => $2))`

// Lock is the job's advisory lock, held on a dedicated connection (a
// session lock must stay on the connection that took it; a pooled
// connection could be handed to someone else).
type Lock struct {
	conn *pgx.Conn
}

// TryLock opens a dedicated connection with pool's settings and tries the
// job's lock. It returns ErrLocked (with the holder) when another process
// holds it. Release the lock with Unlock.
func TryLock(ctx context.Context, pool *pgxpool.Pool) (*Lock, error) {
	conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		return nil, fmt.Errorf("retention: connect for the job lock: %w", err)
	}
	var got bool
	if err := conn.QueryRow(ctx, lockSQL, lockClass).Scan(&got); err != nil {
		_ = conn.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("retention: take the job lock: %w", err)
	}
	if !got {
		var holder string
		_ = conn.QueryRow(ctx, holderSQL, lockClass).Scan(&holder)
		_ = conn.Close(context.WithoutCancel(ctx))
		if holder != "" {
			return nil, fmt.Errorf("%w; held by %s", ErrLocked, holder)
		}
		return nil, ErrLocked
	}
	return &Lock{conn: conn}, nil
}

// Unlock releases the lock and closes its connection. Closing the session
// releases the lock even if the unlock statement fails.
func (l *Lock) Unlock(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	uctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, _ = l.conn.Exec(uctx, unlockSQL, lockClass)
	_ = l.conn.Close(uctx)
}

// Run takes the job's lock and deletes every done row older than
// cfg.MaxAge, batch by batch. It returns ErrLocked when another process
// runs the job. With dryRun it counts instead (under the lock as well, so
// its number is what a run now would delete). Cancelling ctx stops after
// the batch in flight; the rows deleted so far stay deleted.
func Run(ctx context.Context, pool *pgxpool.Pool, cfg Config, dryRun bool) (Result, error) {
	if err := cfg.setDefaults(); err != nil {
		return Result{}, err
	}
	lock, err := TryLock(ctx, pool)
	if err != nil {
		return Result{}, err
	}
	defer lock.Unlock(ctx)
	return runLocked(ctx, pool, &cfg, dryRun)
}

func runLocked(ctx context.Context, pool *pgxpool.Pool, cfg *Config, dryRun bool) (Result, error) {
	res := Result{DryRun: dryRun}
	if err := pool.QueryRow(ctx, cutoffSQL, cfg.MaxAge.Seconds()).Scan(&res.Cutoff); err != nil {
		return res, fmt.Errorf("retention: read the cutoff: %w", err)
	}
	if dryRun {
		if err := pool.QueryRow(ctx, countSQL, res.Cutoff).Scan(&res.Deleted); err != nil {
			return res, fmt.Errorf("retention: count: %w", err)
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_receipt WHERE expires_at < now()`).Scan(&res.ReceiptsDeleted); err != nil {
			return res, fmt.Errorf("retention: count expired receipts: %w", err)
		}
		return res, nil
	}

	if _, err := pool.Exec(ctx, markStartedSQL, JobName, cfg.RunBy); err != nil {
		return res, fmt.Errorf("retention: record the start in outbox_job_run: %w", err)
	}
	cfg.Logger.InfoContext(ctx, "retention run started", slog.String("job", JobName),
		slog.Time("cutoff", res.Cutoff), slog.Int("batch_size", cfg.BatchSize))
	started := time.Now()
	runErr := deleteAll(ctx, pool, cfg, &res)
	if runErr == nil {
		runErr = purgeReceipts(ctx, pool, cfg, &res)
	}

	var errText *string
	if runErr != nil {
		s := runErr.Error()
		errText = &s
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if _, err := pool.Exec(fctx, markFinishedSQL, JobName, res.Deleted, errText); err != nil && runErr == nil {
		runErr = fmt.Errorf("retention: record the end in outbox_job_run: %w", err)
	}
	level := slog.LevelInfo
	attrs := []slog.Attr{slog.String("job", JobName), slog.Int64("deleted", res.Deleted),
		slog.Int("batches", res.Batches), slog.Duration("took", time.Since(started))}
	if runErr != nil {
		level = slog.LevelError
		attrs = append(attrs, slog.String("error", runErr.Error()))
	}
	cfg.Logger.LogAttrs(ctx, level, "retention run finished", attrs...)
	return res, runErr
}

// purgeReceipts deletes receiver receipts past their TTL, batch by batch
// (what outboxriver.PurgeReceipts does, through purgeReceiptsSQL).
func purgeReceipts(ctx context.Context, pool *pgxpool.Pool, cfg *Config, res *Result) error {
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("retention: stopped purging receipts after %d rows: %w", res.ReceiptsDeleted, err)
		}
		bctx, cancel := context.WithTimeout(ctx, cfg.BatchTimeout)
		var n int64
		err := pool.QueryRow(bctx, purgeReceiptsSQL, cfg.BatchSize).Scan(&n)
		cancel()
		if err != nil {
			return fmt.Errorf("retention: purge receipts: %w", err)
		}
		res.ReceiptsDeleted += n
		if n < int64(cfg.BatchSize) {
			return nil
		}
	}
}

func deleteAll(ctx context.Context, pool *pgxpool.Pool, cfg *Config, res *Result) error {
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("retention: stopped after %d rows: %w", res.Deleted, err)
		}
		n, err := deleteBatch(ctx, pool, cfg, res.Cutoff)
		if err != nil {
			return fmt.Errorf("retention: batch %d (after %d rows): %w", res.Batches+1, res.Deleted, err)
		}
		if n == 0 {
			return nil
		}
		res.Deleted += n
		res.Batches++
		if cfg.OnBatch != nil {
			cfg.OnBatch(int(n))
		}
		if n < int64(cfg.BatchSize) {
			// A short batch: nothing older is left, except rows locked by
			// someone else right now, which the next run takes.
			return nil
		}
		if cfg.Pause > 0 {
			select {
			case <-time.After(cfg.Pause):
			case <-ctx.Done():
			}
		}
	}
}

func deleteBatch(ctx context.Context, pool *pgxpool.Pool, cfg *Config, cutoff time.Time) (int64, error) {
	bctx, cancel := context.WithTimeout(ctx, cfg.BatchTimeout)
	defer cancel()
	var n int64
	err := pgx.BeginFunc(bctx, pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(bctx, deleteBatchSQL, cutoff, cfg.BatchSize).Scan(&n); err != nil {
			return err
		}
		if cfg.beforeCommit != nil {
			cfg.beforeCommit()
		}
		return nil
	})
	return n, err
}

// RunnerConfig configures a Runner.
type RunnerConfig struct {
	Config
	// Interval between runs across all instances. 0 means 24 h.
	Interval time.Duration
	// CheckInterval is how often each instance checks whether a run is due
	// (one try-lock query when another instance holds the lock). 0 means
	// 5 min; a random jitter of up to 10% is added.
	CheckInterval time.Duration
	// OnRun, if set, is called after every run this instance made, and
	// with ErrLocked when it found another instance running.
	OnRun func(Result, error)
}

// Runner runs the job in the background of outboxd.
type Runner struct {
	cfg  RunnerConfig
	pool *pgxpool.Pool
	life service.Lifecycle
}

// NewRunner validates cfg.
func NewRunner(pool *pgxpool.Pool, cfg RunnerConfig) (*Runner, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 24 * time.Hour
	}
	if cfg.CheckInterval <= 0 {
		cfg.CheckInterval = 5 * time.Minute
	}
	return &Runner{cfg: cfg, pool: pool}, nil
}

// Start starts the loop and returns (the shape of package service). The
// first check happens at once.
func (r *Runner) Start(ctx context.Context) error {
	if err := r.life.Go(ctx, func(run, _ context.Context) { r.loop(run) }); err != nil {
		return fmt.Errorf("retention: runner: %w", err)
	}
	return nil
}

// Stop cancels a run in flight (its current batch rolls back; every batch
// is its own transaction, so the rows deleted before it stay deleted) and
// waits for the loop to exit; ctx bounds the wait. It is idempotent.
func (r *Runner) Stop(ctx context.Context) error {
	return r.life.Stop(ctx)
}

func (r *Runner) loop(ctx context.Context) {
	for {
		res, err := r.RunIfDue(ctx)
		if r.cfg.OnRun != nil && (err != nil || res != nil) {
			var v Result
			if res != nil {
				v = *res
			}
			r.cfg.OnRun(v, err)
		}
		if err != nil && !errors.Is(err, ErrLocked) && ctx.Err() == nil {
			r.cfg.Logger.Error("retention check failed; retrying at the next check", slog.String("job", JobName), slog.String("error", err.Error()))
		}
		jitter := time.Duration(rand.Int64N(int64(r.cfg.CheckInterval)/10 + 1))
		select {
		case <-ctx.Done():
			return
		case <-time.After(r.cfg.CheckInterval + jitter):
		}
	}
}

// RunIfDue takes the lock and runs the job when the last finished run is
// older than Interval. It returns nil, nil when no run was due.
func (r *Runner) RunIfDue(ctx context.Context) (*Result, error) {
	lock, err := TryLock(ctx, r.pool)
	if err != nil {
		return nil, err
	}
	defer lock.Unlock(ctx)
	var due bool
	if err := r.pool.QueryRow(ctx, dueSQL, JobName, r.cfg.Interval.Seconds()).Scan(&due); err != nil {
		return nil, fmt.Errorf("retention: read outbox_job_run: %w", err)
	}
	if !due {
		return nil, nil
	}
	cfg := r.cfg.Config
	res, err := runLocked(ctx, r.pool, &cfg, false)
	return &res, err
}
