package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// dueSQL is the claim's predicate (claim.claimSQL, DESIGN.md): the rows a
// dispatcher would take now.
const dueSQL = `SELECT coalesce(array_agg(id ORDER BY id), '{}') FROM outbox_event WHERE status = 'pending' AND scheduled_at <= now()`

func dueIDs(t *testing.T, ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) []int64 {
	t.Helper()
	var ids []int64
	if err := q.QueryRow(ctx, dueSQL).Scan(&ids); err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestNotBeforeDelaysTheEvent: an event published with a due time an hour
// ahead, from Go (Publish, PublishMany) and from SQL (both overloads of
// outbox_publish, positional and named, and outbox_publish_many), is stored
// pending with scheduled_at an hour after the database's now() and is not
// claimable; an event due two seconds ahead becomes claimable once the
// database's clock passes it; undelayed events in the same batches are due
// at once.
func TestNotBeforeDelaysTheEvent(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 90*time.Second)
	var now time.Time
	if err := s.Pool.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	later := now.Add(time.Hour)

	var goDelayed, delayed, due []int64
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		one, err := outbox.Publish(ctx, tx, outbox.Event{Type: "mail.reminder.due", NotBefore: later})
		if err != nil {
			return err
		}
		goDelayed = append(goDelayed, one.ID)
		many, err := outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "mail.reminder.due", NotBefore: later},
			{Type: "mail.welcome.sent"},
			{Type: "mail.reminder.due", NotBefore: later, TenantID: "t1", DispatchKey: "k1"},
		})
		if err != nil {
			return err
		}
		goDelayed = append(goDelayed, many[0].ID, many[2].ID)
		due = append(due, many[1].ID)
		for _, q := range []string{
			`SELECT outbox_publish('mail.reminder.due', '{}', NULL, NULL, now() + interval '1 hour')`,
			`SELECT outbox_publish('mail.reminder.due', '{}'::jsonb, NULL, NULL, now() + interval '1 hour')`,
			`SELECT outbox_publish(event_type => 'mail.reminder.due', payload => '{}', not_before => now() + interval '1 hour')`,
			`SELECT outbox_publish(event_type => 'mail.reminder.due', payload => '{}'::jsonb, tenant_id => 't2', not_before => now() + interval '1 hour')`,
			`SELECT id FROM outbox_publish_many(ARRAY['mail.reminder.due'], ARRAY['{}'::jsonb], NULL, NULL, ARRAY[now() + interval '1 hour'])`,
			`SELECT id FROM outbox_publish_many(event_types => ARRAY['mail.reminder.due'], payloads => ARRAY['{}'::jsonb], not_befores => ARRAY[now() + interval '1 hour'])`,
		} {
			var id int64
			if err := tx.QueryRow(ctx, q).Scan(&id); err != nil {
				t.Errorf("%s: %v", q, err)
				continue
			}
			delayed = append(delayed, id)
		}
		// Old calls, without the new parameter, are due now.
		for _, q := range []string{
			`SELECT outbox_publish('mail.welcome.sent', '{}')`,
			`SELECT outbox_publish(event_type => 'mail.welcome.sent', payload => '{}'::jsonb, dispatch_key => 'k2')`,
			`SELECT id FROM outbox_publish_many(ARRAY['mail.welcome.sent'], ARRAY['{}'::jsonb], NULL, NULL)`,
		} {
			var id int64
			if err := tx.QueryRow(ctx, q).Scan(&id); err != nil {
				t.Errorf("%s: %v", q, err)
				continue
			}
			due = append(due, id)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND status = 'pending' AND scheduled_at = $2`, goDelayed, later); n != 3 {
		t.Fatalf("%d of %d events published from Go are pending and due at NotBefore", n, len(goDelayed))
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND status = 'pending' AND scheduled_at = created_at + interval '1 hour'`, delayed); n != 6 {
		t.Fatalf("%d of %d events published from SQL are pending and due an hour after the database's now()", n, len(delayed))
	}
	delayed = append(delayed, goDelayed...)
	got := dueIDs(t, ctx, s.Pool)
	if len(got) != len(due) {
		t.Fatalf("claimable now: %v, want only the undelayed %v", got, due)
	}
	for _, id := range delayed {
		for _, g := range got {
			if g == id {
				t.Fatalf("delayed event %d is claimable before its time", id)
			}
		}
	}

	// Due in two seconds: claimable once the database's clock passes it.
	var soon int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('mail.reminder.due', '{}', not_before => clock_timestamp() + interval '2 seconds')`).Scan(&soon); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, 60*time.Second, "the event due in 2 s to become claimable", func() bool {
		for _, id := range dueIDs(t, ctx, s.Pool) {
			if id == soon {
				return true
			}
		}
		return false
	})
	var early bool
	if err := s.Pool.QueryRow(ctx, `SELECT scheduled_at > now() FROM outbox_event WHERE id = $1`, soon).Scan(&early); err != nil || early {
		t.Fatalf("claimable while scheduled_at > now() (%v)", err)
	}
}

// TestNotBeforeInThePastMeansNow: a due time in the past (from Go or SQL)
// or a NULL one is stored as the database's now(): the event is due at once.
func TestNotBeforeInThePastMeansNow(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	var ids []int64
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		res, err := outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "mail.reminder.due", NotBefore: time.Now().Add(-time.Hour)},
			{Type: "mail.reminder.due", NotBefore: time.Date(1999, 1, 1, 0, 0, 0, 0, time.UTC)},
		})
		if err != nil {
			return err
		}
		ids = append(ids, res[0].ID, res[1].ID)
		for _, q := range []string{
			`SELECT outbox_publish('mail.reminder.due', '{}', not_before => now() - interval '1 day')`,
			`SELECT outbox_publish('mail.reminder.due', '{}', not_before => NULL)`,
			`SELECT outbox_publish('mail.reminder.due', '{}', not_before => '-infinity')`,
			`SELECT id FROM outbox_publish_many(ARRAY['mail.reminder.due'], ARRAY['{}'::jsonb], not_befores => ARRAY[NULL::timestamptz])`,
		} {
			var id int64
			if err := tx.QueryRow(ctx, q).Scan(&id); err != nil {
				return err
			}
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND scheduled_at = created_at`, ids); n != len(ids) {
		t.Fatalf("%d of %d events are due at the database's now()", n, len(ids))
	}
	if got := dueIDs(t, ctx, s.Pool); len(got) != len(ids) {
		t.Fatalf("claimable: %v, want %v", got, ids)
	}
}

