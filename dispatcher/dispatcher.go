// Package dispatcher runs the outbox's dispatch loop: it wakes on the
// listener's signal (LISTEN/NOTIFY) or on a poll tick, claims due events in
// batches and hands them to River (package claim), draining with up to
// Concurrency batches in flight while batches come back full.
//
// Between passes an idle dispatcher holds the wake lock (see the migration's
// wake trigger) so that producers notify only while someone is waiting, and
// it re-checks the table after taking the lock so that no commit slips
// between its last pass and its sleep. A wake that finds it idle is handed
// off by one pass that keeps the lock (state armed): a light stream costs
// one claim transaction per wake; a busy one is drained without the lock.
//
// The data path (publish, wake, claim, route, insert, done) and the loop's
// state machine (draining, lingering, idle with the wake lock, armed,
// backingOff, stopping) are described step by step at the top of loop.go; a drain and
// its concurrency controller are in drain.go.
//
// Start returns once the loop runs; Stop finishes the batches in flight and
// returns (a context deadline on Stop cancels them instead): the start/stop
// shape of package internal/service.
package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/internal/service"
	"github.com/outboxhq/outbox/listener"
	"github.com/outboxhq/outbox/route"
)

// Config configures a Dispatcher. Zero values take the documented defaults.
type Config struct {
	// Routes is the routing table. Required: the dispatcher refuses to run
	// without routes.
	Routes *route.Table
	// BatchSize is the most events claimed per batch. 0 means 100. A walk
	// of one hot ordering key's backlog takes five times as many per batch,
	// at most 1,000 unless BatchSize is larger (docs/ordering.md, "How it
	// works").
	BatchSize int
	// BatchBytes bounds the payload bytes (JSON text) of one batch; a batch
	// always takes at least one event, so a single event larger than the
	// budget still goes alone. 0 means claim.DefaultBatchBytes (4 MiB).
	BatchBytes int
	// Concurrency is the most batches in flight at once while draining; a
	// drain starts with two and adds one while that raises its rate (see
	// controller). 0 means 10.
	Concurrency int
	// PollInterval is the fallback poll cadence. 0 means 1 s. An idle
	// dispatcher also wakes when the earliest pending event is due, so a
	// delayed event does not wait for the poll.
	PollInterval time.Duration
	// ListenDisabled selects poll-only mode (for PgBouncer in transaction
	// mode, where LISTEN does not work).
	ListenDisabled bool
	// MaxRetries is the number of failed attempts after which the next
	// failure dead-letters an event. 0 means 6; use a negative value for
	// "dead-letter on the first failure".
	MaxRetries int
	// BatchTimeout bounds one batch transaction, and each event-by-event
	// retry (see claim.Handoff.Timeout). 0 means 30 s.
	BatchTimeout time.Duration
	// ReconnectDelay and PingInterval configure the listener (see package
	// listener). 0 means 1 s and 2 s.
	ReconnectDelay time.Duration
	PingInterval   time.Duration
	// WakeLockTimeout bounds the wait for the wake lock. 0 means 250 ms.
	WakeLockTimeout time.Duration
	// DrainWindow is how often a parallel drain measures its rate to decide
	// whether one more batch in flight helps. 0 means 250 ms.
	DrainWindow time.Duration
	// Linger is how long a dispatcher that just handed events off waits
	// before looking again, instead of going idle (taking the wake lock,
	// which makes producers notify). Only a pass that finds nothing sends
	// it idle. 0 means 1 ms; negative disables lingering.
	Linger time.Duration
	// Alerter receives alerts; nil means alert.Log with Logger.
	Alerter alert.Alerter
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// OnBatch, if set, is called after every batch that claimed events
	// (metrics, tests). It must be safe for concurrent calls and quick.
	OnBatch func(claim.Result)
	// FailureAlertAfter raises DispatcherFailing after this many consecutive
	// failed passes. 0 means 5.
	FailureAlertAfter int
	// IdleWakeInterval is how often the dispatcher wakes the ordering
	// keys that a release above READ COMMITTED left idle (migration 018;
	// docs/ordering.md, "Limits"). 0 means 1 s; negative disables the
	// wake (then something else must call outbox_ordering_wake).
	IdleWakeInterval time.Duration
	// SynchronousCommit makes each batch wait for its WAL flush; see
	// claim.Handoff.SynchronousCommit for why the default (false) keeps the
	// handoff exactly-once.
	SynchronousCommit bool
}

