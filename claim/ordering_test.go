package claim_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// keyed is a mail event of an ordering key (and tenant).
func keyed(tenant, key string) outbox.Event {
	return outbox.Event{Type: "mail.order.changed", TenantID: tenant, OrderingKey: key}
}

// jobOf returns the id of event id's River job, 0 when it has none. A job
// that waits in its key's line (migration 024) is not in river_job until
// its turn: it is read with the others through pgtest.Jobs, with the id
// the handoff gave it.
func jobOf(t *testing.T, pool *pgxpool.Pool, id int64) int64 {
	t.Helper()
	var job int64
	err := pool.QueryRow(context.Background(), `SELECT coalesce(max(river_job.id), 0) FROM `+pgtest.Jobs+` WHERE (river_job.metadata->>'outbox_event_id')::bigint = $1`, id).Scan(&job)
	if err != nil {
		t.Fatal(err)
	}
	return job
}

// batch runs one batch and fails the test on an error.
func batch(t *testing.T, h *claim.Handoff) claim.Result {
	t.Helper()
	res, err := h.Batch(context.Background(), 100)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// lockElsewhere locks event id in a transaction of its own, as another
// batch (or a stalled session) holds it, until the test rolls it back or
// ends.
func lockElsewhere(t *testing.T, pool *pgxpool.Pool, id int64) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, `SELECT id FROM outbox_event WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	return tx
}

// wantStatus checks an event's status, retries and job count.
func wantStatus(t *testing.T, pool *pgxpool.Pool, what string, id int64, status string, retries, jobs int) {
	t.Helper()
	if r := get(t, pool, id); r.status != status || r.retries != retries || r.jobs != jobs {
		t.Errorf("%s (event %d) = %+v, want %s with %d retries and %d jobs", what, id, r, status, retries, jobs)
	}
}

// wantJobsInOrder checks that the events' jobs exist (in River or waiting
// in their key's line) and were inserted in the given order: the handoff
// takes their ids from River's sequence in insert order.
func wantJobsInOrder(t *testing.T, pool *pgxpool.Pool, ids ...int64) {
	t.Helper()
	var prev int64
	for i, id := range ids {
		job := jobOf(t, pool, id)
		if job == 0 || job <= prev {
			t.Errorf("event %d (number %d in key order) has job %d, want one after %d", id, i, job, prev)
		}
		prev = job
	}
}

// TestClaimWaitsForEarlierEventHeldByAnotherBatch: an event whose earlier
// same-key event is pending and due but row-locked by another transaction
// (another dispatcher's batch) is claimed and left pending, counted in
// Blocked with BlockedSoon; events without a key and of another key in the
// same batch are handed off. Once the other transaction ends, both events
// of the key are handed off, in order.
func TestClaimWaitsForEarlierEventHeldByAnotherBatch(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	h := newHandoff(t, s.Pool, 6, nil)
	ids := pgtest.Publish(t, s.Pool, keyed("acme", "k"), keyed("acme", "k"), keyed("acme", "other"), outbox.Event{Type: "mail.a.b"})
	other := lockElsewhere(t, s.Pool, ids[0])

	res := batch(t, h)
	if res.Claimed != 3 || res.Blocked != 1 || !res.BlockedSoon || res.Done != 2 {
		t.Fatalf("batch with the head locked elsewhere: %+v, want 3 claimed, 1 blocked (soon), 2 done", res)
	}
	wantStatus(t, s.Pool, "the later event of the key", ids[1], "pending", 0, 0)
	wantStatus(t, s.Pool, "the event of another key", ids[2], "done", 0, 1)
	wantStatus(t, s.Pool, "the event without a key", ids[3], "done", 0, 1)

	if err := other.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	res = batch(t, h)
	if res.Done != 2 || res.Blocked != 0 {
		t.Fatalf("batch after the other transaction ended: %+v, want both events of the key done", res)
	}
	wantJobsInOrder(t, s.Pool, ids[0], ids[1])
}

// TestClaimWaitsForEarlierEventNotYetDue: an event behind an earlier event
// of its key that is not due yet (NotBefore) waits, without BlockedSoon
// (nothing will hand the earlier one off shortly), until the earlier one is
// due; then both go in order. The batch that finds it held moves its due
// time towards the earlier event's, a minute on at most (Held, migration
// 021), so the next claim leaves it alone; an earlier due time for the
// earlier event puts it back.
func TestClaimWaitsForEarlierEventNotYetDue(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	h := newHandoff(t, s.Pool, 6, nil)
	later := keyed("", "k")
	first := later
	first.NotBefore = time.Now().Add(time.Hour)
	ids := pgtest.Publish(t, s.Pool, first, later)
	if res := batch(t, h); res.Claimed != 1 || res.Blocked != 1 || res.Held != 1 || res.BlockedSoon || res.Done != 0 {
		t.Fatalf("batch with the head not due: %+v, want the later event blocked (not soon) and held", res)
	}
	// The head is due in an hour: the later event is moved a minute on
	// (holdFor), its own due time kept.
	if n := pgtest.Count(t, s.Pool, `
		SELECT count(*) FROM outbox_event
		WHERE id = $1 AND held_from <= now()
		  AND scheduled_at > now() + interval '50 seconds' AND scheduled_at <= now() + interval '61 seconds'`, ids[1]); n != 1 {
		t.Fatal("the later event is not held a minute on, or its own due time is not kept")
	}
	if res := batch(t, h); res.Claimed != 0 {
		t.Fatalf("batch after the later event was held: %+v, want nothing claimed", res)
	}
	wantStatus(t, s.Pool, "the later event", ids[1], "pending", 0, 0)
	if _, err := s.Pool.Exec(context.Background(), `UPDATE outbox_event SET scheduled_at = now() - interval '1 second' WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if res := batch(t, h); res.Done != 2 {
		t.Fatalf("batch with the head due: %+v, want both done", res)
	}
	wantJobsInOrder(t, s.Pool, ids[0], ids[1])
}

