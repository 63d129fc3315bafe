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

	// Queued as the handoff queues it: its id taken first, it waits in the
	// key's line, not in river_job (migration 024).
	handoff, pid := pgtest.OpenTx(t, ctx, s.Pool)
	var queued int64
	if err := handoff.QueryRow(ctx, `SELECT nextval('river_job_id_seq')`).Scan(&queued); err != nil {
		t.Fatal(err)
	}
	if _, err := handoff.Exec(ctx, `
		INSERT INTO river_job (id, kind, args, queue, max_attempts, metadata)
		SELECT $1, 'order_step', '{}', 'outbox_order', 3,
		       jsonb_build_object('outbox_tenant_id', 'acme', 'outbox_ordering_key', 'k', 'outbox_ordering_position', 1e15::bigint)
		FROM `+pgtest.AsHandoff, queued); err != nil {
		t.Fatal(err)
	}
	var state string
	var waits bool
	err := handoff.QueryRow(ctx, `SELECT state, in_line FROM `+pgtest.Jobs+` WHERE id = $1`, queued).Scan(&state, &waits)
	if err != nil || state != "pending" || !waits {
		t.Fatalf("job queued behind the parked head as %q (in the line: %t, %v), want pending in the key's line", state, waits, err)
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
	if st := jobState(t, s, queued); st != "available" || inLine(t, s, queued) {
		t.Fatalf("the job queued behind the skipped head is %s, want available in River", st)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE head_job_id = $1 AND parked_at IS NULL`, queued); n != 1 {
		t.Fatalf("the queued job heads %d unparked keys, want 1", n)
	}
}
