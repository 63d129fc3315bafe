package admin_test

import (
	"testing"
	"time"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestUnparkSkipAtRepeatableRead: an operator's session whose transactions
// start at REPEATABLE READ (default_transaction_isolation set for the
// role or the database) skips a parked head whose line looks empty while a
// handoff is queueing a job behind it: the skip waits for the handoff and
// releases that job. Unpark runs at READ COMMITTED whatever the session's
// default; at REPEATABLE READ the release could not see the job after the
// wait, deleted the key's row and left the job pending with nothing to
// release it.
func TestUnparkSkipAtRepeatableRead(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	ids := keyed(t, s, "acme", "k", 1)
	handOff(t, s)
	head := jobOf(t, s, ids[0])
	discard(t, s, head)

	handoff, pid := pgtest.OpenTx(t, ctx, s.Pool)
	var queued int64
	var state string
	err := handoff.QueryRow(ctx, `
		INSERT INTO river_job (kind, args, queue, max_attempts, metadata)
		VALUES ('order_step', '{}', 'outbox_order', 3,
		        jsonb_build_object('outbox_tenant_id', 'acme', 'outbox_ordering_key', 'k', 'outbox_ordering_position', 1e15::bigint))
		RETURNING id, state::text`).Scan(&queued, &state)
	if err != nil || state != "pending" {
		t.Fatalf("job queued behind the parked head as %q (%v), want pending", state, err)
	}

	cl := admin.New(pgtest.IsolationPool(t, s, "repeatable read"))
	done := make(chan error, 1)
	go func() {
		_, err := cl.Unpark(ctx, admin.UnparkRequest{Actor: "alice", Key: "k", Tenant: "acme", Action: admin.UnparkSkip})
		done <- err
	}()
	pgtest.WaitFor(t, 30*time.Second, "the skip waits for the handoff", func() bool { return pgtest.WaitingFor(t, s.Pool, pid) })
	if err := handoff.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("unpark: %v", err)
	}
	if st := jobState(t, s, queued); st != "available" {
		t.Fatalf("the job queued behind the skipped head is %s, want available", st)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE head_job_id = $1 AND parked_at IS NULL`, queued); n != 1 {
		t.Fatalf("the queued job heads %d unparked keys, want 1", n)
	}
}
