package claim_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

func newHandoff(t *testing.T, pool *pgxpool.Pool, maxRetries int, al alert.Alerter) *claim.Handoff {
	t.Helper()
	routes, err := route.New([]route.Rule{
		{Prefix: "mail.", Queues: []string{"outbox_mail"}},
		{Prefix: "poison.", Queues: []string{"outbox_poison"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return &claim.Handoff{Pool: pool, Routes: routes, MaxRetries: maxRetries, Alerter: al}
}

// poisonRiver makes River's insert fail for events whose type starts with
// poison.: a real database error inside the batch transaction.
func poisonRiver(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `
		CREATE FUNCTION reject_poison() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.args->>'event_type' LIKE 'poison.%' THEN
				RAISE EXCEPTION 'receiver rejects %', NEW.args->>'event_type';
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER reject_poison BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION reject_poison();`)
	if err != nil {
		t.Fatal(err)
	}
}

func publish(t *testing.T, pool *pgxpool.Pool, types ...string) []int64 {
	t.Helper()
	evs := make([]outbox.Event, len(types))
	for i, typ := range types {
		evs[i] = outbox.Event{Type: typ, Payload: json.RawMessage(`{}`)}
	}
	return pgtest.Publish(t, pool, evs...)
}

type row struct {
	status    string
	retries   int
	lastError string
	delay     time.Duration // scheduled_at - now()
	jobs      int
}

func get(t *testing.T, pool *pgxpool.Pool, id int64) row {
	t.Helper()
	var r row
	var lastErr *string
	var delayMS float64
	err := pool.QueryRow(context.Background(), `
		SELECT status::text, retries, last_error, extract(epoch FROM scheduled_at - now()) * 1000,
		       (SELECT count(*) FROM river_job WHERE (args->>'event_id')::bigint = e.id)
		FROM outbox_event e WHERE id = $1`, id).Scan(&r.status, &r.retries, &lastErr, &delayMS, &r.jobs)
	if err != nil {
		t.Fatal(err)
	}
	if lastErr != nil {
		r.lastError = *lastErr
	}
	r.delay = time.Duration(delayMS) * time.Millisecond
	return r
}

func TestPoisonIsolatedInsideBatch(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	poisonRiver(t, s.Pool)
	h := newHandoff(t, s.Pool, 6, nil)
	ids := publish(t, s.Pool, "mail.a.b", "mail.a.b", "poison.a.b", "mail.a.b", "mail.a.b")
	res, err := h.Batch(context.Background(), 100)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Fallback || res.Claimed != 5 || res.Done != 4 || res.Retried != 1 || res.Jobs != 4 {
		t.Fatalf("result = %+v", res)
	}
	for i, id := range ids {
		r := get(t, s.Pool, id)
		if i == 2 {
			if r.status != "pending" || r.retries != 1 || r.jobs != 0 || !strings.Contains(r.lastError, "receiver rejects poison.a.b") {
				t.Fatalf("poison event = %+v", r)
			}
			if r.delay < 50*time.Second || r.delay > 70*time.Second {
				t.Fatalf("poison event rescheduled in %s, want about 1 minute", r.delay)
			}
			continue
		}
		if r.status != "done" || r.jobs != 1 {
			t.Fatalf("event %d = %+v, want done with one job", id, r)
		}
	}
}

func TestBackoffScheduleAndDeadLetter(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	poisonRiver(t, s.Pool)
	var got []alert.Alert
	h := newHandoff(t, s.Pool, 6, alert.Func(func(_ context.Context, a alert.Alert) { got = append(got, a) }))
	id := publish(t, s.Pool, "poison.always.fails")[0]
	ctx := context.Background()
	wantMinutes := []int{1, 2, 4, 8, 16, 32}
	for attempt := 1; attempt <= 7; attempt++ {
		res, err := h.Batch(ctx, 10)
		if err != nil {
			t.Fatal(err)
		}
		r := get(t, s.Pool, id)
		if r.retries != attempt {
			t.Fatalf("attempt %d: retries = %d", attempt, r.retries)
		}
		if attempt <= 6 {
			want := time.Duration(wantMinutes[attempt-1]) * time.Minute
			if r.status != "pending" || r.delay < want-10*time.Second || r.delay > want+10*time.Second {
				t.Fatalf("attempt %d: %+v, want pending in %s", attempt, r, want)
			}
			if res.Retried != 1 {
				t.Fatalf("attempt %d: result %+v", attempt, res)
			}
			// Not claimable before its time.
			if res2, err := h.Batch(ctx, 10); err != nil || res2.Claimed != 0 {
				t.Fatalf("claimed before scheduled_at: %+v %v", res2, err)
			}
			if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET scheduled_at = now() WHERE id = $1`, id); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if r.status != "failed" || res.DeadLettered != 1 || r.jobs != 0 {
			t.Fatalf("attempt %d: %+v / %+v, want failed (dead letter)", attempt, r, res)
		}
	}
	if len(got) != 1 || got[0].Reason != alert.DeadLetter || got[0].EventID != id || got[0].Retries != 7 || !strings.Contains(got[0].Err, "receiver rejects") {
		t.Fatalf("alerts = %+v, want one dead-letter alert", got)
	}
}

func TestFailedTransactionLeavesNoJobs(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	// Fail the final step (marking done) after River's insert succeeded.
	_, err := s.Pool.Exec(ctx, `
		CREATE FUNCTION fail_done() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.status = 'done' THEN RAISE EXCEPTION 'disk on fire'; END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER fail_done BEFORE UPDATE ON outbox_event FOR EACH ROW EXECUTE FUNCTION fail_done();`)
	if err != nil {
		t.Fatal(err)
	}
	h := newHandoff(t, s.Pool, 6, nil)
	ids := publish(t, s.Pool, "mail.a.b", "mail.a.c", "mail.a.d")
	if _, err := h.Batch(ctx, 100); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		r := get(t, s.Pool, id)
		if r.status != "pending" || r.jobs != 0 || r.retries != 1 || !strings.Contains(r.lastError, "disk on fire") {
			t.Fatalf("event %d = %+v, want pending, no jobs, one failed attempt", id, r)
		}
	}
	var jobs int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM river_job`).Scan(&jobs); err != nil {
		t.Fatal(err)
	}
	if jobs != 0 {
		t.Fatalf("%d River jobs left behind by a rolled-back batch", jobs)
	}
}

func TestCancelledBatchLeavesEventsPending(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	// Make the River insert slow, then cancel the batch while it waits.
	_, err := s.Pool.Exec(ctx, `
		CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(5); RETURN NEW; END $$;
		CREATE TRIGGER slow_insert BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION slow_insert();`)
	if err != nil {
		t.Fatal(err)
	}
	h := newHandoff(t, s.Pool, 6, nil)
	ids := publish(t, s.Pool, "mail.a.b", "mail.a.c")
	bctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := h.Batch(bctx, 100); err == nil {
		t.Fatal("batch succeeded despite the timeout")
	}
	for _, id := range ids {
		if r := get(t, s.Pool, id); r.status != "pending" || r.retries != 0 || r.jobs != 0 {
			t.Fatalf("event %d = %+v, want untouched pending", id, r)
		}
	}
}

// TestTransientFailureChargesNoRetry: a lock wait that times out inside the
// batch is the database's fault, not the events': they stay pending,
// untouched.
func TestTransientFailureChargesNoRetry(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	key := time.Now().UnixNano() % 1_000_000_000
	_, err := s.Pool.Exec(ctx, fmt.Sprintf(`
		CREATE FUNCTION locked_insert() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			SET LOCAL lock_timeout = '50ms';
			PERFORM pg_advisory_xact_lock(%d);
			RETURN NEW;
		END $$;
		CREATE TRIGGER locked_insert BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION locked_insert();`, key))
	if err != nil {
		t.Fatal(err)
	}
	holder, err := s.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, key); err != nil {
		t.Fatal(err)
	}
	h := newHandoff(t, s.Pool, 6, nil)
	ids := publish(t, s.Pool, "mail.a.b", "mail.a.c")
	_, err = h.Batch(ctx, 100)
	if err == nil || !claim.IsTransient(err) {
		t.Fatalf("err = %v, want a transient error", err)
	}
	for _, id := range ids {
		if r := get(t, s.Pool, id); r.status != "pending" || r.retries != 0 || r.jobs != 0 {
			t.Fatalf("event %d = %+v, want pending with no retry charged", id, r)
		}
	}
	// Once the lock is free, the same events go through.
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, key); err != nil {
		t.Fatal(err)
	}
	holder.Release()
	res, err := h.Batch(ctx, 100)
	if err != nil || res.Done != 2 {
		t.Fatalf("after recovery: %+v %v", res, err)
	}
}

// TestBatchAfterContinuesFromPosition: BatchAfter claims only what follows
// the position; what lies behind it (a late commit) waits for a full Batch.
func TestBatchAfterContinuesFromPosition(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	h := newHandoff(t, s.Pool, 6, nil)
	publish(t, s.Pool, "mail.a.b", "mail.a.b", "mail.a.b", "mail.a.b")
	first, err := h.Batch(ctx, 2)
	if err != nil || first.Claimed != 2 {
		t.Fatalf("%+v %v", first, err)
	}
	// A row that sorts before the position, as a late commit would.
	var late int64
	if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, scheduled_at) VALUES ('mail.late.commit', '{}', now() - interval '1 hour') RETURNING id`).Scan(&late); err != nil {
		t.Fatal(err)
	}
	next, err := h.BatchAfter(ctx, 10, first.Last)
	if err != nil || next.Claimed != 2 {
		t.Fatalf("BatchAfter = %+v %v, want the 2 events after the position", next, err)
	}
	for _, h := range next.Handed {
		if h.ID == late {
			t.Fatal("BatchAfter claimed the row behind its position")
		}
	}
	if !next.Last.After(first.Last) {
		t.Fatalf("position did not advance: %+v then %+v", first.Last, next.Last)
	}
	full, err := h.Batch(ctx, 10)
	if err != nil || full.Claimed != 1 || full.Handed[0].ID != late {
		t.Fatalf("Batch = %+v %v, want the late row", full, err)
	}
}

// TestUnscannableRowIsIsolated: a stored -infinity scheduled_at (first in
// claim order) cannot be scanned into a time.Time; it used to fail every
// claim. It is dead-lettered and the event behind it handed off.
func TestUnscannableRowIsIsolated(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	var bad int64
	if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, scheduled_at)
		VALUES ('mail.user.welcomed', '{}', '-infinity') RETURNING id`).Scan(&bad); err != nil {
		t.Fatal(err)
	}
	good := publish(t, s.Pool, "mail.user.welcomed")[0]
	h := newHandoff(t, s.Pool, 6, nil)
	res, err := h.Batch(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	if res.Done != 1 || res.Broken != 1 {
		t.Fatalf("result %+v, want 1 done and 1 broken", res)
	}
	var st, lastErr string
	if err := s.Pool.QueryRow(ctx, `SELECT status::text, last_error FROM outbox_event WHERE id = $1`, bad).Scan(&st, &lastErr); err != nil {
		t.Fatal(err)
	}
	if st != "failed" || !strings.Contains(lastErr, "scheduled_at is infinite") {
		t.Fatalf("bad row: %s %q", st, lastErr)
	}
	if r := get(t, s.Pool, good); r.status != "done" {
		t.Fatalf("good row %+v", r)
	}
}

// TestProcessedAtIsHandoffTime: processed_at is stamped after River's
// insert, not at the start of the batch transaction.
func TestProcessedAtIsHandoffTime(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	_, err := s.Pool.Exec(ctx, `
		CREATE TABLE insert_seen (at timestamptz NOT NULL);
		CREATE FUNCTION note_insert() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			PERFORM pg_sleep(0.05);
			INSERT INTO insert_seen VALUES (clock_timestamp());
			RETURN NEW;
		END $$;
		CREATE TRIGGER note_insert BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION note_insert();`)
	if err != nil {
		t.Fatal(err)
	}
	id := publish(t, s.Pool, "mail.user.welcomed")[0]
	h := newHandoff(t, s.Pool, 6, nil)
	if res, err := h.Batch(ctx, 10); err != nil || res.Done != 1 {
		t.Fatalf("batch: %+v, %v", res, err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event e, insert_seen i WHERE e.id = $1 AND e.processed_at >= i.at`, id); n != 1 {
		t.Fatal("processed_at is before River's insert: it is not the handoff time")
	}
}

// TestBatchIsBoundedByBytes: a batch stops at the byte budget (always
// taking one event), says that more are due, and the rest follow in later
// batches; a payload over the size rule is dead-lettered.
func TestBatchIsBoundedByBytes(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	// The oversize row is one stored before the payload rule existed.
	pgtest.AllowAnyPayload(t, s.Pool)
	// Five payloads of about 320,000 bytes (incompressible), then one of
	// about 1.5 MiB (over the payload rule, within the table's CHECK).
	_, err := s.Pool.Exec(ctx, `
		INSERT INTO outbox_event (event_type, payload, scheduled_at)
		SELECT 'mail.big.sent', jsonb_build_object('d', (SELECT string_agg(md5(i::text || ':' || g::text), '') FROM generate_series(1, 10000) g)),
		       now() - make_interval(secs => 100 - i)
		FROM generate_series(1, 5) i;
		INSERT INTO outbox_event (event_type, payload, scheduled_at)
		SELECT 'mail.huge.sent', jsonb_build_object('d', (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 50000) g)), now() - interval '1 second'`)
	if err != nil {
		t.Fatal(err)
	}
	h := newHandoff(t, s.Pool, 6, nil)
	h.BatchBytes = 1 << 20
	res, err := h.Batch(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if res.Claimed != 3 || res.Done != 3 || !res.More {
		t.Fatalf("first batch %+v, want 3 events (3 x 320 kB within 1 MiB) and More", res)
	}
	h.BatchBytes = 1024
	res, err = h.Batch(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if res.Claimed != 1 || res.Done != 1 || !res.More {
		t.Fatalf("second batch %+v, want one event over the budget, alone, and More", res)
	}
	h.BatchBytes = 0
	res, err = h.Batch(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if res.Claimed != 2 || res.Done != 1 || res.Broken != 1 || res.More {
		t.Fatalf("third batch %+v, want the last normal event done and the huge one broken", res)
	}
	var lastErr string
	if err := s.Pool.QueryRow(ctx, `SELECT last_error FROM outbox_event WHERE event_type = 'mail.huge.sent' AND status = 'failed'`).Scan(&lastErr); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(lastErr, "the payload rule is at most 1048576 bytes") {
		t.Fatalf("last_error %q", lastErr)
	}
}
