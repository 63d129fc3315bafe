package dbconn_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/dbconn"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// A connection that answers 25006 (read_only_sql_transaction), as one left
// on a demoted primary does, must be destroyed, not handed out again:
// otherwise every write on it fails until the pool recycles it (an hour).
// Each case makes the pool's only connection read-only and fails a write on
// it through one pgx path; the next acquire must be a new session that
// writes.
func TestOpenEvictsReadOnlyConnections(t *testing.T) {
	t.Parallel()
	paths := map[string]func(ctx context.Context, pool *pgxpool.Pool) error{
		"exec": func(ctx context.Context, pool *pgxpool.Pool) error {
			_, err := pool.Exec(ctx, `INSERT INTO t VALUES (1)`)
			return err
		},
		"batch": func(ctx context.Context, pool *pgxpool.Pool) error {
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO t VALUES (1)`)
			return pool.SendBatch(ctx, b).Close()
		},
		"tx": func(ctx context.Context, pool *pgxpool.Pool) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO t VALUES (1)`)
				return err
			})
		},
		"copy": func(ctx context.Context, pool *pgxpool.Pool) error {
			_, err := pool.CopyFrom(ctx, pgx.Identifier{"t"}, []string{"v"}, pgx.CopyFromRows([][]any{{1}}))
			return err
		},
	}
	for name, write := range paths {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true, MaxConns: 2})
			ctx := pgtest.Context(t, time.Minute)
			if _, err := s.Pool.Exec(ctx, `CREATE TABLE t (v int)`); err != nil {
				t.Fatal(err)
			}
			pool, err := dbconn.Open(ctx, s.URL, dbconn.Options{MaxConns: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()

			// Make the only connection read-only, as a demoted node is.
			var pid int
			err = pool.QueryRow(ctx, `SELECT pg_backend_pid() FROM set_config('default_transaction_read_only', 'on', false)`).Scan(&pid)
			if err != nil {
				t.Fatal(err)
			}
			err = write(ctx, pool)
			if !dbconn.IsReadOnly(err) {
				t.Fatalf("write on a read-only session: got %v, want SQLSTATE 25006", err)
			}
			// The release that follows is asynchronous in pgxpool; the next
			// acquire waits for it, then must get a new session.
			var pid2 int
			if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid2); err != nil {
				t.Fatal(err)
			}
			if pid2 == pid {
				t.Fatalf("the connection that answered 25006 (backend %d) was reused", pid)
			}
			if err := write(ctx, pool); err != nil {
				t.Fatalf("write on the new connection: %v", err)
			}
		})
	}
}

// Other errors keep the connection.
func TestOpenKeepsConnectionsOnOtherErrors(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true, MaxConns: 2})
	ctx := pgtest.Context(t, time.Minute)
	pool, err := dbconn.Open(ctx, s.URL, dbconn.Options{MaxConns: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var pid, pid2 int
	if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SELECT 1/0`); err == nil {
		t.Fatal("division by zero succeeded")
	}
	if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid2); err != nil {
		t.Fatal(err)
	}
	if pid2 != pid {
		t.Errorf("a connection was replaced after an ordinary error (%d -> %d)", pid, pid2)
	}
}

// A multi-host URL defaults to target_session_attrs=read-write; an explicit
// value and a single host are left alone. The hosts are tried in order: a
// dead first host does not stop Open.
func TestOpenMultiHostReadWriteDefault(t *testing.T) {
	t.Parallel()
	pgtest.Admin(t)
	base := withUserDB(t, "", "")
	hostPort := hostOf(t, base)
	dead := deadPort(t)
	multi := strings.Replace(base, hostPort, fmt.Sprintf("127.0.0.1:%d,%s", dead, hostPort), 1)
	sep := "?"
	if strings.Contains(multi, "?") {
		sep = "&"
	}
	for _, tc := range []struct {
		name, url string
		readWrite bool
	}{
		{"single host", base, false},
		{"multi host", multi, true},
		{"multi host, explicit any", multi + sep + "target_session_attrs=any", false},
		{"multi host, explicit read-write", multi + sep + "target_session_attrs=read-write", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := pgtest.Context(t, time.Minute)
			pool, err := dbconn.Open(ctx, tc.url, dbconn.Options{MaxConns: 1, Wait: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			if got := pool.Config().ConnConfig.ValidateConnect != nil; got != tc.readWrite {
				t.Errorf("read-write check installed = %v, want %v", got, tc.readWrite)
			}
		})
	}
}

// A pool that targets a read-write host also drops a connection whose
// server reports that it has become read-only (a fenced primary, a
// standby), before any write fails on it.
func TestOpenEvictsConnectionsOnReadOnlyNodes(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true, MaxConns: 2})
	ctx := pgtest.Context(t, time.Minute)
	for _, tc := range []struct {
		name  string
		attrs string
		evict bool
	}{
		{"read-write target", "target_session_attrs=read-write", true},
		{"no target", "", false},
	} {
		url := s.URL
		if tc.attrs != "" {
			url += "&" + tc.attrs
		}
		pool, err := dbconn.Open(ctx, url, dbconn.Options{MaxConns: 1})
		if err != nil {
			t.Fatal(err)
		}
		var pid, pid2 int
		// A fence the server reports to the session (ParameterStatus),
		// while the session only reads.
		err = pool.QueryRow(ctx, `SELECT pg_backend_pid() FROM set_config('default_transaction_read_only', 'on', false)`).Scan(&pid)
		if err == nil {
			err = pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid2)
		}
		pool.Close()
		if err != nil {
			t.Fatal(err)
		}
		if evicted := pid2 != pid; evicted != tc.evict {
			t.Errorf("%s: connection on a read-only node evicted = %v, want %v", tc.name, evicted, tc.evict)
		}
	}
}
