package dispatcher

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/dbconn"
)

// wakeLockClass is the first key of the wake advisory lock; the second is
// hashtext('outbox_wake:' || schema), where schema holds outbox_event (see
// schemaSQL). The wake trigger uses the same pair.
const wakeLockClass = 1868720215

// wakeLock is the session advisory lock an idle dispatcher holds exclusively
// on a dedicated connection. While it is held, producers' commit-time wake
// trigger fails to take the key shared and so sends NOTIFY; while it is not,
// producers skip NOTIFY and its cluster-wide commit lock.
//
// Acquiring blocks behind producers that hold the key shared, i.e. that are
// committing right now without notifying; once it is granted their rows are
// visible, so the re-check the dispatcher runs next sees them. Each wait is
// bounded by lock_timeout. A timeout alone does not say who holds the key,
// so acquire asks pg_locks: when another idle dispatcher holds it
// exclusively, this one sleeps without it (producers notify, and NOTIFY
// reaches every listener); when only producers hold it (a slow commit: a
// slow fsync, a synchronous replica, a deferred trigger), sleeping would
// miss their rows and every commit after them, so the dispatcher must not
// sleep: it looks for work once more and tries again (a commit that never
// ends, e.g. behind a synchronous standby that is down, must not stop the
// dispatcher from handing off everything else meanwhile).
type wakeLock struct {
	connConfig *pgx.ConnConfig
	key        int32
	timeout    time.Duration

	conn *pgx.Conn
	held bool
	// connects is the listener's connection count when the lock was taken
	// (loop.keepLock: a lock kept across wakes is taken again after the
	// listener reconnected).
	connects uint64
}

// wakeHolderSQL reports whether another session holds the wake lock
// exclusively (an idle dispatcher), as opposed to producers holding it
// shared. pg_locks shows a two-key advisory lock as classid = first key,
// objid = second key (as oid), objsubid = 2.
const wakeHolderSQL = `
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory'
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = $1::int4::oid AND objid = $2::int4::oid AND objsubid = 2
      AND mode = 'ExclusiveLock' AND granted AND pid <> pg_backend_pid())`

// acquireResult is the outcome of acquire.
type acquireResult int

const (
	// lockHeld: the lock is held; re-check, then sleep.
	lockHeld acquireResult = iota
	// lockIdleElsewhere: another idle dispatcher holds it; sleep without.
	lockIdleElsewhere
	// lockProducers: producers hold it shared (commits under way that did
	// not notify): do not sleep; look for work and try again.
	lockProducers
)

// acquire makes one attempt, bounded by lock_timeout, to take the lock.
func (w *wakeLock) acquire(ctx context.Context) (acquireResult, error) {
	if w.held {
		return lockHeld, nil
	}
	if w.conn != nil && dbconn.OnReadOnlyNode(w.conn) {
		w.close() // a lock on a demoted or fenced node makes no producer notify
	}
	if w.conn == nil || w.conn.IsClosed() {
		cfg := w.connConfig.Copy()
		if cfg.RuntimeParams == nil {
			cfg.RuntimeParams = map[string]string{}
		}
		cfg.RuntimeParams["lock_timeout"] = fmt.Sprintf("%dms", w.timeout.Milliseconds())
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		conn, err := pgx.ConnectConfig(cctx, cfg)
		cancel()
		if err != nil {
			return lockIdleElsewhere, fmt.Errorf("wake lock: connect: %w", err)
		}
		w.conn = conn
	}
	idle, err := w.try(ctx)
	switch {
	case err != nil:
		w.close()
		return lockIdleElsewhere, err
	case w.held:
		return lockHeld, nil
	case idle:
		return lockIdleElsewhere, nil
	default:
		return lockProducers, nil
	}
}

// try makes one bounded attempt. On lock_timeout it reports whether an idle
// dispatcher is the holder.
func (w *wakeLock) try(ctx context.Context) (idle bool, err error) {
	qctx, cancel := context.WithTimeout(ctx, w.timeout+5*time.Second)
	defer cancel()
	_, err = w.conn.Exec(qctx, `SELECT pg_advisory_lock($1, $2)`, wakeLockClass, w.key)
	if err == nil {
		w.held = true
		return false, nil
	}
	if !isLockTimeout(err) {
		return false, fmt.Errorf("wake lock: %w", err)
	}
	if err := w.conn.QueryRow(qctx, wakeHolderSQL, wakeLockClass, w.key).Scan(&idle); err != nil {
		return false, fmt.Errorf("wake lock: find the holder: %w", err)
	}
	return idle, nil
}

// release gives the lock up.
func (w *wakeLock) release(ctx context.Context) error {
	if !w.held {
		return nil
	}
	w.held = false
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := w.conn.Exec(qctx, `SELECT pg_advisory_unlock($1, $2)`, wakeLockClass, w.key); err != nil {
		// A session we cannot talk to must not keep the lock.
		w.close()
		return fmt.Errorf("wake lock: release: %w", err)
	}
	return nil
}

// releaseLogged gives the lock up and logs a failure: the callers go on
// either way (a session that failed to unlock is closed, which ends the
// lock too).
func (w *wakeLock) releaseLogged(ctx context.Context, logger *slog.Logger) {
	if err := w.release(ctx); err != nil {
		logger.Warn("outbox wake lock release failed", slog.String("error", err.Error()))
	}
}

// releaseAsync gives the lock up in the background (a drain releases it
// concurrently with its first batch) and returns a function that waits for
// that. The wakeLock belongs to the loop goroutine: it marks the lock not
// held at once, hands the connection to the background release, and must
// call the returned function before it uses the wakeLock again (the
// channel close orders the release's writes before that use).
func (w *wakeLock) releaseAsync(ctx context.Context, logger *slog.Logger) (wait func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.releaseLogged(ctx, logger)
	}()
	return func() { <-done }
}

func (w *wakeLock) close() {
	w.held = false
	if w.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = w.conn.Close(ctx)
		cancel()
		w.conn = nil
	}
}
