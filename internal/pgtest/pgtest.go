// Package pgtest gives each test its own Postgres schema, migrated with the
// outbox's and River's migrations, so that tests run in parallel against a
// real database without seeing each other's rows.
//
// The database is found as the scripts find it: TEST_DATABASE_URL, else
// DATABASE_URL, else postgres://postgres@127.0.0.1:5432/postgres. The
// Makefile's test target starts a throwaway cluster and exports
// TEST_DATABASE_URL when nothing listens there.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/dbconn"
	outboxsql "github.com/outboxhq/outbox/sql"
)

// URL returns the connection string tests use.
func URL() string {
	for _, k := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

var (
	adminOnce sync.Once
	adminPool *pgxpool.Pool
	adminErr  error
)

// Admin returns a pool on the test database without a schema of its own,
// shared by all tests in the package.
func Admin(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	adminOnce.Do(func() {
		cfg, err := pgxpool.ParseConfig(URL())
		if err != nil {
			adminErr = err
			return
		}
		cfg.MaxConns = 4
		adminPool, adminErr = pgxpool.NewWithConfig(context.Background(), cfg)
		if adminErr == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if adminErr = adminPool.Ping(ctx); adminErr == nil {
				Sweep(ctx, adminPool)
			}
		}
	})
	if adminErr != nil {
		tb.Fatalf("pgtest: no test database at %s: %v (set TEST_DATABASE_URL, or run `make test`, which starts one)", Redact(URL()), adminErr)
	}
	return adminPool
}

// Redact hides the password of a connection string, in every form
// dbconn.Redact knows (the one implementation outboxd and outboxctl use).
func Redact(url string) string {
	return dbconn.Redact(url, url)
}

// ownerPrefix starts the comment that marks a pgtest schema.
const ownerPrefix = "pgtest host="

// owner is the comment of this process's schemas: host and pid.
func owner() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s%s pid=%d", ownerPrefix, strings.ReplaceAll(host, "'", ""), os.Getpid())
}

// Sweep drops the schemas that test processes on this host left behind
// when they died before their cleanup (killed, or stopped by go test's
// -timeout): t_* schemas marked by pgtest on this host whose process no
// longer runs. Admin calls it once per test process; schemas of other hosts
// and of running processes are left alone.
func Sweep(ctx context.Context, admin *pgxpool.Pool) {
	host, _ := os.Hostname()
	rows, err := admin.Query(ctx, `
		SELECT n.nspname, obj_description(n.oid, 'pg_namespace') FROM pg_namespace n
		WHERE n.nspname LIKE 't\_%' AND obj_description(n.oid, 'pg_namespace') LIKE $1 || '%'`,
		ownerPrefix+strings.ReplaceAll(host, "'", "")+" pid=")
	if err != nil {
		return
	}
	type schema struct{ name, comment string }
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (schema, error) {
		var s schema
		return s, r.Scan(&s.name, &s.comment)
	})
	if err != nil {
		return
	}
	for _, s := range list {
		_, pidText, _ := strings.Cut(s.comment, " pid=")
		pid, err := strconv.Atoi(pidText)
		if err != nil || pid <= 0 || processRuns(pid) {
			continue
		}
		_, _ = admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{s.name}.Sanitize()+" CASCADE")
	}
}