// TestHoldOnASchemaBefore021: without migration 021's held_from the batch
// leaves a held event as it was (blocked, not moved, claimed again by the
// next batch) instead of failing.
func TestHoldOnASchemaBefore021(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	if _, err := s.Pool.Exec(context.Background(), `ALTER TABLE outbox_event DROP COLUMN held_from CASCADE`); err != nil {
		t.Fatal(err)
	}
	h := newHandoff(t, s.Pool, 6, nil)
	later := keyed("", "k")
	first := later
	first.NotBefore = time.Now().Add(time.Hour)
	pgtest.Publish(t, s.Pool, first, later)
	for range 2 {
		if res := batch(t, h); res.Claimed != 1 || res.Blocked != 1 || res.Held != 0 || res.Done != 0 {
			t.Fatalf("batch on a schema before 021: %+v, want the later event blocked, not held, claimed again", res)
		}
	}
}

// TestHoldFailureKeepsTheBatch: the hold runs under a savepoint, so when
// it fails (here a trigger of the user's rejects it) the batch's handoff
// commits without it: the other events are handed off in the same
// transaction, not event by event, the held event stays due with its own
// due time, the failure is logged, and holds are off for a minute.
func TestHoldFailureKeepsTheBatch(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	if _, err := s.Pool.Exec(ctx, `
		CREATE FUNCTION reject_hold() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'no holds here'; END $$;
		CREATE TRIGGER reject_hold BEFORE UPDATE ON outbox_event
			FOR EACH ROW WHEN (OLD.held_from IS NULL AND NEW.held_from IS NOT NULL)
			EXECUTE FUNCTION reject_hold()`); err != nil {
		t.Fatal(err)
	}
	var logged bytes.Buffer
	h := newHandoff(t, s.Pool, 6, nil)
	h.Logger = slog.New(slog.NewTextHandler(&logged, nil))
	first := keyed("", "k")
	first.NotBefore = time.Now().Add(time.Hour)
	ids := pgtest.Publish(t, s.Pool, first, keyed("", "k"), outbox.Event{Type: "mail.user.welcomed"})

	res := batch(t, h)
	if res.Claimed != 2 || res.Done != 1 || res.Blocked != 1 || res.Held != 0 || res.Fallback {
		t.Fatalf("batch whose hold fails: %+v, want the unkeyed event done in the batch and the later event blocked, not held", res)
	}
	wantStatus(t, s.Pool, "the unkeyed event", ids[2], "done", 0, 1)
	wantStatus(t, s.Pool, "the held-back event", ids[1], "pending", 0, 0)
	if r := get(t, s.Pool, ids[1]); r.delay > 0 {
		t.Errorf("the held-back event is due in %v, want its own due time (now)", r.delay)
	}
	var heldFrom *time.Time
	if err := s.Pool.QueryRow(ctx, `SELECT held_from FROM outbox_event WHERE id = $1`, ids[1]).Scan(&heldFrom); err != nil || heldFrom != nil {
		t.Errorf("held_from of the held-back event = %v, %v; want NULL", heldFrom, err)
	}
	if !strings.Contains(logged.String(), "no holds here") {
		t.Errorf("the hold's failure is not logged; log: %q", logged.String())
	}
	// The next batch finds the event again (as on a schema before 021),
	// and does not try to hold it: holds are off for a minute, so a hold
	// that keeps failing costs no rollback and no warning per batch.
	logged.Reset()
	if res := batch(t, h); res.Claimed != 1 || res.Blocked != 1 || res.Held != 0 || res.Done != 0 {
		t.Fatalf("next batch: %+v, want the later event claimed and blocked again", res)
	}
	if logged.Len() != 0 {
		t.Errorf("the next batch logged %q, want nothing: holds are off after a failed one", logged.String())
	}
}

