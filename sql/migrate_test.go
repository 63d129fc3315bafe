package outboxsql_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
	outboxsql "github.com/outboxhq/outbox/sql"
)

func TestMigrateConcurrentAndIdempotent(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true, MaxConns: 20})
	ctx := pgtest.Context(t, 120*time.Second)

	const n = 4
	results := make([]*outboxsql.Result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = outboxsql.Migrate(ctx, s.Pool, nil)
		}()
	}
	wg.Wait()
	applied := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("migrator %d: %v", i, errs[i])
		}
		if len(results[i].OutboxApplied) > 0 {
			applied++
		}
		if results[i].Schema != s.Name {
			t.Fatalf("migrated schema %q, want %q", results[i].Schema, s.Name)
		}
	}
	if applied != 1 {
		t.Fatalf("%d migrators applied outbox migrations, want exactly 1", applied)
	}
	again, err := outboxsql.Migrate(ctx, s.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	all, _ := outboxsql.Migrations()
	if len(again.OutboxApplied) != 0 || len(again.RiverApplied) != 0 || again.OutboxVersion != all[len(all)-1].Version {
		t.Fatalf("second run = %+v, want nothing applied", again)
	}
	var tables int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('outbox_event', 'river_job', 'outbox_schema_migration')`, s.Name).Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if tables != 3 {
		t.Fatalf("%d of 3 tables in the schema", tables)
	}
}

// TestWakeTriggerNotifiesOnlyWhileADispatcherWaits checks the trigger's
// contract: no NOTIFY while nobody holds the wake lock, one NOTIFY (payload:
// the schema) while an idle dispatcher holds it.
func TestWakeTriggerNotifiesOnlyWhileADispatcherWaits(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)

	listen, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer listen.Close(ctx)
	for _, ch := range []string{"outbox_wake", "test_marker"} {
		if _, err := listen.Exec(ctx, "LISTEN "+ch); err != nil {
			t.Fatal(err)
		}
	}
	// The channel is shared by every schema of the database: other tests'
	// wakes carry their own schema's name and are skipped.
	next := func() (channel, payload string) {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for {
			n, err := listen.WaitForNotification(wctx)
			if err != nil {
				t.Fatalf("waiting for a notification: %v", err)
			}
			if n.Channel == "outbox_wake" && n.Payload != s.Name {
				continue
			}
			return n.Channel, n.Payload
		}
	}
	publish := func() {
		if _, err := s.Pool.Exec(ctx, `SELECT outbox_publish('mail.user.welcome', '{}')`); err != nil {
			t.Fatal(err)
		}
	}

	// Nobody waits: the producer must not notify. The marker, sent after
	// the commit, must be the first notification to arrive.
	publish()
	if _, err := s.Pool.Exec(ctx, `SELECT pg_notify('test_marker', 'm1')`); err != nil {
		t.Fatal(err)
	}
	if ch, p := next(); ch != "test_marker" || p != "m1" {
		t.Fatalf("got %s/%s first: a producer notified with no dispatcher waiting", ch, p)
	}

	// An idle dispatcher holds the key exclusively: the producer notifies.
	lockConn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer lockConn.Close(ctx)
	if _, err := lockConn.Exec(ctx, `SELECT pg_advisory_lock(1868720215, outbox_wake_lock_key())`); err != nil {
		t.Fatal(err)
	}
	// Several events in one transaction fold into one notification.
	if _, err := s.Pool.Exec(ctx, `SELECT outbox_publish('mail.user.welcome', '{}'), outbox_publish('mail.user.bye', '{}')`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `SELECT pg_notify('test_marker', 'm2')`); err != nil {
		t.Fatal(err)
	}
	if ch, p := next(); ch != "outbox_wake" || p != s.Name {
		t.Fatalf("got %s/%s, want outbox_wake/%s", ch, p, s.Name)
	}
	if ch, p := next(); ch != "test_marker" || p != "m2" {
		t.Fatalf("got %s/%s, want the marker: one transaction sent more than one wake", ch, p)
	}

	// Released again: silence again.
	if _, err := lockConn.Exec(ctx, `SELECT pg_advisory_unlock(1868720215, outbox_wake_lock_key())`); err != nil {
		t.Fatal(err)
	}
	publish()
	if _, err := s.Pool.Exec(ctx, `SELECT pg_notify('test_marker', 'm3')`); err != nil {
		t.Fatal(err)
	}
	if ch, p := next(); ch != "test_marker" || p != "m3" {
		t.Fatalf("got %s/%s first after the lock was released", ch, p)
	}
}