// processRuns reports whether a process with this pid runs on this host.
func processRuns(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// Schema is one test's isolated, migrated schema.
type Schema struct {
	Name string
	// Pool has search_path set to the schema.
	Pool *pgxpool.Pool
	// URL connects with search_path set to the schema (for subprocesses).
	URL string
}

// Options tune NewSchema.
type Options struct {
	// MaxConns of the schema's pool; 0 means 10.
	MaxConns int32
	// NoMigrate leaves the schema empty.
	NoMigrate bool
}

// slots bounds the schemas alive at once in this test process (each has a
// pool, and dispatchers add listener and lock sessions), so that `go test
// ./...`, which runs packages in parallel, stays within max_connections.
// PGTEST_MAX_SCHEMAS overrides the default of 4.
var slots = func() chan struct{} {
	n := 4
	if v, err := strconv.Atoi(os.Getenv("PGTEST_MAX_SCHEMAS")); err == nil && v > 0 {
		n = v
	}
	return make(chan struct{}, n)
}()

// NewSchema creates a fresh schema named after a random suffix, migrates it
// and drops it when the test ends. It waits while too many schemas are alive
// in this process.
func NewSchema(tb testing.TB, opts *Options) *Schema {
	tb.Helper()
	if opts == nil {
		opts = &Options{}
	}
	slots <- struct{}{}
	tb.Cleanup(func() { <-slots }) // registered first, so it runs last
	admin := Admin(tb)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	// The schema is marked with this process, so that a later run can drop
	// it if this process dies before its cleanup (sweep).
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+name+"; COMMENT ON SCHEMA "+name+" IS '"+owner()+"'"); err != nil {
		tb.Fatalf("pgtest: create schema: %v", err)
	}
	var pool *pgxpool.Pool
	// Registered at once, so the schema is dropped however the test ends,
	// even when the rest of NewSchema fails.
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		// Terminate the schema's sessions first (a subprocess, a listener,
		// or a goroutine of a failed test blocked on a lock): pool.Close
		// waits for every acquired connection and would hang on them.
		_, _ = admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE pid <> pg_backend_pid() AND datname = current_database()
			AND application_name = $1`, name)
		if pool != nil {
			closed := make(chan struct{})
			go func() {
				defer close(closed)
				pool.Close()
			}()
			select {
			case <-closed:
			case <-ctx.Done():
				tb.Logf("pgtest: pool of %s did not close: a connection is still held", name)
			}
		}
		if _, err := admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+name+" CASCADE"); err != nil {
			tb.Logf("pgtest: drop schema %s: %v", name, err)
		}
	})

	url := WithSearchPath(URL(), name)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	cfg.MaxConns = opts.MaxConns
	if cfg.MaxConns == 0 {
		cfg.MaxConns = 10
	}
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	if !opts.NoMigrate {
		if _, err := outboxsql.Migrate(ctx, pool, nil); err != nil {
			tb.Fatalf("pgtest: migrate %s: %v", name, err)
		}
	}
	return &Schema{Name: name, Pool: pool, URL: url}
}

// WithSearchPath returns url with search_path (and application_name) set.
func WithSearchPath(url, schema string) string {
	if !strings.HasPrefix(url, "postgres://") && !strings.HasPrefix(url, "postgresql://") {
		return url + " search_path=" + schema + " application_name=" + schema
	}
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	return url + sep + "search_path=" + schema + "&application_name=" + schema
}

// Context returns a context cancelled after d or when the test ends.
func Context(tb testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	tb.Cleanup(cancel)
	return ctx
}

// Publish writes events in one transaction and returns their ids.
func Publish(tb testing.TB, pool *pgxpool.Pool, events ...outbox.Event) []int64 {
	tb.Helper()
	var ids []int64
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		res, err := outbox.PublishMany(context.Background(), tx, events)
		for _, r := range res {
			ids = append(ids, r.ID)
		}
		return err
	})
	if err != nil {
		tb.Fatal(err)
	}
	return ids
}

// WaitFor polls cond every 20 ms until it holds, or fails the test after d.
// Deadlines here are generous: they bound a hang, they do not measure.
func WaitFor(tb testing.TB, d time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Count runs a query returning one integer.
func Count(tb testing.TB, pool *pgxpool.Pool, sql string, args ...any) int {
	tb.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
	return n
}

// AllowAnyPayload lifts the payload rules (the size CHECK and the depth
// and size trigger) from outbox_event in the schema pool's search_path
// selects, so that a test can store, as the table owner, a row that today's
// rules refuse: a row written before a rule existed, or by a writer that
// bypassed it. Only for the test's own schema.
func AllowAnyPayload(tb testing.TB, pool *pgxpool.Pool) {
	tb.Helper()
	_, err := pool.Exec(context.Background(), `DO $$
DECLARE c record;
BEGIN
    FOR c IN SELECT conname FROM pg_constraint
             WHERE conrelid = 'outbox_event'::regclass AND contype = 'c'
               AND pg_get_constraintdef(oid) ILIKE '%payload%'
    LOOP
        EXECUTE format('ALTER TABLE outbox_event DROP CONSTRAINT %I', c.conname);
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'outbox_event'::regclass AND tgname = 'outbox_event_payload_rule') THEN
        ALTER TABLE outbox_event DISABLE TRIGGER outbox_event_payload_rule;
    END IF;