// TestClaimWaitsBehindDeadLetteredEvent: an event whose River insert fails
// is dead-lettered (MaxRetries 0) in the event-by-event fallback, and the
// later event of its key, in the same batch, is skipped there without
// being charged. The next batch keeps it pending (Blocked, not soon) and
// moves its due time a minute on (Held, migration 021), so later batches
// leave it alone while the earlier event is failed; a requeue
// (outbox_requeue) puts it back and lets both go, in order. A second key
// whose failed head is cancelled (admin.Cancel) lets its later event go
// too.
func TestClaimWaitsBehindDeadLetteredEvent(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	poisonRiver(t, s.Pool)
	h := newHandoff(t, s.Pool, 0, nil)
	poison := func(key string) outbox.Event { return outbox.Event{Type: "poison.order.changed", OrderingKey: key} }
	ids := pgtest.Publish(t, s.Pool, poison("requeued"), keyed("", "requeued"), poison("cancelled"), keyed("", "cancelled"))

	res := batch(t, h)
	if !res.Fallback || res.DeadLettered != 2 || res.Skipped != 2 || res.Done != 0 {
		t.Fatalf("batch with poisoned heads: %+v, want both heads dead-lettered and both later events skipped", res)
	}
	wantStatus(t, s.Pool, "dead-lettered head", ids[0], "failed", 1, 0)
	for _, id := range []int64{ids[1], ids[3]} {
		wantStatus(t, s.Pool, "the later event", id, "pending", 0, 0)
		if r := get(t, s.Pool, id); r.lastError != "" {
			t.Errorf("the skipped event %d got last_error %q", id, r.lastError)
		}
	}
	if res := batch(t, h); res.Claimed != 2 || res.Blocked != 2 || res.Held != 2 || res.BlockedSoon || res.Done != 0 {
		t.Fatalf("batch behind dead-lettered heads: %+v, want both later events blocked (not soon) and held", res)
	}
	if res := batch(t, h); res.Claimed != 0 {
		t.Fatalf("batch after the later events were held: %+v, want nothing claimed", res)
	}

	if _, err := s.Pool.Exec(ctx, `DROP TRIGGER reject_poison ON river_job`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_requeue('test', false, ids => $1)`, []int64{ids[0]}); err != nil {
		t.Fatal(err)
	}
	cancelled, err := admin.New(s.Pool).Cancel(ctx, admin.Selection{IDs: []int64{ids[2]}}, admin.CancelOpts{Actor: "test"})
	if err != nil || cancelled.Affected != 1 {
		t.Fatalf("cancel the second head: %+v, %v", cancelled, err)
	}
	if res := batch(t, h); res.Done != 3 || res.Blocked != 0 {
		t.Fatalf("batch after the requeue and the cancel: %+v, want 3 done", res)
	}
	// The poisoned head and the later event go to different queues, each
	// ordered on its own: each has its job (the insert puts a batch's
	// jobs in (tenant, key, queue) order, not across queues).
	for _, id := range ids[:2] {
		if jobOf(t, s.Pool, id) == 0 {
			t.Errorf("event %d has no job", id)
		}
	}
	wantStatus(t, s.Pool, "the cancelled head", ids[2], "cancelled", 1, 0)
	wantStatus(t, s.Pool, "the event behind the cancelled head", ids[3], "done", 0, 1)
}

// TestUnroutableEventStopsItsKeyInTheBatch: an unroutable keyed event is
// failed at once, and the later events of its key in the same batch stay
// pending (Blocked), not failed, while other keys and unkeyed events of the
// batch are handed off. They wait behind the failed event, held out of the
// claim (migration 021), until it is cancelled.
func TestUnroutableEventStopsItsKeyInTheBatch(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	h := newHandoff(t, s.Pool, 6, nil)
	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "nowhere.order.changed", OrderingKey: "k"},
		keyed("", "k"), keyed("", "k"), keyed("", "other"), outbox.Event{Type: "mail.a.b"})

	res := batch(t, h)
	if res.Unroutable != 1 || res.Blocked != 2 || res.Held != 2 || res.Done != 2 || res.Fallback {
		t.Fatalf("batch: %+v, want 1 unroutable, 2 blocked and held, 2 done", res)
	}
	if r := get(t, s.Pool, ids[0]); r.status != "failed" {
		t.Errorf("the unroutable event = %+v, want failed", r)
	}
	wantStatus(t, s.Pool, "the first event behind the unroutable one", ids[1], "pending", 0, 0)
	wantStatus(t, s.Pool, "the second event behind the unroutable one", ids[2], "pending", 0, 0)
	wantStatus(t, s.Pool, "the event of another key", ids[3], "done", 0, 1)
	wantStatus(t, s.Pool, "the event without a key", ids[4], "done", 0, 1)

	if res := batch(t, h); res.Claimed != 0 {
		t.Fatalf("next batch: %+v, want nothing claimed: both later events are held", res)
	}
	if _, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_cancel('test', false, ids => $1)`, []int64{ids[0]}); err != nil {
		t.Fatal(err)
	}
	if res := batch(t, h); res.Done != 2 {
		t.Fatalf("batch after the cancel: %+v, want 2 done", res)
	}
	wantJobsInOrder(t, s.Pool, ids[1], ids[2])
}

