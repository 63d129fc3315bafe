package outboxsql_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestUnholdPutsHeldEventsBack (migration 021): the events of a key that
// the dispatcher moved (held_from set) get their own due time back when
// the first unfinished event of the key is requeued, deleted, cancelled
// before it is due or rescued; not when a later one is, nor when an event
// of the key is handed off (pending to done fires nothing: the events
// held behind a pending event wait for its own due time at most).
func TestUnholdPutsHeldEventsBack(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	// hold moves events as the dispatcher's holdSQL does behind a failed
	// event of their key.
	hold := func(rest ...int64) {
		t.Helper()
		for _, id := range rest {
			if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET held_from = scheduled_at, scheduled_at = now() + interval '1 minute' WHERE id = $1`, id); err != nil {
				t.Fatal(err)
			}
		}
	}
	held := func(k string) int {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE ordering_key = $1 AND status = 'pending' AND held_from IS NOT NULL AND scheduled_at > now()`, k)
	}

	// Requeued: the held events are back, due now.
	head, a, b := keyedEvent(t, ctx, s.Pool, "r"), keyedEvent(t, ctx, s.Pool, "r"), keyedEvent(t, ctx, s.Pool, "r")
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', last_error = 'x' WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	hold(a, b)
	if n := held("r"); n != 2 {
		t.Fatalf("%d events held, want 2", n)
	}
	if n, _ := requeue(t, ctx, s, "failed", head); n != 1 {
		t.Fatalf("requeue changed %d events, want 1", n)
	}
	if n := held("r"); n != 0 {
		t.Fatalf("%d events still held after their key's failed event was requeued", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id IN ($1, $2) AND held_from IS NULL AND scheduled_at <= now()`, a, b); n != 2 {
		t.Fatalf("%d of the 2 events due again with their own due time", n)
	}

	// Deleted by hand: the same.
	head, a = keyedEvent(t, ctx, s.Pool, "d"), keyedEvent(t, ctx, s.Pool, "d")
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', last_error = 'x' WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	hold(a)
	if _, err := s.Pool.Exec(ctx, `DELETE FROM outbox_event WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if n := held("d"); n != 0 {
		t.Fatalf("%d events still held after their key's failed event was deleted", n)
	}

	// A requeue of a later failed event while the first is still failed:
	// the first holds the key, nothing moves; a requeue of both in one
	// statement puts the held events back.
	head, a, b = keyedEvent(t, ctx, s.Pool, "q"), keyedEvent(t, ctx, s.Pool, "q"), keyedEvent(t, ctx, s.Pool, "q")
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', last_error = 'x' WHERE id = ANY($1)`, []int64{head, a}); err != nil {
		t.Fatal(err)
	}
	hold(b)
	if n, _ := requeue(t, ctx, s, "failed", a); n != 1 {
		t.Fatalf("requeue changed %d events, want 1", n)
	}
	if n := held("q"); n != 1 {
		t.Fatalf("%d events held after a later failed event of their key was requeued, want 1: the first one still holds the key", n)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed' WHERE id = $1`, a); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_requeue('test', false, ids => $1)`, []int64{head, a}); err != nil {
		t.Fatal(err)
	}
	if n := held("q"); n != 0 {
		t.Fatalf("%d events still held after the key's failed events were requeued together", n)
	}

	// A delayed first event cancelled: the events held behind it are back;
	// a held event cancelled moves nothing (the first still holds the key).
	var c int64
	if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, ordering_key, scheduled_at) VALUES ('mail.order.sent', '{}', 'c', now() + interval '1 hour') RETURNING id`).Scan(&c); err != nil {
		t.Fatal(err)
	}
	a, b = keyedEvent(t, ctx, s.Pool, "c"), keyedEvent(t, ctx, s.Pool, "c")
	hold(a, b)
	if _, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_cancel('test', false, ids => $1)`, []int64{a}); err != nil {
		t.Fatal(err)
	}
	if n := held("c"); n != 1 {
		t.Fatalf("%d events held after a held event of their key was cancelled, want 1", n)
	}
	if _, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_cancel('test', false, ids => $1)`, []int64{c}); err != nil {
		t.Fatal(err)
	}
	if n := held("c"); n != 0 {
		t.Fatalf("%d events still held after the key's delayed first event was cancelled", n)
	}

	// A processing event rescued (processing to pending): the same.
	head, a = keyedEvent(t, ctx, s.Pool, "x"), keyedEvent(t, ctx, s.Pool, "x")
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'processing', locked_until = now() - interval '1 minute' WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	hold(a)
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'pending', locked_until = NULL WHERE status = 'processing' AND id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if n := held("x"); n != 0 {
		t.Fatalf("%d events still held after the key's processing event was rescued", n)
	}

	// A held event written by anything but a hold (a failed attempt, a
	// handoff) is no longer held: held_from ends, so it is not counted or
	// shown as held.
	_, a, b = keyedEvent(t, ctx, s.Pool, "w"), keyedEvent(t, ctx, s.Pool, "w"), keyedEvent(t, ctx, s.Pool, "w")
	hold(a, b)
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET retries = retries + 1, last_error = 'x', scheduled_at = now() + interval '2 minutes' WHERE id = $1`, a); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'done', processed_at = now() WHERE id = $1`, b); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id IN ($1, $2) AND held_from IS NOT NULL`, a, b); n != 0 {
		t.Fatalf("%d events keep held_from after a failed attempt or a handoff", n)
	}

	// A pending event handed off (pending to done): nothing moves.
	head, a = keyedEvent(t, ctx, s.Pool, "p"), keyedEvent(t, ctx, s.Pool, "p")
	hold(a)
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'done', processed_at = now() WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if n := held("p"); n != 1 {
		t.Fatalf("%d events held after a pending event of their key was handed off, want 1 (the trigger fires only when a held key can move early)", n)
	}
}

