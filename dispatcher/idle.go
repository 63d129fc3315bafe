package dispatcher

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

const (
	// idleListTimeout bounds the statement that lists idle keys.
	idleListTimeout = 5 * time.Second
	// idleKeyTimeout bounds the wake of one key; idleLockTimeout its
	// wait for a lock, so that a key held for long (a handoff, or an
	// operator's session) is passed and tried again at the next check.
	idleKeyTimeout  = 5 * time.Second
	idleLockTimeout = "2s"
	// idleLimit is how many keys one pass lists; a pass that lists a full
	// batch and wakes some is followed at once by another.
	idleLimit = 100
	// idleLogEvery is how often at most the wake logs that it woke keys,
	// or that it keeps failing.
	idleLogEvery = time.Minute
)

// idleSQL lists idle keys through outbox_ordering_key_idle_idx (nothing to
// read when none is idle): those with jobs in line first, then the others
// (whose wake only deletes their rows), oldest first.
const idleSQL = `
SELECT k.tenant_id, k.ordering_key, k.queue FROM outbox_ordering_key k
WHERE k.idle_since IS NOT NULL
ORDER BY EXISTS (SELECT 1 FROM outbox_ordering_wait w
                 WHERE w.tenant_id = k.tenant_id AND w.ordering_key = k.ordering_key AND w.queue = k.queue) DESC,
         k.idle_since
LIMIT $1`

// idleWake releases the ordering keys that a release above READ COMMITTED
// left idle (migration 018). Such a release (River's own completer, River
// UI or a worker's transaction, at a role's or database's
// default_transaction_isolation of repeatable read or serializable)
// cannot see a job that a handoff queued behind the key's head while it
// waited, so it keeps the key's row, marked idle, instead of deleting it;
// later handoffs queue behind it. Each check wakes the idle keys, each in
// a transaction of its own at READ COMMITTED (outbox_ordering_wake: the
// first job in line becomes the head, or the row goes), so such a key's
// next job starts about a second late, in order. At READ COMMITTED no key
// is ever idle, and a check reads nothing.
type idleWake struct {
	pool   *pgxpool.Pool
	logger *slog.Logger
	tick   time.Duration
	life   service.Lifecycle

	// woken counts the keys woken, failed the keys whose wake failed,
	// checks the checks made (test signals).
	woken, failed, checks atomic.Int64
}

// Start starts the wake's goroutine.
func (w *idleWake) Start(ctx context.Context) error {
	return w.life.Go(ctx, func(run, _ context.Context) { w.loop(run) })
}

// Stop stops it and waits for it.
func (w *idleWake) Stop(ctx context.Context) error { return w.life.Stop(ctx) }

// loop checks at once, then every tick (at once again after a check that
// found a full batch and woke keys), until ctx ends. What it woke and what
// failed are logged at most once per idleLogEvery each.
func (w *idleWake) loop(ctx context.Context) {
	t := time.NewTicker(w.tick)
	defer t.Stop()
	var (
		lastWoke, lastFail time.Time
		unlogged           int
		// oldSchema is when a check last found the schema before 018:
		// until a minute later the loop checks nothing (each check would
		// put a failed statement in the server's log).
		oldSchema time.Time
	)
	for {
		if !oldSchema.IsZero() && time.Since(oldSchema) < idleLogEvery {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				continue
			}
		}
		listed, woke, err := w.check(ctx)
		w.checks.Add(1)
		w.woken.Add(int64(woke))
		unlogged += woke
		if unlogged > 0 && time.Since(lastWoke) >= idleLogEvery {
			w.logger.Warn(fmt.Sprintf("outbox: woke %d ordering keys that a release above read committed had left idle: "+
				"something completes ordered jobs at repeatable read or serializable (River's own completer, River UI or a worker's transaction), "+
				"which delays the next job of such a key by about a second; set default_transaction_isolation to read committed "+
				"for the workers' role or database (docs/ordering.md, Limits)", unlogged))
			lastWoke, unlogged = time.Now(), 0
		}
		var pgErr *pgconn.PgError
		switch {
		case ctx.Err() != nil:
			return
		case err == nil:
			oldSchema = time.Time{}
		case errors.As(err, &pgErr) && pgErr.Code == "42703": // no idle_since: before 018
			if oldSchema.IsZero() {
				w.logger.Warn("outbox: idle ordering keys are not woken: the schema predates migration 018; run `outboxctl migrate`")
			}
			oldSchema = time.Now()
		case time.Since(lastFail) >= idleLogEvery:
			lastFail = time.Now()
			w.logger.Warn("outbox: cannot wake idle ordering keys (retrying)", slog.String("error", err.Error()))
		}
		if listed == idleLimit && woke > 0 {
			// More may be idle: no wait. A key that failed is listed
			// again, but a check that wakes none waits for the tick.
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// check lists idle keys and wakes each in a transaction of its own; a key
// that fails is passed (tried again at the next check). It returns how many
// keys it listed and woke, and the first error.
func (w *idleWake) check(ctx context.Context) (listed, woke int, err error) {
	lctx, cancel := context.WithTimeout(ctx, idleListTimeout)
	rows, err := w.pool.Query(lctx, idleSQL, idleLimit)
	if err != nil {
		cancel()
		return 0, 0, fmt.Errorf("list idle ordering keys: %w", err)
	}
	type key struct{ tenant, key, queue string }
	var keys []key
	var k key
	_, err = pgx.ForEachRow(rows, []any{&k.tenant, &k.key, &k.queue}, func() error {
		keys = append(keys, k)
		return nil
	})
	cancel()
	if err != nil {
		return 0, 0, fmt.Errorf("list idle ordering keys: %w", err)
	}
	var first error
	for _, k := range keys {
		if ctx.Err() != nil {
			break
		}
		ok, err := w.wakeKey(ctx, k.tenant, k.key, k.queue)
		switch {
		case err != nil:
			w.failed.Add(1)
			if first == nil {
				first = fmt.Errorf("wake ordering key %q (tenant %q, queue %s): %w", k.key, k.tenant, k.queue, err)
			}
		case ok:
			woke++
		}
	}
	return len(keys), woke, first
}

// wakeKey runs outbox_ordering_wake for one key at READ COMMITTED.
func (w *idleWake) wakeKey(ctx context.Context, tenant, key, queue string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, idleKeyTimeout)
	defer cancel()
	var woke bool
	err := pgx.BeginTxFunc(ctx, w.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '`+idleLockTimeout+`'`); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT outbox_ordering_wake($1, $2, $3)`, tenant, key, queue).Scan(&woke)
	})
	return woke, err
}