// TestTenantsKeysAreApart: the same ordering key in two tenants (and
// without a tenant) are three keys: an earlier event of tenant a held by
// another transaction blocks only tenant a's later event.
func TestTenantsKeysAreApart(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	h := newHandoff(t, s.Pool, 6, nil)
	ids := pgtest.Publish(t, s.Pool, keyed("a", "k"), keyed("a", "k"), keyed("b", "k"), keyed("", "k"))
	lockElsewhere(t, s.Pool, ids[0])
	if res := batch(t, h); res.Blocked != 1 || res.Done != 2 {
		t.Fatalf("batch: %+v, want tenant a's later event blocked and the other tenants' events done", res)
	}
	wantStatus(t, s.Pool, "tenant a's later event", ids[1], "pending", 0, 0)
	wantStatus(t, s.Pool, "tenant b's event", ids[2], "done", 0, 1)
	wantStatus(t, s.Pool, "the tenantless event", ids[3], "done", 0, 1)
}

// TestJobsOfAKeyAreInsertedInPositionOrder: two events of a key whose ids
// disagree with their positions (the later position has the smaller id,
// as when a producer draws its id before waiting for the key's lock) and
// the same scheduled_at are claimed in id order; their River jobs are
// inserted in position order, so the earlier position's job is the head
// and the other waits pending in the key's line (not in river_job, since
// migration 024); the head's completion inserts it into river_job,
// available, with the id the handoff gave it.
func TestJobsOfAKeyAreInsertedInPositionOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	h := newHandoff(t, s.Pool, 6, nil)
	const unkeyed = 700
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	// The same transaction: the same now() for scheduled_at.
	for _, q := range []string{
		`INSERT INTO outbox_event (id, event_type, payload, ordering_key) OVERRIDING SYSTEM VALUE VALUES (1000, 'mail.order.changed', '{}', 'k')`,
		`INSERT INTO outbox_event (id, event_type, payload) OVERRIDING SYSTEM VALUE VALUES (700, 'mail.a.b', '{}')`,
		`INSERT INTO outbox_event (id, event_type, payload, ordering_key) OVERRIDING SYSTEM VALUE VALUES (500, 'mail.order.changed', '{}', 'k')`,
	} {
		if _, err := tx.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event a JOIN outbox_event b ON a.id = 1000 AND b.id = 500 WHERE a.ordering_position < b.ordering_position AND a.scheduled_at = b.scheduled_at`); n != 1 {
		t.Fatal("setup: event 1000 should have the earlier position and the same scheduled_at as event 500")
	}
	if res := batch(t, h); res.Done != 3 {
		t.Fatalf("batch: %+v, want 3 done", res)
	}
	wantJobsInOrder(t, s.Pool, 1000, 500)
	if jobOf(t, s.Pool, unkeyed) == 0 {
		t.Error("the unkeyed event has no job")
	}
	var headEvent int64
	var waiting int
	if err := s.Pool.QueryRow(ctx, `SELECT head_event_id, (SELECT count(*) FROM outbox_ordering_wait WHERE ordering_key = 'k') FROM outbox_ordering_key WHERE ordering_key = 'k'`).Scan(&headEvent, &waiting); err != nil {
		t.Fatal(err)
	}
	head, later := jobOf(t, s.Pool, 1000), jobOf(t, s.Pool, 500)
	var state string
	var inLine bool
	if err := s.Pool.QueryRow(ctx, `SELECT state, in_line FROM `+pgtest.Jobs+` WHERE id = $1`, later).Scan(&state, &inLine); err != nil {
		t.Fatal(err)
	}
	if headEvent != 1000 || waiting != 1 || state != "pending" || !inLine {
		t.Errorf("head event %d, %d waiting, the later position's job %s (in line %v); want head 1000, 1 waiting, pending in line", headEvent, waiting, state, inLine)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1`, later); n != 0 {
		t.Errorf("the waiting job %d is in river_job, want it only in its key's line", later)
	}
	// The head's completion lets the waiting job into River, with its id.
	for _, q := range []string{
		`UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = $1`,
		`UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = $1 AND state = 'running'`,
	} {
		if _, err := s.Pool.Exec(ctx, q, head); err != nil {
			t.Fatal(err)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'available'`, later); n != 1 {
		t.Errorf("after the head's completion the later position's job %d is not available in river_job", later)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait WHERE job_id = $1`, later); n != 0 {
		t.Errorf("after the head's completion the later position's job %d is still in the line", later)
	}
}