// TestBulkCancelOfOneKeyIsLinear (migration 022): a statement that cancels
// or deletes many delayed events of one key fires the unhold trigger for
// each row; each firing asks the small index of held events first, so the
// statement reads a few index entries per row. Before 022 each firing
// walked the index entries of the rows the statement had already changed:
// about n² entries for n events (3,998,000 for a cancel of 2,000,
// 7,996,000 for a delete). The count is the
// transaction's own (pg_stat_get_xact_tuples_returned of each index), so it does not depend on
// the machine's speed or on other tests.
func TestBulkCancelOfOneKeyIsLinear(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 120*time.Second)
	const n = 2000
	for _, c := range []struct{ key, stmt string }{
		{"cancelled", `UPDATE outbox_event SET status = 'cancelled' WHERE ordering_key = 'cancelled'`},
		{"deleted", `DELETE FROM outbox_event WHERE ordering_key = 'deleted'`},
	} {
		if _, err := s.Pool.Exec(ctx, `
			INSERT INTO outbox_event (event_type, payload, ordering_key, scheduled_at)
			SELECT 'mail.order.reminder', '{}', $1, now() + interval '1 day' FROM generate_series(1, $2)`, c.key, n); err != nil {
			t.Fatal(err)
		}
		tx, err := s.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		tag, err := tx.Exec(ctx, c.stmt)
		if err != nil || tag.RowsAffected() != n {
			_ = tx.Rollback(ctx)
			t.Fatalf("%s: %v, %d rows, want %d", c.stmt, err, tag.RowsAffected(), n)
		}
		var read, scans int64
		if err := tx.QueryRow(ctx, `
			SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(indexrelid)), 0), coalesce(sum(pg_stat_get_xact_numscans(indexrelid)), 0)
			FROM pg_index WHERE indrelid = 'outbox_event'::regclass`).Scan(&read, &scans); err != nil {
			_ = tx.Rollback(ctx)
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if read > 20*n {
			t.Errorf("%s of %d delayed events of one key read %d index entries of outbox_event, want at most %d (a few per row)", c.key, n, read, 20*n)
		}
		if scans < n {
			t.Errorf("%s of %d delayed events of one key made %d index scans of outbox_event, fewer than its rows: the count does not see the trigger's probes", c.key, n, scans)
		}
	}
}

// TestUnholdWakesAtCommit (migration 023): the statement that puts held
// events back (here the key's delayed first event given an earlier due
// time) takes no wake lock in the operator's transaction, so a transaction
// left open keeps no dispatcher from going idle; and at its commit an idle
// dispatcher (the test holds the wake lock as one does) is notified.
// Before 023 the trigger took the lock's shared form in the statement and
// kept it until the transaction ended.
func TestUnholdWakesAtCommit(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	heldBehindDelayed := func(k string) (head, a int64) {
		t.Helper()
		if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, ordering_key, scheduled_at) VALUES ('mail.order.sent', '{}', $1, now() + interval '1 hour') RETURNING id`, k).Scan(&head); err != nil {
			t.Fatal(err)
		}
		a = keyedEvent(t, ctx, s.Pool, k)
		if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET held_from = scheduled_at, scheduled_at = now() + interval '1 minute' WHERE id = $1`, a); err != nil {
			t.Fatal(err)
		}
		return head, a
	}
	unheld := func(q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}, id int64) bool {
		t.Helper()
		var ok bool
		if err := q.QueryRow(ctx, `SELECT held_from IS NULL AND scheduled_at <= now() FROM outbox_event WHERE id = $1`, id).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}

	// No dispatcher idle: the open transaction holds no wake lock.
	head, a := heldBehindDelayed("open")
	tx, pid := pgtest.OpenTx(t, ctx, s.Pool)
	if _, err := tx.Exec(ctx, `UPDATE outbox_event SET scheduled_at = now() WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if !unheld(tx, a) {
		t.Fatal("the held event is not back after its key's first event got an earlier due time")
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND classid = 1868720215`, pid); n != 0 {
		t.Fatalf("the open transaction holds %d wake locks: no dispatcher could go idle until it ends", n)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	// A dispatcher idle (the wake lock held exclusively, listening): the
	// commit that puts held events back notifies it. (The events are
	// published before, while no dispatcher is idle: their inserts notify
	// nothing.)
	head, a = heldBehindDelayed("idle")
	lockConn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer lockConn.Close(context.Background())
	if _, err := lockConn.Exec(ctx, `LISTEN outbox_wake`); err != nil {
		t.Fatal(err)
	}
	if _, err := lockConn.Exec(ctx, `SELECT pg_advisory_lock(1868720215, outbox_wake_lock_key())`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET scheduled_at = now() WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if !unheld(s.Pool, a) {
		t.Fatal("the held event is not back")
	}
	// The channel is the database's: tests running in parallel in other
	// schemas wake it too, with their schema's name. Wait for this one's.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		n, err := lockConn.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("no wake for schema %s after the commit that put the held event back: %v", s.Name, err)
		}
		if n.Channel == "outbox_wake" && n.Payload == s.Name {
			break
		}
	}
}
