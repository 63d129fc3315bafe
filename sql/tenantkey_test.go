package outboxsql_test

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
	outboxsql "github.com/outboxhq/outbox/sql"
)

func TestSplitStatements(t *testing.T) {
	t.Parallel()
	sql := `-- outbox:no-transaction
-- a comment; with a semicolon
CREATE INDEX CONCURRENTLY IF NOT EXISTS a ON t (x);

/* block; comment */
CREATE FUNCTION f() RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    RETURN 'a;b' || $q$;$q$; -- ;
END
$$;
SELECT 'it''s; fine', "odd;name" FROM t;
DROP INDEX CONCURRENTLY IF EXISTS b
`
	got := outboxsql.SplitStatements(sql)
	want := []string{
		`CREATE INDEX CONCURRENTLY IF NOT EXISTS a ON t (x)`,
		"CREATE FUNCTION f() RETURNS text LANGUAGE plpgsql AS $$\nBEGIN\n    RETURN 'a;b' || $q$;$q$; -- ;\nEND\n$$",
		`SELECT 'it''s; fine', "odd;name" FROM t`,
		`DROP INDEX CONCURRENTLY IF EXISTS b`,
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %q\nwant %q", got, want)
	}
}

func TestMigrationsMarkNoTransaction(t *testing.T) {
	t.Parallel()
	all, err := outboxsql.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range all {
		if want := m.Version == 6 || m.Version == 11 || m.Version == 22; m.NoTransaction != want {
			t.Errorf("migration %d: NoTransaction = %v, want %v", m.Version, m.NoTransaction, want)
		}
	}
}

func publishKey(t *testing.T, ctx context.Context, pool *pgxpool.Pool, tenant *string, key string) int64 {
	t.Helper()
	var id int64
	if err := pool.QueryRow(ctx, `SELECT outbox_publish('a.b.c', '{}', $1, $2)`, tenant, key).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

func strp(s string) *string { return &s }

// indexDefs returns the valid and invalid indexes of outbox_event by name.
func indexDefs(t *testing.T, ctx context.Context, pool *pgxpool.Pool) map[string]string {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT c.relname, CASE WHEN i.indisvalid THEN '' ELSE 'INVALID ' END || pg_get_indexdef(i.indexrelid)
		FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		WHERE i.indrelid = 'outbox_event'::regclass`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var name, def string
		if err := rows.Scan(&name, &def); err != nil {
			t.Fatal(err)
		}
		out[name] = def
	}
	return out
}

func checkPerTenantIndex(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	t.Helper()
	defs := indexDefs(t, ctx, pool)
	if _, old := defs["outbox_event_dispatch_key_key"]; old {
		t.Errorf("the tenant-blind index is still there: %v", defs)
	}
	def := defs["outbox_event_tenant_dispatch_key_key"]
	if strings.HasPrefix(def, "INVALID") || !strings.Contains(def, "COALESCE(tenant_id") || !strings.Contains(def, "UNIQUE") {
		t.Errorf("per-tenant index: %q", def)
	}
}

// TestMigrateUpgradeToPerTenantKeys builds a schema at version 5 (keys
// unique across tenants), stores keyed events, migrates to the latest
// version and checks that the stored keys keep their events and that
// another tenant may now use the same key.
func TestMigrateUpgradeToPerTenantKeys(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true, MaxConns: 4})
	ctx := pgtest.Context(t, 120*time.Second)
	if _, err := outboxsql.MigrateTo(ctx, s.Pool, nil, 5); err != nil {
		t.Fatal(err)
	}
	a := publishKey(t, ctx, s.Pool, strp("tenant-a"), "invoice-1")
	none := publishKey(t, ctx, s.Pool, nil, "job-1")
	// Version 5: tenant B is handed tenant A's event (the bug).
	if b := publishKey(t, ctx, s.Pool, strp("tenant-b"), "invoice-1"); b != a {
		t.Fatalf("at version 5 tenant B got %d, want A's %d (the old behaviour)", b, a)
	}

	res, err := outboxsql.Migrate(ctx, s.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.OutboxApplied) == 0 || res.OutboxApplied[0] != 6 {
		t.Fatalf("applied %v, want 6 first", res.OutboxApplied)
	}
	checkPerTenantIndex(t, ctx, s.Pool)

	if id := publishKey(t, ctx, s.Pool, strp("tenant-a"), "invoice-1"); id != a {
		t.Errorf("tenant A's stored key: got %d, want %d", id, a)
	}
	if id := publishKey(t, ctx, s.Pool, nil, "job-1"); id != none {
		t.Errorf("stored key without tenant: got %d, want %d", id, none)
	}
	b := publishKey(t, ctx, s.Pool, strp("tenant-b"), "invoice-1")
	if b == a {
		t.Errorf("after the upgrade tenant B still gets tenant A's event %d", a)
	}
	if id := publishKey(t, ctx, s.Pool, nil, "invoice-1"); id == a || id == b {
		t.Errorf("no-tenant scope shares tenant events: %d", id)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event`); n != 4 {
		t.Errorf("%d events, want 4", n)
	}
}

