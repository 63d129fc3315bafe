package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/internal/config"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// workerGroup is the River client that works this process's queue group
// (OUTBOX_WORKER_QUEUES, or OUTBOX_WORKER_GROUP of OUTBOX_WORKER_GROUPS).
//
// outboxd cannot run your receivers: they are Go code in your service,
// which embeds package outboxriver (docs/receivers.md). What outboxd runs is
// the built-in handler OUTBOX_WORKER_HANDLER=log: it logs every event at
// info level and completes its job. That is for demos, for checking routes
// end to end, and for queues whose events only need to be drained.
type workerGroup struct {
	name   string
	client *river.Client[pgx.Tx]
	logger *slog.Logger
	counts *jobCounts
	// queues, handler and clientID are logged at start.
	queues, handler, clientID string
}

// jobCounts are the jobs this process's workers ran, by outcome: what a
// worker-only outboxd reports at shutdown.
type jobCounts struct {
	completed, failed, cancelled, snoozed atomic.Int64
}

func (c *jobCounts) record(err error) {
	var (
		cancel *rivertype.JobCancelError
		snooze *rivertype.JobSnoozeError
	)
	switch {
	case err == nil:
		c.completed.Add(1)
	case errors.As(err, &snooze):
		c.snoozed.Add(1)
	case errors.As(err, &cancel):
		c.cancelled.Add(1)
	default:
		c.failed.Add(1)
	}
}

// attrs are the shutdown log's fields.
func (c *jobCounts) attrs() []any {
	completed, failed, cancelled, snoozed := c.completed.Load(), c.failed.Load(), c.cancelled.Load(), c.snoozed.Load()
	return []any{
		slog.Int64("jobs_worked", completed+failed+cancelled+snoozed),
		slog.Int64("jobs_completed", completed),
		slog.Int64("jobs_failed", failed),
		slog.Int64("jobs_cancelled", cancelled),
		slog.Int64("jobs_snoozed", snoozed),
	}
}

// countingWorker is the outbox worker, counting each job's outcome
// (failed: River retries the job, or discards it after its last attempt).
type countingWorker struct {
	*outboxriver.Worker
	counts *jobCounts
}

// Work implements river.Worker.
func (w countingWorker) Work(ctx context.Context, job *river.Job[outboxriver.EventArgs]) error {
	err := w.Worker.Work(ctx, job)
	w.counts.record(err)
	return err
}

// workersConfigured reports whether this process works any queue.
func workersConfigured(cfg *config.Config) bool {
	_, ok := cfg.Worked()
	return ok
}

// workerConns is how many pool connections the workers may hold: River's
// producers fetch on their own connections, and a handler may hold one
// per running job. The built-in log handler holds none.
func workerConns(cfg *config.Config) int32 {
	g, ok := cfg.Worked()
	if !ok {
		return 0
	}
	return int32(2 + 2*len(g.Queues))
}

// logHandler is the built-in "log" receiver.
func logHandler(logger *slog.Logger) outboxriver.HandlerFunc {
	return func(ctx context.Context, ev outboxriver.Event) error {
		attrs := []slog.Attr{
			slog.Int64("event_id", ev.ID),
			slog.String("event_type", ev.Type),
			slog.String("queue", ev.Queue),
			slog.Int64("job_id", ev.JobID),
			slog.Int("attempt", ev.Attempt),
			slog.Int("payload_bytes", len(ev.Payload)),
		}
		if ev.TenantID != "" {
			attrs = append(attrs, slog.String("tenant_id", ev.TenantID))
		}
		logger.LogAttrs(ctx, slog.LevelInfo, "event received by the built-in log handler", attrs...)
		return nil
	}
}

