// Command outboxd is the outbox daemon: with OUTBOX_DISPATCHER_ENABLED=true
// it runs the dispatcher, which wakes on NOTIFY (or polls), claims pending
// events and hands them to River jobs in the same transaction.
//
// Configuration comes from the environment (docs/configuration.md). A bad
// value stops outboxd at start-up with a message naming the variable.
// SIGTERM or SIGINT finishes the batches in flight and exits 0.
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

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/config"
	"github.com/outboxhq/outbox/internal/dbconn"
	"github.com/outboxhq/outbox/route"
)

func main() {
	os.Exit(run())
}

func run() int {
	cfg, err := config.Load()
	if err != nil {
		fmt.Fprintln(os.Stderr, "outboxd:", err)
		return 2
	}
	logger := newLogger(cfg)
	slog.SetDefault(logger)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	if !cfg.DispatcherEnabled {
		logger.Warn("dispatcher disabled (OUTBOX_DISPATCHER_ENABLED=false): this process dispatches nothing; set OUTBOX_DISPATCHER_ENABLED=true to run it")
		<-ctx.Done()
		logger.Info("outboxd stopped")
		return 0
	}

	routes, err := route.Load(cfg.RoutesFile)
	if err != nil {
		logger.Error("cannot start: bad routes (OUTBOX_ROUTES_FILE)", slog.String("error", err.Error()))
		return 1
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

	dcfg := cfg.Dispatcher()
	dcfg.Routes = routes
	dcfg.Logger = logger
	dcfg.Alerter = alert.Log{Logger: logger}
	d, err := dispatcher.New(pool, dcfg)
	if err != nil {
		logger.Error("cannot start dispatcher", slog.String("error", err.Error()))
		return 1
	}
	if err := d.Start(ctx); err != nil {
		logger.Error("cannot start dispatcher", slog.String("error", dbconn.Redact(err.Error(), cfg.DatabaseURL)))
		return 1
	}

	<-ctx.Done()
	logger.Info("shutting down: finishing the batches in flight")
	sctx, cancel := context.WithTimeout(context.Background(), time.Duration(cfg.ShutdownTimeoutMS)*time.Millisecond)
	defer cancel()
	if err := d.Stop(sctx); err != nil && !errors.Is(err, context.Canceled) {
		logger.Warn("shutdown timed out; batches in flight were rolled back and stay pending", slog.String("error", err.Error()))
	}
	s := d.Stats()
	logger.Info("outboxd stopped", slog.Int64("events", s.Events), slog.Int64("jobs", s.Jobs), slog.Int64("batches", s.Batches))
	return 0
}

// poolSize leaves room for every batch in flight plus the heartbeat.
func poolSize(cfg *config.Config) int32 {
	if cfg.DatabaseMaxConns > 0 {
		return int32(cfg.DatabaseMaxConns)
	}
	return int32(cfg.DispatchConcurrency + 4)
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