// TestMigrateRecoversInterruptedConcurrentIndex: a CREATE INDEX
// CONCURRENTLY that failed half-way leaves an INVALID index under the
// migration's name; the migrator drops it and builds the index again. A
// migration that ran but was not recorded runs again without harm.
func TestMigrateRecoversInterruptedConcurrentIndex(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true, MaxConns: 4})
	ctx := pgtest.Context(t, 120*time.Second)
	if _, err := outboxsql.MigrateTo(ctx, s.Pool, nil, 5); err != nil {
		t.Fatal(err)
	}
	publishKey(t, ctx, s.Pool, strp("tenant-a"), "k1")
	publishKey(t, ctx, s.Pool, strp("tenant-a"), "k2")
	// Two rows share event_type: this unique build fails and leaves an
	// INVALID index behind, as an interrupted build does.
	if _, err := s.Pool.Exec(ctx, `CREATE UNIQUE INDEX CONCURRENTLY outbox_event_tenant_dispatch_key_key ON outbox_event (event_type)`); err == nil {
		t.Fatal("the failing build succeeded")
	}
	if def := indexDefs(t, ctx, s.Pool)["outbox_event_tenant_dispatch_key_key"]; !strings.HasPrefix(def, "INVALID") {
		t.Fatalf("no INVALID index left behind: %q", def)
	}
	if _, err := outboxsql.Migrate(ctx, s.Pool, nil); err != nil {
		t.Fatal(err)
	}
	checkPerTenantIndex(t, ctx, s.Pool)

	// Forget that 6 ran: it runs again, statement by statement, unharmed.
	// 8, 10, 11, 12, 13 and 14 run again too: 006 recreates the four-parameter publish
	// functions, which 010 replaced with six-parameter ones and 011 with
	// seven-parameter ones (two of each would make every call ambiguous),
	// and 12 to 14 after 11 (they replace 011's trigger functions).
	if _, err := s.Pool.Exec(ctx, `DELETE FROM outbox_schema_migration WHERE version IN (6, 8, 10, 11, 12, 13, 14)`); err != nil {
		t.Fatal(err)
	}
	if _, err := outboxsql.Migrate(ctx, s.Pool, nil); err != nil {
		t.Fatalf("re-running 006: %v", err)
	}
	checkPerTenantIndex(t, ctx, s.Pool)
	if id := publishKey(t, ctx, s.Pool, strp("tenant-b"), "k1"); id == 0 {
		t.Fatal("no id")
	}
}

func TestConcurrentlyIsDroppedOnlyFromIndexStatements(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS a ON t (x)": "CREATE UNIQUE INDEX IF NOT EXISTS a ON t (x)",
		"create index concurrently b on t (x)":                      "create index b on t (x)",
		"DROP INDEX CONCURRENTLY IF EXISTS a":                       "DROP INDEX IF EXISTS a",
		"SELECT 'CREATE INDEX CONCURRENTLY'":                        "SELECT 'CREATE INDEX CONCURRENTLY'",
	} {
		if got := outboxsql.DropConcurrently(in); got != want {
			t.Errorf("%q -> %q, want %q", in, got, want)
		}
	}
}