func (c *Config) setDefaults() {
	if c.BatchSize == 0 {
		c.BatchSize = 100
	}
	if c.BatchBytes == 0 {
		c.BatchBytes = claim.DefaultBatchBytes
	}
	if c.Concurrency == 0 {
		c.Concurrency = 10
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	switch {
	case c.MaxRetries == 0:
		c.MaxRetries = 6
	case c.MaxRetries < 0:
		c.MaxRetries = 0
	}
	if c.BatchTimeout == 0 {
		c.BatchTimeout = 30 * time.Second
	}
	if c.WakeLockTimeout == 0 {
		c.WakeLockTimeout = 250 * time.Millisecond
	}
	if c.IdleWakeInterval == 0 {
		c.IdleWakeInterval = time.Second
	}
	if c.DrainWindow == 0 {
		c.DrainWindow = 250 * time.Millisecond
	}
	switch {
	case c.Linger == 0:
		c.Linger = time.Millisecond
	case c.Linger < 0:
		c.Linger = 0
	}
	if c.FailureAlertAfter == 0 {
		c.FailureAlertAfter = 5
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Alerter == nil {
		c.Alerter = alert.Log{Logger: c.Logger}
	}
}

func (c *Config) validate() error {
	switch {
	case c.Routes == nil:
		return errors.New("dispatcher: Routes is required: the dispatcher refuses to start without routes")
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("dispatcher: BatchSize must be 1..10000, got %d", c.BatchSize)
	case c.BatchBytes < 1:
		return fmt.Errorf("dispatcher: BatchBytes must be positive, got %d", c.BatchBytes)
	case c.Concurrency < 1 || c.Concurrency > 1000:
		return fmt.Errorf("dispatcher: Concurrency must be 1..1000, got %d", c.Concurrency)
	case c.PollInterval < time.Millisecond:
		return fmt.Errorf("dispatcher: PollInterval must be at least 1ms, got %s", c.PollInterval)
	case c.BatchTimeout < 0:
		return errors.New("dispatcher: BatchTimeout must not be negative")
	}
	return nil
}

// schemaSQL finds the schema that holds the outbox_event the dispatcher's
// queries resolve to, and derives the wake key and the NOTIFY payload from
// it exactly as the wake trigger does from TG_TABLE_SCHEMA. current_schema()
// is not that schema when search_path starts with one that exists but has
// no outbox (a "$user" schema): the dispatcher would hold another key and
// filter for another payload, and never wake.
const schemaSQL = `
SELECT n.nspname IS NOT NULL, coalesce(n.nspname, ''), coalesce(hashtext('outbox_wake:' || n.nspname), 0),
       current_setting('search_path')
FROM (SELECT to_regclass('outbox_event') AS rel) r
LEFT JOIN pg_class c ON c.oid = r.rel
LEFT JOIN pg_namespace n ON n.oid = c.relnamespace`

// syncCommitSQL lists where synchronous_commit is off or local for sessions
// on this database: this session (server default, database and role
// defaults and connection options all resolved), and every database- or
// role-level default that applies to this database (workers may connect as
// another role).
const syncCommitSQL = `
SELECT 'this session (' || current_user || ')', current_setting('synchronous_commit')
WHERE current_setting('synchronous_commit') IN ('off', 'local')
UNION ALL
SELECT CASE WHEN s.setrole = 0 THEN 'database ' || current_database() || ' (ALTER DATABASE … SET)'
            WHEN s.setdatabase = 0 THEN 'role ' || r.rolname || ' (ALTER ROLE … SET)'
            ELSE 'role ' || r.rolname || ' in database ' || current_database() || ' (ALTER ROLE … IN DATABASE … SET)' END,
       split_part(c.cfg, '=', 2)
FROM pg_db_role_setting s
LEFT JOIN pg_roles r ON r.oid = s.setrole
CROSS JOIN LATERAL unnest(s.setconfig) AS c(cfg)
WHERE s.setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
  AND lower(split_part(c.cfg, '=', 1)) = 'synchronous_commit'
  AND lower(split_part(c.cfg, '=', 2)) IN ('off', 'local', 'false', 'no', '0')`

// checkSynchronousCommit warns (log and alert) when River workers may
// commit with synchronous_commit off or local. The handoff skips its own
// WAL flush (SynchronousCommit false) and stays exactly-once only because a
// worker's synchronous commit flushes the WAL up to and past it; a worker
// that commits asynchronously can run a job whose handoff a crash then
// loses, and the event is handed off again (local also loses that guarantee
// on a failover to a synchronous standby). The check cannot see the
// settings a worker's own connection string sets; it never stops the start.
func (d *Dispatcher) checkSynchronousCommit(ctx context.Context) {
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	rows, err := d.pool.Query(qctx, syncCommitSQL)
	if err != nil {
		d.logger.Info("outbox could not check synchronous_commit", slog.String("error", err.Error()))
		return
	}
	type finding struct{ where, value string }
	found, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (finding, error) {
		var f finding
		return f, r.Scan(&f.where, &f.value)
	})
	if err != nil {
		d.logger.Info("outbox could not check synchronous_commit", slog.String("error", err.Error()))
		return
	}
	for _, f := range found {
		msg := fmt.Sprintf("synchronous_commit is %s for %s: River workers that commit without flushing the WAL break the exactly-once handoff, "+
			"because handoff commits skip their own flush; set OUTBOX_DISPATCH_SYNCHRONOUS_COMMIT=true or make the workers commit with synchronous_commit=on "+
			"(docs/architecture.md, \"Commit durability\")", f.value, f.where)
		d.logger.Warn("outbox WARNING: "+msg, slog.String("where", f.where), slog.String("synchronous_commit", f.value))
		d.cfg.Alerter.Alert(ctx, alert.Alert{Reason: alert.SynchronousCommitOff, Message: msg})
	}
}

// Stats are cumulative counters.
type Stats struct {
	Batches      int64
	Events       int64
	Jobs         int64
	Unroutable   int64
	Retried      int64
	DeadLettered int64
	Wakes        int64
	Polls        int64
	// Due counts idle sleeps ended by the due time of the earliest
	// pending event (a delayed event, or a retry after its backoff).
	Due    int64
	Errors int64
	// Passes counts the loop's batch transactions, including those that
	// found nothing; Batches counts those that claimed events, so Passes -
	// Batches is the passes that found nothing. The event-by-event retries
	// after a failed batch are not passes.
	Passes int64
	// DrainWorkers is the number of batches in flight the last parallel
	// drain settled on (0 before the first).
	DrainWorkers int64
}

// Dispatcher is the dispatch loop. Create it with New.
type Dispatcher struct {
	cfg     Config
	pool    *pgxpool.Pool
	handoff *claim.Handoff
	lis     *listener.Listener
	lock    *wakeLock
	logger  *slog.Logger
	schema  string

	batches, events, jobs, unroutable, retried, dead, wakes, polls, dues, errs, passes atomic.Int64
	running                                                                            atomic.Bool
	// drainWorkers is the number of workers of the last parallel drain.
	drainWorkers atomic.Int64
	// published is lis once started, for readers outside Start and the loop.
	published atomic.Pointer[listener.Listener]

	mu      sync.Mutex // guards started
	started bool
	life    service.Lifecycle
	// idle wakes idle ordering keys (idle.go); nil when disabled.
	idle *idleWake
}

// New validates cfg and builds a Dispatcher on pool (whose search_path
// selects the outbox schema).
func New(pool *pgxpool.Pool, cfg Config) (*Dispatcher, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	d := &Dispatcher{
		cfg:    cfg,
		pool:   pool,
		logger: cfg.Logger,
		handoff: &claim.Handoff{
			Pool:              pool,
			Routes:            cfg.Routes,
			MaxRetries:        cfg.MaxRetries,
			BatchBytes:        cfg.BatchBytes,
			Timeout:           cfg.BatchTimeout,
			Alerter:           cfg.Alerter,
			Logger:            cfg.Logger,
			SynchronousCommit: cfg.SynchronousCommit,
		},
	}
	return d, nil
}

// Stats returns the cumulative counters.
func (d *Dispatcher) Stats() Stats {
	return Stats{
		Batches: d.batches.Load(), Events: d.events.Load(), Jobs: d.jobs.Load(),
		Unroutable: d.unroutable.Load(), Retried: d.retried.Load(), DeadLettered: d.dead.Load(),
		Wakes: d.wakes.Load(), Polls: d.polls.Load(), Due: d.dues.Load(), Errors: d.errs.Load(),
		DrainWorkers: d.drainWorkers.Load(), Passes: d.passes.Load(),
	}
}

// Running reports whether the loop is running.
func (d *Dispatcher) Running() bool { return d.running.Load() }

// ListenerConnected reports whether the LISTEN connection is up (false in
// poll-only mode).
func (d *Dispatcher) ListenerConnected() bool {
	lis := d.published.Load() // health checks may ask while Start runs
	return lis != nil && lis.Connected()
}

// Start checks the schema, starts the listener (unless poll-only) and the
// loop, and returns.
func (d *Dispatcher) Start(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.started {
		return errors.New("dispatcher: already started")
	}

	var (
		key        int32
		found      bool
		searchPath string
	)
	err := d.pool.QueryRow(ctx, schemaSQL).Scan(&found, &d.schema, &key, &searchPath)
	if err != nil {
		return fmt.Errorf("dispatcher: find the outbox schema: %w", err)
	}
	if !found {
		return fmt.Errorf("dispatcher: no table outbox_event in search_path %q: point DATABASE_URL's search_path at the outbox schema, or run `outboxctl migrate`", searchPath)
	}

	if !d.cfg.SynchronousCommit {
		d.checkSynchronousCommit(ctx)
	}

	if !d.cfg.ListenDisabled {
		connCfg := d.pool.Config().ConnConfig
		d.lis, err = listener.New(listener.Config{
			ConnConfig:     connCfg,
			Pool:           d.pool,
			Payload:        d.schema,
			ReconnectDelay: d.cfg.ReconnectDelay,
			PingInterval:   d.cfg.PingInterval,
			Logger:         d.logger,
		})
		if err != nil {
			return err
		}
		d.lock = &wakeLock{connConfig: connCfg, key: key, timeout: d.cfg.WakeLockTimeout}
		if err := d.lis.Start(ctx); err != nil {
			return err
		}
		d.published.Store(d.lis)
	}

	d.started = true
	d.running.Store(true)
	if err := d.life.Go(ctx, func(run, work context.Context) {
		defer d.running.Store(false)
		d.runLoop(run, work)
	}); err != nil {
		return fmt.Errorf("dispatcher: %w", err)
	}
	if d.cfg.IdleWakeInterval > 0 {
		d.idle = &idleWake{pool: d.pool, logger: d.logger, tick: d.cfg.IdleWakeInterval}
		if err := d.idle.Start(ctx); err != nil {
			return fmt.Errorf("dispatcher: %w", err)
		}
	}
	d.logger.Info("outbox dispatcher started",
		slog.String("schema", d.schema),
		slog.Bool("listen", !d.cfg.ListenDisabled),
		slog.Int("batch_size", d.cfg.BatchSize),
		slog.Int("concurrency", d.cfg.Concurrency),
		slog.Duration("poll_interval", d.cfg.PollInterval),
		slog.Int("max_retries", d.cfg.MaxRetries),
		slog.Int("routes", len(d.cfg.Routes.Rules())))
	return nil
}

// Stop asks the loop to stop after the batches in flight and waits. If ctx
// ends first, the batches in flight are cancelled (rolled back: their events
// stay pending) and Stop returns ctx's error once the loop has exited.
// Stop is idempotent.
func (d *Dispatcher) Stop(ctx context.Context) error {
	err := d.life.Stop(ctx)
	d.mu.Lock()
	lis, idle := d.lis, d.idle
	d.mu.Unlock()
	if idle != nil {
		if ierr := idle.Stop(ctx); err == nil {
			err = ierr
		}
	}
	if lis != nil {
		_ = lis.Stop(context.WithoutCancel(ctx))
	}
	return err
}

func (d *Dispatcher) rescue(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, d.cfg.BatchTimeout)
	defer cancel()
	n, err := d.handoff.Rescue(rctx)
	if err != nil {
		if ctx.Err() == nil {
			d.logger.Warn("outbox rescue of stale processing rows failed", slog.String("error", err.Error()))
		}
		return
	}
	if n > 0 {
		d.logger.Warn("outbox put stale processing rows back to pending", slog.Int64("rows", n))
	}
}

func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}