// newWorkers builds the River client of this process's group, or returns
// nil when it works no queue; Start starts it. routes may be nil (no
// OUTBOX_ROUTES_FILE); with routes, it warns about worked queues that no
// route targets and about routed queues that no declared group works.
func newWorkers(pool *pgxpool.Pool, cfg *config.Config, routes *route.Table, logger *slog.Logger, alerter alert.Alerter) (*workerGroup, error) {
	group, ok := cfg.Worked()
	if !ok {
		return nil, nil
	}
	logger = logger.With(slog.String("group", group.Name))
	checkQueues(cfg, group, routes, logger)

	handlers := outboxriver.NewHandlers()
	handlers.Handle("", logHandler(logger))
	workers := river.NewWorkers()
	counts := &jobCounts{}
	w := countingWorker{Worker: outboxriver.NewWorker(handlers, outboxriver.WorkerOptions{Alerter: alerter, Logger: logger}), counts: counts}
	if err := river.AddWorkerSafely[outboxriver.EventArgs](workers, w); err != nil {
		return nil, err
	}
	rcfg := outboxriver.QueuesConfig(workers, group.Queues, cfg.WorkerLatency())
	rcfg.ID = outboxriver.GroupClientID(group.Name)
	rcfg.JobTimeout = time.Duration(cfg.WorkerJobTimeoutS) * time.Second
	rcfg.RescueStuckJobsAfter = time.Duration(cfg.WorkerRescueAfterS) * time.Second
	rcfg.Logger = logger.With(slog.String("component", "river"))
	client, err := river.NewClient(riverpgxv5.New(pool), rcfg)
	if err != nil {
		return nil, fmt.Errorf("worker group %s: %w", group.Name, err)
	}
	qs := make([]string, len(group.Queues))
	for i, q := range group.Queues {
		n := q.MaxWorkers
		if n == 0 {
			n = outboxriver.DefaultMaxWorkers
		}
		qs[i] = fmt.Sprintf("%s:%d", q.Name, n)
	}
	return &workerGroup{name: group.Name, client: client, logger: logger, counts: counts,
		queues: strings.Join(qs, ","), handler: cfg.WorkerHandler, clientID: rcfg.ID}, nil
}

// Start starts the River client (the start/stop shape of internal/service).
func (w *workerGroup) Start(ctx context.Context) error {
	if err := w.client.Start(ctx); err != nil {
		return fmt.Errorf("worker group %s: start River client: %w", w.name, err)
	}
	w.logger.Info("River workers started", slog.String("queues", w.queues),
		slog.String("handler", w.handler), slog.String("client_id", w.clientID))
	return nil
}

// checkQueues warns about queues that routes and groups disagree on.
func checkQueues(cfg *config.Config, group config.Group, routes *route.Table, logger *slog.Logger) {
	if routes == nil {
		logger.Info("OUTBOX_ROUTES_FILE is not set: cannot check that the worked queues are routed")
		return
	}
	for _, q := range config.UnroutedQueues(routes, group.Queues) {
		logger.Warn("this process works a queue that no route targets: its workers will wait for jobs the dispatcher never creates (a typo, or a removed route?)",
			slog.String("queue", q), slog.String("routes_file", cfg.RoutesFile))
	}
	if declared := cfg.WorkerGroupsDeclared(); cfg.WorkerGroups != "" {
		if unworked := config.UnworkedQueues(routes, declared); len(unworked) > 0 {
			logger.Warn("routed queues that no group of OUTBOX_WORKER_GROUPS works: their jobs will pile up",
				slog.String("queues", strings.Join(unworked, ",")))
		}
	}
}

// Stop finishes the running jobs (soft stop) until ctx ends, then cancels
// them (River retries a cancelled job). Safe on a nil group.
func (w *workerGroup) Stop(ctx context.Context) error {
	if w == nil {
		return nil
	}
	err := w.client.Stop(ctx)
	if err == nil {
		return nil
	}
	if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
		return err
	}
	w.logger.Warn("workers did not finish in time; cancelling the running jobs (River retries them)")
	hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	return w.client.StopAndCancel(hctx)
}