// TestOneSkipsABlockedEventWithoutCharge: the event-by-event handoff
// (Handoff.One, the fallback of a failed batch) leaves an event whose
// earlier same-key event is not handed off yet: Skipped, no retry charged,
// no last_error, no new due time, no job.
func TestOneSkipsABlockedEventWithoutCharge(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	h := newHandoff(t, s.Pool, 6, nil)
	first := keyed("", "k")
	first.NotBefore = time.Now().Add(time.Hour)
	ids := pgtest.Publish(t, s.Pool, first, keyed("", "k"))
	before := get(t, s.Pool, ids[1])
	res, err := h.One(context.Background(), ids[1], errors.New("the batch failed"))
	if err != nil {
		t.Fatal(err)
	}
	if res.Skipped != 1 || res.Done != 0 || res.Retried != 0 || res.DeadLettered != 0 {
		t.Fatalf("One of a blocked event: %+v, want skipped", res)
	}
	after := get(t, s.Pool, ids[1])
	if after.status != "pending" || after.retries != 0 || after.lastError != "" || after.jobs != 0 || after.delay > before.delay+time.Second {
		t.Errorf("the skipped event = %+v (before %+v), want it untouched", after, before)
	}
	// Unblocked, One hands it off.
	if _, err := s.Pool.Exec(context.Background(), `UPDATE outbox_event SET status = 'cancelled' WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if res, err := h.One(context.Background(), ids[1], nil); err != nil || res.Done != 1 {
		t.Fatalf("One once unblocked: %+v, %v", res, err)
	}
}

// TestHandoffAnnouncesOnlyRunnableJobs: a batch whose only job waits
// behind its key's head (in the key's line, not in river_job, since
// migration 024) wakes no worker: the ordering trigger announces the job
// when it releases it. A batch with a runnable job announces its queue.
func TestHandoffAnnouncesOnlyRunnableJobs(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	received := s.ListenRiverInsert(t, ctx)
	h := newHandoff(t, s.Pool, 0, nil)

	pgtest.Publish(t, s.Pool, keyed("", "k"))
	if res := batch(t, h); res.Done != 1 {
		t.Fatalf("first batch %+v", res)
	}
	if got := received(); len(got) == 0 || !slices.Contains(got, `{"queue": "outbox_mail"}`) {
		t.Fatalf("a batch with the key's head announced %v, want outbox_mail", got)
	}
	waiting := pgtest.Publish(t, s.Pool, keyed("", "k"))
	if res := batch(t, h); res.Done != 1 {
		t.Fatalf("second batch %+v", res)
	}
	job := jobOf(t, s.Pool, waiting[0])
	if st := pgtest.Count(t, s.Pool, `SELECT count(*) FROM `+pgtest.Jobs+` WHERE state = 'pending' AND in_line AND id = $1`, job); st != 1 {
		t.Fatal("the second job is not waiting behind the head")
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1`, job); n != 0 {
		t.Fatal("the second job is in river_job while it waits, want it only in its key's line")
	}
	if got := received(); len(got) != 0 {
		t.Fatalf("a batch of a waiting job announced %v, want nothing", got)
	}
}

