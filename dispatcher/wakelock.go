package dispatcher

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/dbconn"
)

// wakeLockClass is the first key of the wake advisory lock; the second is
// outbox_wake_lock_key() (derived from the schema). The wake trigger uses
// the same pair.
const wakeLockClass = 1868720215

// wakeLock is the session advisory lock an idle dispatcher holds exclusively
// on a dedicated connection. While it is held, producers' commit-time wake
// trigger fails to take the key shared and so sends NOTIFY; while it is not,
// producers skip NOTIFY and its cluster-wide commit lock.
//
// Acquiring blocks behind producers that hold the key shared, i.e. that are
// committing right now without notifying; once it is granted their rows are
// visible, so the re-check the dispatcher runs next sees them. The wait is
// bounded by lock_timeout: when another idle dispatcher holds the key, this
// one gives up and sleeps without it (producers notify all listeners).
type wakeLock struct {
	connConfig *pgx.ConnConfig
	key        int32
	timeout    time.Duration

	conn *pgx.Conn
	held bool
}

// acquire tries to take the lock; it reports whether it is held.
func (w *wakeLock) acquire(ctx context.Context) (bool, error) {
	if w.held {
		return true, nil
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
			return false, fmt.Errorf("wake lock: connect: %w", err)
		}
		w.conn = conn
	}
	qctx, cancel := context.WithTimeout(ctx, w.timeout+5*time.Second)
	defer cancel()
	_, err := w.conn.Exec(qctx, `SELECT pg_advisory_lock($1, $2)`, wakeLockClass, w.key)
	if err != nil {
		if isLockTimeout(err) {
			return false, nil // another idle dispatcher holds it
		}
		w.close()
		return false, fmt.Errorf("wake lock: %w", err)
	}
	w.held = true
	return true, nil
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

func (w *wakeLock) close() {
	w.held = false
	if w.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = w.conn.Close(ctx)
		cancel()
		w.conn = nil
	}
}
