// Command outboxd is the outbox daemon: with OUTBOX_DISPATCHER_ENABLED=true
// it runs the dispatcher, which wakes on NOTIFY (or polls), claims pending
// events and hands them to River jobs in the same transaction.
//
// Configuration comes from the environment (docs/configuration.md). A bad
// value stops outboxd at start-up with a message naming the variable.
// SIGTERM or SIGINT finishes the batches in flight and exits 0.
//
// It also runs the daily retention of done events (OUTBOX_RETENTION_ENABLED,
// one instance at a time) in every process that has a database (with the
// dispatcher, the workers or both), sends alerts to Sentry when SENTRY_DSN is
// set (a parked ordering key raises one alert), serves /metrics, /healthz, /readyz, the console and River UI on
// OUTBOX_HTTP_ADDR, 127.0.0.1:9090 by default (docs/console.md), and works a
// River queue group when OUTBOX_WORKER_QUEUES or OUTBOX_WORKER_GROUP is set,
// with or without the dispatcher (docs/receivers.md).
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/alert/sentryalert"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/config"
	"github.com/outboxhq/outbox/internal/dbconn"
	"github.com/outboxhq/outbox/internal/schemacheck"
	"github.com/outboxhq/outbox/internal/service"
	"github.com/outboxhq/outbox/metrics"
	"github.com/outboxhq/outbox/retention"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// Exit statuses, the same as outboxctl's (docs/operations.md): 0 a clean
// stop (SIGTERM), 1 a runtime failure (the database, the schema, a port),
// 2 bad configuration (an environment variable, the routes file,
// DATABASE_URL that does not parse, SENTRY_DSN).
const (
	exitFailure = 1
	exitConfig  = 2
)

func main() {
	os.Exit(run())
}