// TestNotBeforeTooFar: a due time beyond MaxDelay is refused naming the
// field and the rule: by Go before the round trip (the transaction stays
// usable), and by SQL (22023: not_before, not_befores[i]). When this host's
// clock lets a due time pass that the database's clock puts past the limit,
// the database's refusal comes back as the same *ValidationError.
func TestNotBeforeTooFar(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	_, err = outbox.PublishMany(ctx, tx, []outbox.Event{
		{Type: "mail.reminder.due", NotBefore: time.Now().Add(time.Hour)},
		{Type: "mail.reminder.due", NotBefore: time.Now().Add(outbox.MaxDelay + time.Hour)},
	})
	var ve *outbox.ValidationError
	if !errors.As(err, &ve) || ve.Field != "NotBefore" || ve.Index != 1 || !strings.Contains(ve.Rule, "365 days") || !errors.Is(err, outbox.ErrInvalidEvent) {
		t.Fatalf("err = %v, want a ValidationError for NotBefore of event 1 naming the limit", err)
	}
	if _, err := outbox.Publish(ctx, tx, outbox.Event{Type: "mail.reminder.due"}); err != nil {
		t.Fatalf("the transaction is not usable after Go's refusal: %v", err)
	}
	_ = tx.Rollback(ctx)

	for _, c := range []struct{ sql, field string }{
		{`SELECT outbox_publish('mail.reminder.due', '{}', not_before => now() + interval '366 days')`, "not_before"},
		{`SELECT outbox_publish('mail.reminder.due', '{}'::jsonb, NULL, NULL, 'infinity')`, "not_before"},
		{`SELECT id FROM outbox_publish_many(ARRAY['a.b.c', 'a.b.c'], ARRAY['{}', '{}']::jsonb[], not_befores => ARRAY[NULL, now() + interval '8761 hours'])`, "not_befores[2]"},
	} {
		_, err := s.Pool.Exec(ctx, c.sql)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, c.field) || !strings.Contains(pgErr.Message, "the limit is 365 days") {
			t.Errorf("%s: err = %v, want 22023 naming %s and the limit", c.sql, err, c.field)
		}
	}

	// The database's clock decides: a transaction that began two seconds
	// ago has a now() two seconds behind this host's clock, so a due time
	// just under MaxDelay by this host's clock is past it by the database's.
	err = pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		pgtest.WaitFor(t, 30*time.Second, "the transaction's now() to fall 2 s behind", func() bool {
			var behind bool
			return tx.QueryRow(ctx, `SELECT clock_timestamp() - now() > interval '2 seconds'`).Scan(&behind) == nil && behind
		})
		_, err := outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "mail.reminder.due"},
			{Type: "mail.reminder.due", NotBefore: time.Now().Add(outbox.MaxDelay - time.Second)},
		})
		return err
	})
	var pgErr *pgconn.PgError
	if !errors.As(err, &ve) || ve.Field != "NotBefore" || ve.Index != 1 || !errors.As(err, &pgErr) || pgErr.ConstraintName != "outbox_max_delay" {
		t.Fatalf("err = %v, want the database's refusal as a ValidationError for NotBefore of event 1", err)
	}
	if n := countEvents(t, s.Pool); n != 0 {
		t.Fatalf("%d events stored", n)
	}
}
