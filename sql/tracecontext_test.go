package outboxsql_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxsql "github.com/outboxhq/outbox/sql"
)

// tracedContext returns a ctx that carries a sampled remote span context,
// as a producer's instrumented code would.
func tracedContext(t *testing.T, ctx context.Context) (context.Context, string) {
	t.Helper()
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
	return trace.ContextWithSpanContext(ctx, sc), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
}

// TestTraceContextUpgrade builds a schema at version 9 (before the trace
// context): a producer without a trace publishes; one with a trace gets an
// error that says to migrate. After migrating, the stored event has no
// trace context, the traced producer's events have one, and the untraced
// producer still publishes.
func TestTraceContextUpgrade(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true, MaxConns: 4})
	ctx := pgtest.Context(t, 120*time.Second)
	if _, err := outboxsql.MigrateTo(ctx, s.Pool, nil, 9); err != nil {
		t.Fatal(err)
	}
	traced, want := tracedContext(t, ctx)
	publish := func(ctx context.Context) (int64, error) {
		var id int64
		err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			res, err := outbox.Publish(ctx, tx, outbox.Event{Type: "mail.user.welcome"})
			id = res.ID
			return err
		})
		return id, err
	}
	old, err := publish(ctx)
	if err != nil {
		t.Fatalf("untraced Publish at version 9: %v", err)
	}
	if _, err := publish(traced); err == nil || !strings.Contains(err.Error(), "migration 010") || !strings.Contains(err.Error(), "outboxctl migrate") {
		t.Fatalf("traced Publish at version 9: %v, want an error that names migration 010 and outboxctl migrate", err)
	}

	if _, err := outboxsql.Migrate(ctx, s.Pool, nil); err != nil {
		t.Fatal(err)
	}
	tracedID, err := publish(traced)
	if err != nil {
		t.Fatal(err)
	}
	plainID, err := publish(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for id, wantTC := range map[int64]string{old: "", tracedID: want, plainID: ""} {
		var tc *string
		if err := s.Pool.QueryRow(ctx, `SELECT trace_context FROM outbox_event WHERE id = $1`, id).Scan(&tc); err != nil {
			t.Fatal(err)
		}
		if got := ""; (tc == nil) != (wantTC == "") || (tc != nil && *tc != wantTC) {
			if tc != nil {
				got = *tc
			}
			t.Errorf("event %d: trace_context %q, want %q", id, got, wantTC)
		}
	}
	// The rule's CHECK is NOT VALID (added without a scan of the table);
	// it holds every new row all the same.
	var validated bool
	if err := s.Pool.QueryRow(ctx, `SELECT convalidated FROM pg_constraint WHERE conrelid = 'outbox_event'::regclass AND conname = 'outbox_event_trace_context_rule'`).Scan(&validated); err != nil {
		t.Fatal(err)
	}
	if validated {
		t.Error("outbox_event_trace_context_rule was validated: adding it scanned the table")
	}
}

// TestProducersPublishTraceContexts: a role with EXECUTE alone publishes a
// traced batch through PublishMany, and a member of outbox_producer may
// set trace_context in a plain INSERT.
func TestProducersPublishTraceContexts(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	traced, want := tracedContext(t, ctx)
	var ids []int64
	err := withRole(t, ctx, s, true, func(tx pgx.Tx) error {
		res, err := outbox.PublishMany(traced, tx, []outbox.Event{{Type: "a.b.c"}, {Type: "a.b.c", NotBefore: time.Now().Add(time.Minute)}})
		for _, r := range res {
			ids = append(ids, r.ID)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND trace_context = $2`, ids, want); n != 2 {
		t.Errorf("%d of the batch's events carry the trace context, want 2", n)
	}

	role := s.Name + "_producer"
	for _, q := range []string{`CREATE ROLE ` + role + ` NOLOGIN`, `GRANT outbox_producer TO ` + role} {
		if _, err := s.Pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() { _, _ = s.Pool.Exec(context.Background(), `DROP ROLE `+role) })
	err = pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL ROLE `+role); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+s.Name+`.outbox_event (event_type, payload, trace_context) VALUES ('a.b.c', '{}', $1)`, want)
		return err
	})
	if err != nil {
		t.Fatalf("plain INSERT with a trace context as an outbox_producer: %v", err)
	}
}
