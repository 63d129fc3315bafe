package outboxriver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/service"
)

// GINCleanSQL merges the pending lists of River's GIN indexes on river_job
// into the indexes and returns how many pending-list pages it merged
// (migration 015's SECURITY DEFINER function; roles outbox_dispatcher and
// outbox_operator may call it).
const GINCleanSQL = `SELECT outbox_river_gin_clean()`

// DefaultGINCleanInterval is how often outboxd cleans River's GIN pending
// lists (OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS).
const DefaultGINCleanInterval = 200 * time.Millisecond

// ginCleanTimeout bounds one call.
const ginCleanTimeout = 30 * time.Second

// ginTargetPages is how many pending-list pages (8 kB each) a call should
// find: the cleaner waits longer than Interval, up to ginMaxStretch times
// it, while the lists fill more slowly than that. A quiet database is then
// not called five times a second, and a light stream's merges come in
// pieces of about 128 kB; a busy one is cleaned every Interval.
const (
	ginTargetPages = 16
	ginMaxStretch  = 8
)

// GINCleanerConfig configures a GINCleaner.
type GINCleanerConfig struct {
	// Interval is the shortest wait between the end of one call and the
	// start of the next; while the lists fill slowly the cleaner waits up
	// to eight times as long. 0 means DefaultGINCleanInterval.
	Interval time.Duration
	// Logger; nil discards.
	Logger *slog.Logger
	// OnClean, if set, is called after each successful call with the
	// pages merged and the call's duration (metrics). It must be quick.
	OnClean func(pages int64, took time.Duration)
}

// GINCleaner keeps the pending lists of River's GIN indexes short, so that
// no statement on the handoff's or the workers' path pays for merging a
// full one.
//
// River's river_job has two GIN indexes (over args and metadata), with
// Postgres' fastupdate: new entries go to a pending list, and the one
// statement that makes the list exceed gin_pending_list_limit (4 MB by
// default) merges all of it before it returns. Every version of a job's row
// adds entries, so at 1,000 jobs/s that happens every few seconds and
// stalls one River insert or fetch for 50-100 ms; a stalled fetch leaves
// the jobs it would have taken to River's next poll. A GINCleaner calls
// GINCleanSQL every Interval (up to eight Intervals while the lists fill
// slowly: a quiet database is not called five times a second), in a session
// of its own, so the merge is done in small pieces off that path
// (docs/operations.md, "River's GIN pending lists").
//
// It is a service (Start, Stop): outboxd runs one beside its dispatcher. A
// call that fails for want of privilege (the function's owner does not own
// River's indexes, 42501) or of migration 015 (42883) stops the cleaner
// with one warning: retrying cannot help. Other failures are logged (at
// most once a minute) and retried at the next interval.
type GINCleaner struct {
	pool *pgxpool.Pool
	cfg  GINCleanerConfig
	life service.Lifecycle

	calls, pages atomic.Int64
	disabled     atomic.Bool
}

// NewGINCleaner returns a cleaner that calls GINCleanSQL on pool, whose
// search_path must resolve the outbox's and River's tables.
func NewGINCleaner(pool *pgxpool.Pool, cfg GINCleanerConfig) (*GINCleaner, error) {
	if pool == nil {
		return nil, errors.New("outboxriver: NewGINCleaner: pool is nil")
	}
	if cfg.Interval < 0 {
		return nil, fmt.Errorf("outboxriver: NewGINCleaner: Interval must not be negative, got %s", cfg.Interval)
	}
	if cfg.Interval == 0 {
		cfg.Interval = DefaultGINCleanInterval
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &GINCleaner{pool: pool, cfg: cfg}, nil
}

// Start starts the cleaner's goroutine; its first call is one Interval
// later.
func (c *GINCleaner) Start(ctx context.Context) error {
	return c.life.Go(ctx, func(run, _ context.Context) { c.loop(run) })
}

// Stop stops the cleaner; a call in flight is cancelled when ctx ends.
func (c *GINCleaner) Stop(ctx context.Context) error { return c.life.Stop(ctx) }

// Stats returns the successful calls so far and the pages they merged.
func (c *GINCleaner) Stats() (calls, pages int64) { return c.calls.Load(), c.pages.Load() }

// Stopped returns a channel closed once the cleaner's goroutine has
// returned: after Stop, or when a call that cannot succeed disabled it (nil
// before Start).
func (c *GINCleaner) Stopped() <-chan struct{} { return c.life.Stopped() }

// Disabled reports whether the cleaner stopped for good after a call that
// cannot succeed (no privilege, no migration 015); its warning is logged
// by then.
func (c *GINCleaner) Disabled() bool { return c.disabled.Load() }

// Clean makes one call and returns the pages it merged.
func (c *GINCleaner) Clean(ctx context.Context) (int64, error) {
	cctx, cancel := context.WithTimeout(ctx, ginCleanTimeout)
	defer cancel()
	start := time.Now()
	var pages int64
	if err := c.pool.QueryRow(cctx, GINCleanSQL).Scan(&pages); err != nil {
		return 0, err
	}
	c.calls.Add(1)
	c.pages.Add(pages)
	if c.cfg.OnClean != nil {
		c.cfg.OnClean(pages, time.Since(start))
	}
	return pages, nil
}

func (c *GINCleaner) loop(ctx context.Context) {
	wait := c.cfg.Interval
	t := time.NewTimer(wait)
	defer t.Stop()
	var lastLog time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pages, err := c.Clean(ctx)
		switch {
		case ctx.Err() != nil:
		case err == nil:
			wait = nextGINWait(c.cfg.Interval, wait, pages)
		case permanent(err):
			c.cfg.Logger.Warn("outbox stops cleaning River's GIN pending lists: "+
				"outbox_river_gin_clean() needs migration 015 and an owner of River's river_job indexes "+
				"(apply the migrations as the role that owns River's tables); set OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS=0 to silence this",
				slog.String("error", err.Error()))
			c.disabled.Store(true)
			return
		case time.Since(lastLog) >= time.Minute:
			lastLog = time.Now()
			c.cfg.Logger.Warn("outbox could not clean River's GIN pending lists; retrying", slog.String("error", err.Error()))
		}
		t.Reset(wait)
	}
}

// nextGINWait is the wait before the next call, after a call that found
// pages after waiting last: long enough for the lists to gather about
// ginTargetPages at the rate they just filled, between interval and
// ginMaxStretch times it.
func nextGINWait(interval, last time.Duration, pages int64) time.Duration {
	if pages <= 0 {
		return interval * ginMaxStretch
	}
	w := time.Duration(float64(last) * ginTargetPages / float64(pages))
	return min(max(w, interval), interval*ginMaxStretch)
}

// permanent reports errors that no retry can fix: no privilege on the
// function or on River's indexes (42501), no function (42883).
func permanent(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "42501" || pgErr.Code == "42883")
}