func run() int {
	cfg, err := config.Load()
	if err != nil {
		fmt.Fprintln(os.Stderr, "outboxd:", err)
		return exitConfig
	}
	logger := newLogger(cfg)
	slog.SetDefault(logger)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	if !cfg.DispatcherEnabled && !workersConfigured(cfg) {
		logger.Warn("dispatcher disabled (OUTBOX_DISPATCHER_ENABLED=false) and no worker queues: this process dispatches nothing; set OUTBOX_DISPATCHER_ENABLED=true to run it")
		stopHTTP, err := startListener(ctx, cfg, reg, health{}, nil, logger) // console.go
		if err != nil {
			logger.Error("cannot start the HTTP listener", slog.String("error", err.Error()))
			return 1
		}
		defer func() { _ = stopHTTP(context.Background()) }()
		<-ctx.Done()
		logger.Info("outboxd stopped")
		return 0
	}

	// Routes: required by the dispatcher; optional for a worker-only
	// process, which uses them to warn about unrouted queues.
	var routes *route.Table
	if cfg.RoutesFile != "" {
		if routes, err = route.Load(cfg.RoutesFile); err != nil {
			logger.Error("cannot start: bad routes (OUTBOX_ROUTES_FILE)", slog.String("error", err.Error()))
			return exitConfig
		}
	}
	// A connection string that does not parse is bad configuration, not a
	// database that is down: refuse it before the retries of dbconn.Open.
	if _, err := pgxpool.ParseConfig(cfg.DatabaseURL); err != nil {
		logger.Error("cannot start: DATABASE_URL is not a valid connection string", slog.String("error", dbconn.Redact(err.Error(), cfg.DatabaseURL)))
		return exitConfig
	}

	pool, err := dbconn.Open(ctx, cfg.DatabaseURL, dbconn.Options{
		MaxConns: poolSize(cfg),
		Wait:     2 * time.Minute,
		Logger:   logger,
	})
	if err != nil {
		if ctx.Err() != nil {
			return 0
		}
		logger.Error("cannot start: database (DATABASE_URL)", slog.String("error", err.Error()))
		return 1
	}
	defer pool.Close()
	// Every mode needs the outbox's and River's tables: say so at once
	// instead of failing later on a raw relation error.
	if err := schemacheck.Check(ctx, pool); err != nil {
		logger.Error("cannot start", slog.String("error", dbconn.Redact(err.Error(), cfg.DatabaseURL)))
		return exitFailure
	}
	if w, err := isolationWarning(ctx, pool); err != nil {
		logger.Warn("cannot read default_transaction_isolation", slog.String("error", err.Error()))
	} else if w != "" {
		logger.Warn(w)
	}

	// Alerts: Sentry when SENTRY_DSN is set (every alert is logged too),
	// the log otherwise; counted by the metrics on the way.
	m := metrics.New(metrics.Config{Pool: pool, Routes: routes})
	if err := m.Register(reg); err != nil {
		logger.Error("cannot register metrics", slog.String("error", err.Error()))
		return 1
	}
	var base alert.Alerter = alert.Log{Logger: logger}
	if cfg.SentryDSN != "" {
		sentryAl, err := sentryalert.New(sentryalert.Config{
			DSN:            cfg.SentryDSN,
			Environment:    cfg.SentryEnvironment,
			IncludePayload: cfg.SentryIncludePayload,
			Pool:           pool,
			Logger:         logger,
		})
		if err != nil {
			logger.Error("cannot start: SENTRY_DSN", slog.String("error", err.Error()))
			return exitConfig
		}
		base = sentryAl
		defer sentryAl.Flush(5 * time.Second)
		logger.Info("alerts go to Sentry", slog.Bool("include_payload", cfg.SentryIncludePayload))
	}
	alerter := m.Alerter(base)
	warnRoutesDrift(ctx, pool, routes, logger, alerter) // routesdrift.go

	var d *dispatcher.Dispatcher
	if cfg.DispatcherEnabled {
		dcfg := cfg.Dispatcher()
		dcfg.Routes = routes
		dcfg.Logger = logger
		dcfg.Alerter = alerter
		dcfg.OnBatch = m.OnBatch
		if d, err = dispatcher.New(pool, dcfg); err != nil {
			logger.Error("cannot start dispatcher", slog.String("error", err.Error()))
			return 1
		}
		m.SetDispatcher(d)
	} else {
		logger.Info("dispatcher disabled (OUTBOX_DISPATCHER_ENABLED=false): this process only runs River workers")
	}

	{
		stopHTTP, err := startListener(ctx, cfg, reg, health{pool: pool, d: d, dbURL: cfg.DatabaseURL, logger: logger}, routes, logger) // console.go
		if err != nil {
			logger.Error("cannot start the HTTP listener", slog.String("error", err.Error()))
			return 1
		}
		defer func() {
			hctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = stopHTTP(hctx)
		}()
	}

	// The long-running services, all of one start/stop shape
	// (internal/service): started in this order, stopped in reverse, so the
	// workers, started first, are stopped last, after the dispatcher has
	// finished the batches in flight.
	var services []service.Named
	workers, err := newWorkers(pool, cfg, routes, logger, alerter) // nil without a worker group (workers.go)
	if err != nil {
		logger.Error("cannot start River workers", slog.String("error", dbconn.Redact(err.Error(), cfg.DatabaseURL)))
		return 1
	}
	if workers != nil {
		services = append(services, service.Named{Name: "River workers", Service: workers})
	}
	if d != nil {
		services = append(services, service.Named{Name: "dispatcher", Service: d})
		if cfg.ListenEnabled {
			services = append(services, service.Named{Name: "listener watch", Service: &listenerWatch{
				d: d, al: alerter, after: time.Duration(cfg.ListenerAlertAfterMS) * time.Millisecond, tick: time.Second}})
		}
		// Parked ordering keys raise an alert each (parked.go), from the
		// dispatcher's processes.
		services = append(services, service.Named{Name: "parked key watch", Service: &parkedWatch{
			pool: pool, al: alerter, logger: logger, tick: parkedCheckEvery}})
	}
	// Retention runs in every process with a database, with or without the
	// dispatcher (a worker-only outboxd purges too); its advisory lock makes
	// one run at a time across all of them.
	if cfg.RetentionEnabled {
		host, _ := os.Hostname()
		ret, err := retention.NewRunner(pool, retention.RunnerConfig{Config: retention.Config{
			MaxAge:    time.Duration(cfg.DoneRetentionHours) * time.Hour,
			BatchSize: cfg.DoneRetentionBatchSize,
			RunBy:     fmt.Sprintf("outboxd %d@%s", os.Getpid(), host),
			Logger:    logger,
			OnBatch:   m.OnRetentionBatch,
		}})
		if err != nil {
			logger.Error("cannot start retention", slog.String("error", err.Error()))
			return 1
		}
		services = append(services, service.Named{Name: "retention", Service: ret})
	}
	// River's GIN pending lists are merged in small pieces, off the
	// handoff's and the workers' path, by every process (their calls
	// queue behind each other in Postgres).
	if cfg.RiverGINCleanIntervalMS > 0 {
		gc, err := outboxriver.NewGINCleaner(pool, outboxriver.GINCleanerConfig{
			Interval: time.Duration(cfg.RiverGINCleanIntervalMS) * time.Millisecond,
			Logger:   logger,
			OnClean:  m.OnGINClean,
		})
		if err != nil {
			logger.Error("cannot start River's GIN cleaner", slog.String("error", err.Error()))
			return 1
		}
		services = append(services, service.Named{Name: "River GIN cleaner", Service: gc})
	}
	var running service.Group
	if err := running.Start(ctx, services...); err != nil {
		name := "a service"
		var se *service.Error
		if errors.As(err, &se) {
			name = se.Name
			err = se.Err
		}
		logger.Error("cannot start "+name, slog.String("error", dbconn.Redact(err.Error(), cfg.DatabaseURL)))
		return 1
	}

	<-ctx.Done()
	logger.Info("shutting down: finishing the batches and jobs in flight")
	sctx, cancel := context.WithTimeout(context.Background(), time.Duration(cfg.ShutdownTimeoutMS)*time.Millisecond)
	defer cancel()
	if err := running.Stop(sctx); err != nil {
		logger.Warn("shutdown did not finish cleanly (after OUTBOX_SHUTDOWN_TIMEOUT_MS, batches in flight are rolled back and stay pending, running jobs are cancelled and River retries them)",
			slog.String("error", err.Error()))
	}
	var s dispatcher.Stats
	if d != nil {
		s = d.Stats()
	}
	// What this process did: the dispatcher's figures only when it ran, the
	// jobs its workers ran (by outcome) only when it works queues.
	var done []any
	if d != nil {
		done = append(done, slog.Int64("events", s.Events), slog.Int64("jobs", s.Jobs), slog.Int64("batches", s.Batches))
	}
	if workers != nil {
		done = append(done, workers.counts.attrs()...)
	}
	logger.Info("outboxd stopped", done...)
	return 0
}

// poolSize leaves room for every batch in flight plus the heartbeat,
// retention, metrics and the wake of idle ordering keys, and for the
// workers.
func poolSize(cfg *config.Config) int32 {
	if cfg.DatabaseMaxConns > 0 {
		return int32(cfg.DatabaseMaxConns)
	}
	n := workerConns(cfg) + 2
	if cfg.DispatcherEnabled {
		n += int32(cfg.DispatchConcurrency + 5)
	}
	return n
}

func newLogger(cfg *config.Config) *slog.Logger {
	var level slog.Level
	switch strings.ToLower(cfg.LogLevel) {
	case "debug":
		level = slog.LevelDebug
	case "warn":
		level = slog.LevelWarn
	case "error":
		level = slog.LevelError
	default:
		level = slog.LevelInfo
	}
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	if cfg.LogFormat == "json" {
		h = slog.NewJSONHandler(os.Stderr, opts)
	} else {
		h = slog.NewTextHandler(os.Stderr, opts)
	}
	return slog.New(h).With(slog.String("service", "outboxd"), slog.Int("pid", os.Getpid()))
}
