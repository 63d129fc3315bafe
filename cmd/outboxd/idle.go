package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/service"
)

// idleWakeEvery is how often the dispatcher's process looks for idle
// ordering keys.
const idleWakeEvery = time.Second

// idleQueryTimeout bounds one check's statements.
const idleQueryTimeout = 5 * time.Second

// idleLimit bounds the keys one check wakes; the oldest come first.
const idleLimit = 100

// idleWarnEvery is how often at most the watch warns that it woke keys.
const idleWarnEvery = time.Minute

// idleSQL lists the idle keys, oldest first, through
// outbox_ordering_key_idle_idx (nothing to read when none is idle).
const idleSQL = `
SELECT tenant_id, ordering_key, queue FROM outbox_ordering_key
WHERE idle_since IS NOT NULL
ORDER BY idle_since
LIMIT $1`

// idleWake releases the ordering keys that a release above READ
// COMMITTED left idle (migration 018), as a service
// (internal/service). Such a release, which River's own completer, River
// UI or a worker's transaction runs at the session's
// default_transaction_isolation, cannot see a job that a handoff queued
// behind the key's head while it waited, so it marks the key idle instead
// of deleting its row. Each check wakes the idle keys one transaction each
// (outbox_ordering_wake at READ COMMITTED: the first job in line becomes
// the head, or the row goes), so such a key's next job starts within
// about a second of the release. At READ COMMITTED no key is ever idle,
// and a check reads nothing.
type idleWake struct {
	pool   *pgxpool.Pool
	logger *slog.Logger
	tick   time.Duration
	life   service.Lifecycle

	// checks counts the completed checks and woken the keys woken (test
	// signals).
	checks, woken atomic.Int64
}

// Start starts the watch.
func (w *idleWake) Start(ctx context.Context) error {
	return w.life.Go(ctx, func(run, _ context.Context) { w.loop(run) })
}

// Stop stops the watch and waits for it.
func (w *idleWake) Stop(ctx context.Context) error { return w.life.Stop(ctx) }

// loop checks at once, then every tick, until ctx ends. A failed check is
// logged once until a check succeeds again; keys woken are logged at most
// once per idleWarnEvery.
func (w *idleWake) loop(ctx context.Context) {
	t := time.NewTicker(w.tick)
	defer t.Stop()
	failing := false
	var lastWarn time.Time
	unwarned := 0
	for {
		n, err := w.check(ctx)
		w.woken.Add(int64(n))
		unwarned += n
		if unwarned > 0 && time.Since(lastWarn) >= idleWarnEvery {
			w.logger.Warn(fmt.Sprintf("woke %d ordering keys that a release above read committed had left idle: "+
				"something completes ordered jobs at repeatable read or serializable (River's own completer, River UI or a worker's transaction), "+
				"which delays the next job of a key by up to a second; set default_transaction_isolation to read committed "+
				"for the workers' role or database (docs/ordering.md, Limits)", unwarned))
			lastWarn, unwarned = time.Now(), 0
		}
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			failing = false
			w.checks.Add(1)
		case ctx.Err() != nil:
			return
		case failing:
		case errors.As(err, &pgErr) && pgErr.Code == "42703":
			failing = true
			w.logger.Warn("idle ordering keys are not woken: the schema predates migration 018; run `outboxctl migrate`")
		default:
			failing = true
			w.logger.Warn("cannot wake idle ordering keys (retrying)", slog.String("error", err.Error()))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// check wakes the idle keys, each in a transaction of its own, and
// returns how many it woke.
func (w *idleWake) check(ctx context.Context) (int, error) {
	qctx, cancel := context.WithTimeout(ctx, idleQueryTimeout)
	defer cancel()
	rows, err := w.pool.Query(qctx, idleSQL, idleLimit)
	if err != nil {
		return 0, fmt.Errorf("read idle ordering keys: %w", err)
	}
	type key struct{ tenant, key, queue string }
	var keys []key
	var k key
	if _, err := pgx.ForEachRow(rows, []any{&k.tenant, &k.key, &k.queue}, func() error {
		keys = append(keys, k)
		return nil
	}); err != nil {
		return 0, fmt.Errorf("read idle ordering keys: %w", err)
	}
	n := 0
	for _, k := range keys {
		var woke bool
		err := pgx.BeginTxFunc(qctx, w.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
			return tx.QueryRow(qctx, `SELECT outbox_ordering_wake($1, $2, $3)`, k.tenant, k.key, k.queue).Scan(&woke)
		})
		if err != nil {
			return n, fmt.Errorf("wake ordering key %q (tenant %q, queue %s): %w", k.key, k.tenant, k.queue, err)
		}
		if woke {
			n++
		}
	}
	return n, nil
}
