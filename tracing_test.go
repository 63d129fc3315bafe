package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// storedTraceContexts returns the trace_context column of events, in order
// ("" for NULL).
func storedTraceContexts(t *testing.T, ctx context.Context, s *pgtest.Schema, ids []int64) []string {
	t.Helper()
	out := make([]string, len(ids))
	for i, id := range ids {
		var tc *string
		if err := s.Pool.QueryRow(ctx, `SELECT trace_context FROM outbox_event WHERE id = $1`, id).Scan(&tc); err != nil {
			t.Fatal(err)
		}
		if tc != nil {
			out[i] = *tc
		}
	}
	return out
}

func publishIn(t *testing.T, ctx context.Context, s *pgtest.Schema, events ...outbox.Event) []int64 {
	t.Helper()
	var ids []int64
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		res, err := outbox.PublishMany(ctx, tx, events)
		for _, r := range res {
			ids = append(ids, r.ID)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestPublishStoresTheTraceContextOfCtx: a producer span's W3C trace
// context is stored with every event published under it (Publish and
// PublishMany, delayed or not), with its tracestate; a tracestate past 512
// bytes is dropped; a ctx without a span stores nothing.
func TestPublishStoresTheTraceContextOfCtx(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	exporter := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	sctx, span := tp.Tracer("producer").Start(ctx, "produce")
	ids := publishIn(t, sctx, s,
		outbox.Event{Type: "mail.user.welcome"},
		outbox.Event{Type: "mail.user.reminder", NotBefore: time.Now().Add(time.Hour)})
	var single outbox.Published
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		var err error
		single, err = outbox.Publish(sctx, tx, outbox.Event{Type: "mail.user.welcome", DispatchKey: "k1"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	span.End()
	ids = append(ids, single.ID)

	spans := exporter.GetSpans()
	if len(spans) != 1 {
		t.Fatalf("exported %d spans, want 1", len(spans))
	}
	sc := spans[0].SpanContext
	want := fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID())
	for i, got := range storedTraceContexts(t, ctx, s, ids) {
		if got != want {
			t.Errorf("event %d: trace_context %q, want the producer span's %q", ids[i], got, want)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = $1 AND scheduled_at > now() + interval '50 minutes'`, ids[1]); n != 1 {
		t.Errorf("the delayed traced event lost its due time")
	}

	// The tracestate follows the traceparent after one space.
	ts, err := trace.ParseTraceState("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
	if err != nil {
		t.Fatal(err)
	}
	withState := trace.ContextWithSpanContext(ctx, sc.WithTraceState(ts))
	got := storedTraceContexts(t, ctx, s, publishIn(t, withState, s, outbox.Event{Type: "mail.user.welcome"}))[0]
	if want := want + " rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"; got != want {
		t.Errorf("with a tracestate: stored %q, want %q", got, want)
	}

	// A tracestate past 512 bytes is dropped, the traceparent kept.
	var members []string
	for i := range 30 {
		members = append(members, fmt.Sprintf("vendor%02d=%s", i, strings.Repeat("v", 20)))
	}
	long, err := trace.ParseTraceState(strings.Join(members, ","))
	if err != nil {
		t.Fatal(err)
	}
	if len(long.String()) <= 512 {
		t.Fatalf("test tracestate is only %d bytes", len(long.String()))
	}
	withLong := trace.ContextWithSpanContext(ctx, sc.WithTraceState(long))
	if got := storedTraceContexts(t, ctx, s, publishIn(t, withLong, s, outbox.Event{Type: "mail.user.welcome"}))[0]; got != want {
		t.Errorf("with a %d-byte tracestate: stored %q, want the traceparent alone %q", len(long.String()), got, want)
	}

	// No span, no trace context.
	if got := storedTraceContexts(t, ctx, s, publishIn(t, ctx, s, outbox.Event{Type: "mail.user.welcome"}))[0]; got != "" {
		t.Errorf("without a span: stored %q, want NULL", got)
	}
}

// TestTraceContextRuleAgrees runs trace contexts on and next to the rule's
// boundaries through Go's copy of the rule and every database path (a
// plain INSERT, outbox_publish with a jsonb and a text payload,
// outbox_publish_many): all accept, or all refuse, and each refusal names
// the field.
func TestTraceContextRuleAgrees(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	cases := []struct {
		name, tc string
		valid    bool
	}{
		{"traceparent", tp, true},
		{"unsampled", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", true},
		{"with tracestate", tp + " rojo=00f067aa0ba902b7,congo=t61rcWkgMzE", true},
		{"tracestate with inner spaces", tp + " a=1 , b=2", true},
		{"tracestate at 512 bytes", tp + " a=" + strings.Repeat("x", 510), true},
		{"tracestate at 513 bytes", tp + " a=" + strings.Repeat("x", 511), false},
		{"empty", "", false},
		{"garbage", "hello", false},
		{"uppercase hex", "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", false},
		{"version 01", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", false},
		{"short trace id", "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", false},
		{"zero trace id", "00-00000000000000000000000000000000-00f067aa0ba902b7-01", false},
		{"zero parent id", "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", false},
		{"trailing space", tp + " ", false},
		{"two spaces", tp + "  a=1", false},
		{"tracestate ending in a space", tp + " a=1 ", false},
		{"newline", tp + "\n", false},
		{"tracestate with a newline", tp + " a=1\nb=2", false},
		{"non-ASCII tracestate", tp + " a=é", false},
		{"something glued on", tp + "-00", false},
	}
	paths := []struct {
		name, sql, field string
	}{
		{"INSERT", `INSERT INTO outbox_event (event_type, payload, trace_context) VALUES ('a.b.c', '{}', $1)`, "outbox_event_trace_context_rule"},
		{"outbox_publish(jsonb)", `SELECT outbox_publish('a.b.c', '{}'::jsonb, trace_context => $1)`, "outbox_publish: trace_context "},
		{"outbox_publish(text)", `SELECT outbox_publish('a.b.c', '{}'::text, trace_context => $1)`, "outbox_publish: trace_context "},
		{"outbox_publish_many", `SELECT * FROM outbox_publish_many(ARRAY['a.b.c', 'a.b.c'], ARRAY['{}', '{}']::jsonb[], trace_contexts => ARRAY[NULL, $1])`, "outbox_publish_many: trace_contexts[2] "},
	}
	for _, c := range cases {
		if goValid := outbox.TraceContextProblem(c.tc) == ""; goValid != c.valid {
			t.Errorf("%s: Go's rule says valid=%v (%s), want %v", c.name, goValid, outbox.TraceContextProblem(c.tc), c.valid)
		}
		for _, p := range paths {
			err := inRolledBackTx(ctx, s.Pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, p.sql, c.tc)
				return err
			})
			if c.valid {
				if err != nil {
					t.Errorf("%s via %s: %v, want it stored", c.name, p.name, err)
				}
				continue
			}
			var pgErr *pgconn.PgError
			switch {
			case !errors.As(err, &pgErr):
				t.Errorf("%s via %s: %v, want a refusal", c.name, p.name, err)
			case pgErr.Code == "23514" && pgErr.ConstraintName == p.field:
			case pgErr.Code == "22023" && strings.HasPrefix(pgErr.Message, p.field) && pgErr.ColumnName == "trace_context":
			default:
				t.Errorf("%s via %s: %s %s (constraint %q, column %q), want a refusal naming %q", c.name, p.name, pgErr.Code, pgErr.Message, pgErr.ConstraintName, pgErr.ColumnName, p.field)
			}
		}
	}
}

// TestPublishCallsOfEverySignatureResolve: the calls written for the
// signatures before migration 010, positional and named, still resolve
// (to the one function of each kind), and the new parameter works by name
// and by position.
func TestPublishCallsOfEverySignatureResolve(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	calls := []struct {
		sql   string
		trace bool
	}{
		{`SELECT outbox_publish('a.b.c', '{}')`, false},
		{`SELECT outbox_publish('a.b.c', '{"a": 1}'::jsonb)`, false},
		{`SELECT outbox_publish('a.b.c', '{}', 't1', 'k1')`, false},
		{`SELECT outbox_publish('a.b.c', '{}'::jsonb, 't1', 'k2', now() + interval '1 hour')`, false},
		{`SELECT outbox_publish(event_type => 'a.b.c', payload => '{}', dispatch_key => 'k3', not_before => now())`, false},
		{`SELECT outbox_publish(event_type => 'a.b.c', payload => '{}'::jsonb, tenant_id => 't2')`, false},
		{`SELECT id FROM outbox_publish_many(ARRAY['a.b.c'], ARRAY['{}'::jsonb])`, false},
		{`SELECT id FROM outbox_publish_many(ARRAY['a.b.c'], ARRAY['{}'::jsonb], ARRAY['t1'], ARRAY['k4'])`, false},
		{`SELECT id FROM outbox_publish_many(ARRAY['a.b.c'], ARRAY['{}'::jsonb], NULL, NULL, ARRAY[now()])`, false},
		{`SELECT id FROM outbox_publish_many(event_types => ARRAY['a.b.c'], payloads => ARRAY['{}'::jsonb], not_befores => ARRAY[NULL::timestamptz])`, false},
		{`SELECT outbox_publish('a.b.c', '{}', trace_context => '` + tp + `')`, true},
		{`SELECT outbox_publish('a.b.c', '{}'::jsonb, NULL, NULL, NULL, '` + tp + `')`, true},
		{`SELECT outbox_publish(event_type => 'a.b.c', payload => '{}', trace_context => '` + tp + ` a=1')`, true},
		{`SELECT id FROM outbox_publish_many(ARRAY['a.b.c'], ARRAY['{}'::jsonb], trace_contexts => ARRAY['` + tp + `'])`, true},
		{`SELECT id FROM outbox_publish_many(ARRAY['a.b.c'], ARRAY['{}'::jsonb], NULL, NULL, NULL, ARRAY['` + tp + `'])`, true},
	}
	for _, c := range calls {
		var id int64
		if err := s.Pool.QueryRow(ctx, c.sql).Scan(&id); err != nil {
			t.Errorf("%s: %v", c.sql, err)
			continue
		}
		var traced bool
		if err := s.Pool.QueryRow(ctx, `SELECT trace_context IS NOT NULL FROM outbox_event WHERE id = $1`, id).Scan(&traced); err != nil {
			t.Fatal(err)
		}
		if traced != c.trace {
			t.Errorf("%s: stored a trace context: %v, want %v", c.sql, traced, c.trace)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM pg_proc WHERE proname IN ('outbox_publish', 'outbox_publish_many') AND pronamespace = current_schema()::regnamespace`); n != 3 {
		t.Errorf("%d publish functions, want 3 (two outbox_publish, one outbox_publish_many): a leftover signature makes calls ambiguous", n)
	}
}
