package outboxsql_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

var publishFunctions = []string{
	"outbox_publish(text, jsonb, text, text, timestamptz, text, text)",
	"outbox_publish(text, text, text, text, timestamptz, text, text)",
	"outbox_publish_many(text[], jsonb[], text[], text[], timestamptz[], text[], text[])",
}

// TestPublishFunctionsAreDefinerWithPinnedSearchPath: the publish functions
// run as their owner with search_path pinned to the schema (pg_temp last),
// and only the producer and operator roles may execute them.
func TestPublishFunctionsAreDefinerWithPinnedSearchPath(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	for _, f := range publishFunctions {
		var definer, public bool
		var config []string
		var grantees string
		err := s.Pool.QueryRow(ctx, `
			SELECT p.prosecdef, coalesce(p.proconfig, '{}'),
			       EXISTS (SELECT 1 FROM aclexplode(p.proacl) a WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'),
			       coalesce((SELECT string_agg(a.grantee::regrole::text, ',' ORDER BY a.grantee::regrole::text)
			                 FROM aclexplode(p.proacl) a WHERE a.grantee <> p.proowner AND a.privilege_type = 'EXECUTE'), '')
			FROM pg_proc p WHERE p.oid = $1::regprocedure`, f).Scan(&definer, &config, &public, &grantees)
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if !definer {
			t.Errorf("%s is not SECURITY DEFINER", f)
		}
		if want := "search_path=" + s.Name + ", pg_temp"; len(config) != 1 || config[0] != want {
			t.Errorf("%s: config %v, want [%s]", f, config, want)
		}
		if public || grantees != "outbox_operator,outbox_producer" {
			t.Errorf("%s: EXECUTE for PUBLIC %v, for %q; want only outbox_operator,outbox_producer", f, public, grantees)
		}
	}
}