// TestBatchOfKeyClaimsOneKeyInItsOrder: BatchOfKey claims the due events
// of one (tenant, key) only, in the key's order and up to its limit, and
// reports the key as the batch's top key; other keys, other tenants' same
// key, unkeyed events and events not due yet stay pending.
func TestBatchOfKeyClaimsOneKeyInItsOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	h := newHandoff(t, s.Pool, 6, nil)
	later := keyed("a", "k")
	later.NotBefore = time.Now().Add(time.Hour)
	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "mail.order.changed"}, keyed("b", "k"), keyed("a", "k"), keyed("a", "j"),
		keyed("a", "k"), keyed("a", "k"), keyed("a", "k"), later)
	key := claim.Key{TenantID: "a", OrderingKey: "k"}

	res, err := h.BatchOfKey(ctx, 2, key)
	if err != nil {
		t.Fatal(err)
	}
	if res.Claimed != 2 || res.Done != 2 || res.TopKey != key || res.TopKeyDone != 2 {
		t.Fatalf("first batch of key a/k: %+v, want its first two events handed off", res)
	}
	wantJobsInOrder(t, s.Pool, ids[2], ids[4])
	res, err = h.BatchOfKey(ctx, 10, key)
	if err != nil {
		t.Fatal(err)
	}
	if res.Claimed != 2 || res.Done != 2 {
		t.Fatalf("second batch of key a/k: %+v, want its two due events left handed off", res)
	}
	wantJobsInOrder(t, s.Pool, ids[2], ids[4], ids[5], ids[6])
	for what, id := range map[string]int64{"the unkeyed event": ids[0], "tenant b's key k": ids[1], "key j": ids[3], "key a/k's event due in an hour": ids[7]} {
		wantStatus(t, s.Pool, what, id, "pending", 0, 0)
	}
	if res, err = h.BatchOfKey(ctx, 10, key); err != nil || res.Claimed != 0 {
		t.Fatalf("third batch of key a/k: %+v, %v, want nothing claimed", res, err)
	}
}

// TestBatchOfKeyKeepsTheKeysOrder: a claim by key follows the key's
// positions, not claim order, and holds back what an earlier event
// outside the batch blocks. Key k's later events are due a second before
// its first, so claim order puts the first last; and
// while another transaction holds the first event locked, the claim by key
// skips it and hands nothing off.
func TestBatchOfKeyKeepsTheKeysOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	h := newHandoff(t, s.Pool, 6, nil)
	ids := pgtest.Publish(t, s.Pool, keyed("", "k"), keyed("", "k"), keyed("", "k"))
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET scheduled_at = scheduled_at - interval '1 second' WHERE id = ANY($1)`, ids[1:]); err != nil {
		t.Fatal(err)
	}
	key := claim.Key{OrderingKey: "k"}

	other := lockElsewhere(t, s.Pool, ids[0])
	res, err := h.BatchOfKey(ctx, 10, key)
	if err != nil {
		t.Fatal(err)
	}
	if res.Done != 0 || res.Blocked != 2 || !res.BlockedSoon {
		t.Fatalf("claim by key with its first event locked elsewhere: %+v, want the other two held back, soon", res)
	}
	if err := other.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	res, err = h.BatchOfKey(ctx, 2, key)
	if err != nil {
		t.Fatal(err)
	}
	if res.Done != 2 {
		t.Fatalf("claim by key of 2: %+v, want the key's first two events handed off", res)
	}
	wantJobsInOrder(t, s.Pool, ids[0], ids[1])
	wantStatus(t, s.Pool, "the key's third event", ids[2], "pending", 0, 0)
}
