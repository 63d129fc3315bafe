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

// syncRoutes runs outbox_routes_sync (what `outboxctl routes sync` runs).
func syncRoutes(t *testing.T, ctx context.Context, s *pgtest.Schema, routes string, strict bool) {
	t.Helper()
	if _, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_routes_sync('test', false, $1::jsonb, $2)`, routes, strict); err != nil {
		t.Fatal(err)
	}
}

const strictRoutes = `[{"prefix": "mail.", "queues": ["outbox_mail"]}, {"prefix": "billing.invoice.paid", "queues": ["outbox_billing"]}]`

// TestStrictRoutingRefusesUnroutedTypes: with strict routing on, Publish,
// PublishMany, outbox_publish (both overloads), outbox_publish_many and a
// plain INSERT refuse an event type that no synced prefix matches, with
// 22023 naming the type and the fix; Go returns a ValidationError for Type
// at the right index that matches ErrNoRoute. Prefixes match as
// route.PrefixMatches: "mail." matches every mail.* type, a complete type
// only itself. Nothing is written.
func TestStrictRoutingRefusesUnroutedTypes(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	syncRoutes(t, ctx, s, strictRoutes, true)

	// Routed types pass.
	pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "mail.welcome.sent"},
		outbox.Event{Type: "mail.reminder.due", NotBefore: time.Now().Add(time.Hour)},
		outbox.Event{Type: "billing.invoice.paid"})
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload) VALUES ('mail.a.b', '{}')`); err != nil {
		t.Fatalf("plain INSERT of a routed type: %v", err)
	}

	for _, typ := range []string{"billing.invoice.refunded", "billing.invoice.paid.v2", "mailer.x.y"} {
		_, err := publishOne(ctx, s, outbox.Event{Type: typ})
		var ve *outbox.ValidationError
		var pgErr *pgconn.PgError
		if !errors.As(err, &ve) || ve.Field != "Type" || ve.Index != 0 || !errors.Is(err, outbox.ErrNoRoute) || !errors.Is(err, outbox.ErrInvalidEvent) ||
			!strings.Contains(err.Error(), typ) || !strings.Contains(err.Error(), "outboxctl routes sync") ||
			!errors.As(err, &pgErr) || pgErr.Code != "22023" {
			t.Errorf("Publish(%s): err = %v, want a ValidationError for Type matching ErrNoRoute", typ, err)
		}
	}
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := outbox.PublishMany(ctx, tx, []outbox.Event{{Type: "mail.a.b"}, {Type: "mail.a.c"}, {Type: "audit.x.y"}})
		return err
	})
	var ve *outbox.ValidationError
	if !errors.As(err, &ve) || ve.Field != "Type" || ve.Index != 2 || !errors.Is(err, outbox.ErrNoRoute) || !strings.Contains(ve.Rule, `"audit.x.y"`) {
		t.Errorf("PublishMany: err = %v, want a ValidationError for Type of event 2", err)
	}

	for _, c := range []struct{ sql, want string }{
		{`SELECT outbox_publish('audit.x.y', '{}')`, `outbox_publish: event_type 'audit.x.y' matches no synced route`},
		{`SELECT outbox_publish(event_type => 'audit.x.y', payload => '{}'::jsonb, tenant_id => 't')`, `outbox_publish: event_type 'audit.x.y' matches no synced route`},
		{`SELECT outbox_publish('audit.x.y', '{}', NULL, NULL, now() + interval '1 hour')`, `outbox_publish: event_type 'audit.x.y' matches no synced route`},
		{`SELECT id FROM outbox_publish_many(ARRAY['mail.a.b', 'audit.x.y'], ARRAY['{}', '{}']::jsonb[])`, `outbox_publish_many: event_types[2] 'audit.x.y' matches no synced route`},
		{`INSERT INTO outbox_event (event_type, payload) VALUES ('audit.x.y', '{}')`, `outbox_event: event_type 'audit.x.y' matches no synced route`},
	} {
		_, err := s.Pool.Exec(ctx, c.sql)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.HasPrefix(pgErr.Message, c.want) ||
			pgErr.ColumnName != "event_type" || !strings.Contains(pgErr.Hint, "outboxctl routes sync") {
			t.Errorf("%s: err = %v (column %q, hint %q), want 22023 %q naming the column and the fix", c.sql, err, pgErrColumn(err), pgErrHint(err), c.want)
		}
	}
	if n := countEvents(t, s.Pool); n != 4 {
		t.Fatalf("%d events stored, want the 4 routed ones", n)
	}
}

// TestStrictRoutingOff: with strict routing off (the default, and after
// `routes sync --strict off`) every valid type is accepted, synced routes
// or not.
func TestStrictRoutingOff(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	publishAll := func() {
		t.Helper()
		pgtest.Publish(t, s.Pool, outbox.Event{Type: "audit.x.y"}, outbox.Event{Type: "mail.a.b"})
		for _, q := range []string{
			`SELECT outbox_publish('audit.x.y', '{}')`,
			`SELECT id FROM outbox_publish_many(ARRAY['audit.x.y'], ARRAY['{}'::jsonb])`,
			`INSERT INTO outbox_event (event_type, payload) VALUES ('audit.x.y', '{}')`,
		} {
			if _, err := s.Pool.Exec(ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
	}
	publishAll() // default: off, nothing synced
	syncRoutes(t, ctx, s, strictRoutes, false)
	publishAll() // synced, strict off
	syncRoutes(t, ctx, s, strictRoutes, true)
	if _, err := publishOne(ctx, s, outbox.Event{Type: "audit.x.y"}); !errors.Is(err, outbox.ErrNoRoute) {
		t.Fatalf("strict on: err = %v, want ErrNoRoute", err)
	}
	syncRoutes(t, ctx, s, strictRoutes, false)
	publishAll() // turned off again
	if n := countEvents(t, s.Pool); n != 15 {
		t.Fatalf("%d events, want 15", n)
	}
}

func publishOne(ctx context.Context, s *pgtest.Schema, e outbox.Event) (outbox.Published, error) {
	var res outbox.Published
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		var err error
		res, err = outbox.Publish(ctx, tx, e)
		return err
	})
	return res, err
}

func pgErrColumn(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.ColumnName
	}
	return ""
}

func pgErrHint(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Hint
	}
	return ""
}