// withRole runs f in a transaction as a fresh role that holds USAGE on the
// schema and EXECUTE on the publish functions, and nothing on the table: a
// producer after migration 007 takes its column grants away.
func withRole(t *testing.T, ctx context.Context, s *pgtest.Schema, execute bool, f func(tx pgx.Tx) error) error {
	t.Helper()
	role := s.Name + "_fn"
	stmts := []string{`CREATE ROLE ` + role + ` NOLOGIN`, `GRANT USAGE ON SCHEMA ` + s.Name + ` TO ` + role}
	if execute {
		for _, fn := range publishFunctions {
			stmts = append(stmts, `GRANT EXECUTE ON FUNCTION `+fn+` TO `+role)
		}
	}
	for _, q := range stmts {
		if _, err := s.Pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	defer func() {
		_, _ = s.Pool.Exec(context.WithoutCancel(ctx), `DROP OWNED BY `+role)
		_, _ = s.Pool.Exec(context.WithoutCancel(ctx), `DROP ROLE `+role)
	}()
	return pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL ROLE `+role); err != nil {
			return err
		}
		return f(tx)
	})
}

// TestPublishWithExecuteAlone: a role with EXECUTE on the publish functions
// and no privilege on outbox_event publishes through Publish, PublishMany
// (with duplicates in the batch and of a stored key) and outbox_publish,
// and still cannot read keys or choose ids. A temporary table named
// outbox_event does not capture its events.
func TestPublishWithExecuteAlone(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	var stored int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('a.b.c', '{}', 't1', 'stored')`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	err := withRole(t, ctx, s, true, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `CREATE TEMP TABLE outbox_event (id bigint, event_type text, payload jsonb, tenant_id text, dispatch_key text)`); err != nil {
			return err
		}
		res, err := outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "a.b.c", TenantID: "t1", DispatchKey: "new"},
			{Type: "a.b.c", TenantID: "t1", DispatchKey: "new"},
			{Type: "a.b.c", TenantID: "t1", DispatchKey: "stored"},
			{Type: "a.b.c"},
		})
		if err != nil {
			return err
		}
		if res[0].Duplicate || !res[1].Duplicate || res[1].ID != res[0].ID || !res[2].Duplicate || res[2].ID != stored || res[3].Duplicate {
			t.Errorf("PublishMany: %+v (stored %d)", res, stored)
		}
		one, err := outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", TenantID: "t1", DispatchKey: "stored"})
		if err != nil || !one.Duplicate || one.ID != stored {
			t.Errorf("Publish: %+v %v", one, err)
		}
		var id int64
		if err := tx.QueryRow(ctx, `SELECT outbox_publish('a.b.c', '{"n": 1}')`).Scan(&id); err != nil || id == 0 {
			t.Errorf("outbox_publish: %d %v", id, err)
		}
		if n := 0; tx.QueryRow(ctx, `SELECT count(*) FROM pg_temp.outbox_event`).Scan(&n) != nil || n != 0 {
			t.Errorf("%d events went to the temporary table", n)
		}
		for _, q := range []string{
			`SELECT dispatch_key FROM ` + s.Name + `.outbox_event`,
			`INSERT INTO ` + s.Name + `.outbox_event (id, event_type, payload) OVERRIDING SYSTEM VALUE VALUES (999999, 'a.b.c', '{}')`,
		} {
			if _, err := tx.Exec(ctx, `SAVEPOINT s`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, q)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
				t.Errorf("%s: err = %v, want permission denied", q, err)
			}
			if _, err := tx.Exec(ctx, `ROLLBACK TO SAVEPOINT s`); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event`); n != 4 {
		t.Fatalf("%d events, want 4 (stored, new, no key, outbox_publish)", n)
	}
}

// TestPublishFunctionsNotForPublic: without EXECUTE (PUBLIC has none), a
// role cannot publish.
func TestPublishFunctionsNotForPublic(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	err := withRole(t, ctx, s, false, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `SELECT outbox_publish('a.b.c', '{}')`)
		return err
	})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Fatalf("err = %v, want permission denied", err)
	}
}

// TestPublishManySQLNamesArrayAndIndex: outbox_publish_many validates every
// element first and names the array and the (1-based) index of the first
// bad one; nothing is written.
func TestPublishManySQLNamesArrayAndIndex(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	deep := strings.Repeat("[", 1001) + strings.Repeat("]", 1001)
	cases := []struct {
		types, payloads, tenants, keys []*string
		want                           string
	}{
		{sp("a.b.c", "Bad"), sp("{}", "{}"), nil, nil, "event_types[2] 'Bad' must be"},
		{sp("a.b.c", ""), sp("{}", "{}"), nil, nil, "event_types[2]"},
		{[]*string{sp("a.b.c")[0], nil}, sp("{}", "{}"), nil, nil, "event_types[2] is required"},
		{sp("a.b.c", "a.b.c", "a.b.c"), sp("{}", "{}", deep), nil, nil, "payloads[3] is nested more than 1000 levels deep, the limit is 1000"},
		{sp("a.b.c", "a.b.c"), []*string{sp("{}")[0], nil}, nil, nil, "payloads[2] is required"},
		{sp("a.b.c", "a.b.c"), sp("{}", "{}"), sp("t", ""), nil, "tenant_ids[2] must be 1 to 128 bytes"},
		{sp("a.b.c"), sp("{}"), nil, sp(strings.Repeat("k", 257)), "dispatch_keys[1] must be 1 to 256 bytes"},
		{sp("a.b.c", "a.b.c"), sp("{}"), nil, nil, "one element per event"},
		{sp("a.b.c"), sp("{}"), sp("t", "u"), nil, "one element per event"},
	}
	for _, c := range cases {
		_, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_publish_many($1, $2::text[]::jsonb[], $3, $4)`, c.types, c.payloads, c.tenants, c.keys)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, c.want) {
			t.Errorf("err = %v, want 22023 %q", err, c.want)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event`); n != 0 {
		t.Fatalf("%d events written", n)
	}
	// NULL tenant and key arrays mean none; an empty batch returns nothing.
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_publish_many('{a.b.c,a.b.c}', '{"{}","[]"}', NULL, NULL)`); n != 2 {
		t.Fatalf("%d results, want 2", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_publish_many('{}', '{}')`); n != 0 {
		t.Fatalf("%d results for an empty batch", n)
	}
}

func sp(v ...string) []*string {
	out := make([]*string, len(v))
	for i := range v {
		out[i] = &v[i]
	}
	return out
}

// TestDefinerFunctionsPinTheirSearchPath: every SECURITY DEFINER function
// of the schema, trigger functions included, runs with search_path set to
// the schema and pg_temp, whichever migration last replaced it (CREATE OR
// REPLACE drops a setting that ALTER FUNCTION added, so each replacement
// must set it again, as 022 does for outbox_event_unhold).
func TestDefinerFunctionsPinTheirSearchPath(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	rows, err := s.Pool.Query(ctx, `
		SELECT p.oid::regprocedure::text, coalesce(p.proconfig, '{}')
		FROM pg_proc p WHERE p.pronamespace = $1::regnamespace AND p.prosecdef
		ORDER BY 1`, s.Name)
	if err != nil {
		t.Fatal(err)
	}
	type fn struct {
		Name   string
		Config []string
	}
	fns, err := pgx.CollectRows(rows, pgx.RowToStructByPos[fn])
	if err != nil {
		t.Fatal(err)
	}
	want := "search_path=" + s.Name + ", pg_temp"
	seen := false
	for _, f := range fns {
		seen = seen || f.Name == "outbox_event_unhold()"
		if !slices.Contains(f.Config, want) {
			t.Errorf("%s: config %v, want %s among them", f.Name, f.Config, want)
		}
	}
	if !seen || len(fns) < 10 {
		t.Errorf("found %d SECURITY DEFINER functions, outbox_event_unhold() among them: %v; want it and the rest", len(fns), seen)
	}
}