END $$`)
	if err != nil {
		tb.Fatalf("pgtest: lift the payload rules: %v", err)
	}
}

// ListenRiverInsert listens on the schema's River insert channel
// (<schema>.river_insert) and returns a function that reports the payloads
// received since the last call: it sends a last notification from a later
// transaction, which marks the end of the earlier ones, and reads up to it.
// The listening connection is closed at the end of the test.
func (s *Schema) ListenRiverInsert(tb testing.TB, ctx context.Context) func() []string {
	tb.Helper()
	lis, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = lis.Close(context.WithoutCancel(ctx)) })
	channel := s.Name + ".river_insert"
	if _, err := lis.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		tb.Fatal(err)
	}
	return func() []string {
		tb.Helper()
		if _, err := s.Pool.Exec(ctx, "SELECT pg_notify($1, 'end')", channel); err != nil {
			tb.Fatal(err)
		}
		var got []string
		for {
			n, err := lis.WaitForNotification(ctx)
			if err != nil {
				tb.Fatalf("wait for the notifications (got %v): %v", got, err)
			}
			if n.Payload == "end" {
				return got
			}
			got = append(got, n.Payload)
		}
	}
}

// RolePool connects to s as role (a startup parameter, so every connection
// of the pool, including the dispatcher's dedicated listener and wake-lock
// connections copied from its config, runs as that role), checks that it
// does, and closes the pool when the test ends.
func RolePool(tb testing.TB, s *Schema, role string) *pgxpool.Pool {
	tb.Helper()
	return SessionPool(tb, s, "role", role, 6)
}

// IsolationPool connects to s with default_transaction_isolation set to
// level for every session (as a role's or a database's setting would),
// checks that it took, and closes the pool when the test ends.
func IsolationPool(tb testing.TB, s *Schema, level string) *pgxpool.Pool {
	tb.Helper()
	return SessionPool(tb, s, "default_transaction_isolation", level, 8)
}

// SessionPool connects to s with the setting name set to value for every
// session (a startup parameter), at most maxConns connections, checks that
// current_setting(name) says value, and closes the pool when the test
// ends.
func SessionPool(tb testing.TB, s *Schema, name, value string, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		tb.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams[name] = value
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	var got string
	if err := pool.QueryRow(context.Background(), `SELECT current_setting($1)`, name).Scan(&got); err != nil || got != value {
		tb.Fatalf("%s = %q (%v), want %q", name, got, err, value)
	}
	return pool
}

// OpenTx begins a transaction on pool that the test leaves open (a
// handoff in flight, say) and returns it with its session's backend pid
// (for WaitingFor); it is rolled back when the test ends unless it ended
// before.
func OpenTx(tb testing.TB, ctx context.Context, pool *pgxpool.Pool) (pgx.Tx, int) {
	tb.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	var pid int
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		tb.Fatal(err)
	}
	return tx, pid
}

// WaitingFor reports whether some session waits for a transaction lock
// that the session with pid holds.
func WaitingFor(tb testing.TB, pool *pgxpool.Pool, pid int) bool {
	tb.Helper()
	return Count(tb, pool, `SELECT count(*) FROM pg_locks l JOIN pg_locks h ON h.transactionid = l.transactionid
		WHERE NOT l.granted AND l.locktype = 'transactionid' AND h.granted AND h.pid = $1`, pid) > 0
}

// Jobs is a FROM item that reads River's jobs and the ordered jobs waiting
// in their key's line (outbox_ordering_wait, migration 024), which are not
// in river_job until their turn, as one relation named river_job with the
// columns id, state, queue, kind, args, metadata, attempt, max_attempts,
// finalized_at and in_line. A waiting job reads state pending and in_line
// true, as it read in river_job before 024. Tests that look at a job's
// state whether it waits or runs read it in place of river_job:
//
//	SELECT state FROM `+pgtest.Jobs+` WHERE id = $1
const Jobs = `(SELECT id, state::text AS state, queue, kind, args, metadata, attempt, max_attempts, finalized_at, false AS in_line
  FROM river_job
  UNION ALL
  SELECT job_id, 'pending', queue, kind, args, metadata, 0::smallint, max_attempts, NULL::timestamptz, true
  FROM outbox_ordering_wait WHERE kind IS NOT NULL) AS river_job`

// AsHandoff is a FROM item that makes an INSERT into river_job insert as
// the dispatcher's handoff does (migration 024): it sets
// outbox.ordering_line to the transaction's id before the first row is
// inserted, so that an ordered job that must wait goes into its key's
// line, not into river_job. Other inserts of ordered jobs wait as pending
// River rows.
//
//	INSERT INTO river_job (...) SELECT ... FROM `+pgtest.AsHandoff
const AsHandoff = `(SELECT set_config('outbox.ordering_line', txid_current()::text, true)) AS handoff`
