package claim

import (
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestHandoffRunsAtReadCommitted: a batch's transaction runs at READ
// COMMITTED when the session's default_transaction_isolation is higher
// (set for the role or the database). At REPEATABLE READ, the ordering
// trigger of a job queued behind a key whose row a release deleted after
// the claim's snapshot fails the batch with a serialization error.
func TestHandoffRunsAtReadCommitted(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	for _, level := range []string{"repeatable read", "serializable"} {
		pool := pgtest.IsolationPool(t, s, level)
		h := &Handoff{Pool: pool}
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		tx, _, err := h.begin(ctx, conn.Conn(), budgetedClaimSQL, 10, DefaultBatchBytes, outbox.MaxPayloadBytes)
		if err != nil {
			conn.Release()
			t.Fatal(err)
		}
		var got string
		err = tx.QueryRow(ctx, `SELECT current_setting('transaction_isolation')`).Scan(&got)
		_ = tx.Rollback(ctx)
		conn.Release()
		if err != nil {
			t.Fatal(err)
		}
		if got != "read committed" {
			t.Errorf("default %s: the batch's transaction runs at %s, want read committed", level, got)
		}
	}
}
