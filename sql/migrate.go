package outboxsql

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

//go:embed migrations/*.up.sql
var migrationFS embed.FS

// Migration is one numbered outbox migration.
//
// A no-transaction migration may still group statements that must change
// together between its own BEGIN; and COMMIT; lines: they run one by one on
// the migrator's session, which makes them one transaction.
type Migration struct {
	Version int
	Name    string
	SQL     string
	// NoTransaction is set by a first line "-- outbox:no-transaction": the
	// migration runs outside a transaction, one statement at a time (as
	// CREATE INDEX CONCURRENTLY requires). Such a migration must be
	// idempotent statement by statement (IF NOT EXISTS, OR REPLACE, IF
	// EXISTS), because an interrupted run is repeated from its first
	// statement.
	NoTransaction bool
}

// noTransactionMarker, as the first line of a migration, runs it outside a
// transaction.
const noTransactionMarker = "-- outbox:no-transaction"

// Migrations returns the embedded outbox migrations in version order.
func Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(migrationFS, "migrations")
	if err != nil {
		return nil, err
	}
	var out []Migration
	seen := map[int]string{}
	for _, e := range entries {
		name := e.Name()
		base := strings.TrimSuffix(name, ".up.sql")
		num, rest, ok := strings.Cut(base, "_")
		if !ok {
			return nil, fmt.Errorf("migration %q: want NNN_name.up.sql", name)
		}
		v, err := strconv.Atoi(num)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("migration %q: version %q is not a positive number", name, num)
		}
		if prev, dup := seen[v]; dup {
			return nil, fmt.Errorf("migrations %q and %q share version %d", prev, name, v)
		}
		seen[v] = name
		body, err := migrationFS.ReadFile(path.Join("migrations", name))
		if err != nil {
			return nil, err
		}
		first, _, _ := strings.Cut(string(body), "\n")
		out = append(out, Migration{Version: v, Name: rest, SQL: string(body), NoTransaction: strings.TrimSpace(first) == noTransactionMarker})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Result reports what Migrate did.
type Result struct {
	// Schema is the schema that was migrated (current_schema()).
	Schema string `json:"schema"`
	// RiverApplied lists River migration versions applied by this run.
	RiverApplied []int `json:"river_applied"`
	// OutboxApplied lists outbox migration versions applied by this run.
	OutboxApplied []int `json:"outbox_applied"`
	// OutboxVersion is the newest outbox migration version now in place.
	OutboxVersion int `json:"outbox_version"`
}

// migrateLockClass is the first key of the session advisory lock that
// serialises migrators; the second is derived from the schema.
const migrateLockClass = 1868720216

const createVersionTable = `
CREATE TABLE IF NOT EXISTS outbox_schema_migration (
    version    int         PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)`

// Migrate applies River's migrations and then the outbox's, in the schema
// that pool's search_path selects. It is idempotent, and concurrent calls
// (from any number of processes) are serialised by an advisory lock.
func Migrate(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) (*Result, error) {
	return migrateTo(ctx, pool, logger, 0)
}

// migrateLockPoll is how often a migrator retries the migration lock while
// another holds it.
const migrateLockPoll = 50 * time.Millisecond

// lockMigrations takes the session advisory lock that serialises migrators.
// It polls pg_try_advisory_lock instead of blocking in pg_advisory_lock: a
// statement blocked on the lock holds a snapshot, CREATE INDEX CONCURRENTLY
// (run by the lock's holder) waits for every older snapshot to go, and the
// two would deadlock.
func lockMigrations(ctx context.Context, conn *pgxpool.Conn) error {
	for {
		var ok bool
		if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1, hashtext('outbox_migrate:' || current_schema()))`, migrateLockClass).Scan(&ok); err != nil {
			return err
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(migrateLockPoll):
		}
	}
}

// migrateTo is Migrate up to outbox version target (0: all). Tests use it
// to build an old schema and then upgrade it.
func migrateTo(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger, target int) (*Result, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	migrations, err := Migrations()
	if err != nil {
		return nil, err
	}

	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate: acquire connection: %w", err)
	}
	defer conn.Release()

	res := &Result{}
	if err := conn.QueryRow(ctx, `SELECT current_schema()`).Scan(&res.Schema); err != nil {
		return nil, fmt.Errorf("migrate: read current_schema: %w", err)
	}
	if res.Schema == "" {
		return nil, errors.New("migrate: no current schema: the search_path names no existing schema")
	}

	if err := lockMigrations(ctx, conn); err != nil {
		return nil, fmt.Errorf("migrate: take migration lock: %w", err)
	}
	defer func() {
		// Unlock on a fresh context: the caller's may be cancelled already.
		// If the connection is broken the session (and its lock) is gone anyway.
		_, _ = conn.Exec(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock($1, hashtext('outbox_migrate:' || current_schema()))`, migrateLockClass)
	}()

	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: logger})
	if err != nil {
		return nil, fmt.Errorf("migrate: river migrator: %w", err)
	}
	riverRes, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil)
	if err != nil {
		return nil, fmt.Errorf("migrate: river migrations: %w", err)
	}
	for _, v := range riverRes.Versions {
		res.RiverApplied = append(res.RiverApplied, v.Version)
	}

	if _, err := conn.Exec(ctx, createVersionTable); err != nil {
		return nil, fmt.Errorf("migrate: create outbox_schema_migration: %w", err)
	}
	applied := map[int]bool{}
	rows, err := conn.Query(ctx, `SELECT version FROM outbox_schema_migration`)
	if err != nil {
		return nil, fmt.Errorf("migrate: read applied versions: %w", err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("migrate: read applied versions: %w", err)
	}
	for _, v := range versions {
		applied[v] = true
		res.OutboxVersion = max(res.OutboxVersion, v)
	}

	for _, m := range migrations {
		if applied[m.Version] || (target > 0 && m.Version > target) {
			continue
		}
		var err error
		if m.NoTransaction {
			// A schema created by this run has an empty outbox_event: its
			// indexes are built without CONCURRENTLY, which would wait for
			// every older transaction in the whole database.
			fresh := len(res.OutboxApplied) > 0 && res.OutboxApplied[0] == 1
			err = applyNoTransaction(ctx, conn.Conn(), m, fresh)
		} else {
			err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, m.SQL); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, recordMigration, m.Version, m.Name)
				return err
			})
		}
		if err != nil {
			return nil, fmt.Errorf("migrate: outbox migration %03d_%s: %w", m.Version, m.Name, err)
		}
		logger.InfoContext(ctx, "applied outbox migration", slog.Int("version", m.Version), slog.String("name", m.Name), slog.String("schema", res.Schema))
		res.OutboxApplied = append(res.OutboxApplied, m.Version)
		res.OutboxVersion = max(res.OutboxVersion, m.Version)
	}
	return res, nil
}

const recordMigration = `INSERT INTO outbox_schema_migration (version, name) VALUES ($1, $2)`

// concurrentIndex matches a CREATE INDEX CONCURRENTLY IF NOT EXISTS and
// captures the index name.
var concurrentIndex = regexp.MustCompile(`(?is)^\s*CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+([a-z_][a-z0-9_]*)\s`)

// concurrently matches the CONCURRENTLY of a CREATE or DROP INDEX.
var concurrently = regexp.MustCompile(`(?is)^(\s*(?:CREATE\s+(?:UNIQUE\s+)?INDEX|DROP\s+INDEX))\s+CONCURRENTLY\b`)

// applyNoTransaction runs a no-transaction migration statement by statement
// and records it. An interrupted CREATE INDEX CONCURRENTLY leaves an INVALID
// index behind, which IF NOT EXISTS would then take for done: such an index
// is dropped (concurrently) and built again.
//
// With fresh set (the table was created by this run and is empty), index
// builds and drops run without CONCURRENTLY: they take their table lock for
// an instant, where a concurrent build waits for every transaction in the
// database that is older than it, whatever it touches.
func applyNoTransaction(ctx context.Context, conn *pgx.Conn, m Migration, fresh bool) error {
	for _, stmt := range splitStatements(m.SQL) {
		if fresh {
			stmt = concurrently.ReplaceAllString(stmt, "$1")
		}
		if sub := concurrentIndex.FindStringSubmatch(stmt); sub != nil {
			var invalid bool
			err := conn.QueryRow(ctx, `SELECT EXISTS (
				SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
				WHERE c.relname = $1 AND c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid)`, sub[1]).Scan(&invalid)
			if err != nil {
				return fmt.Errorf("check index %s: %w", sub[1], err)
			}
			if invalid {
				if _, err := conn.Exec(ctx, `DROP INDEX CONCURRENTLY IF EXISTS `+pgx.Identifier{sub[1]}.Sanitize()); err != nil {
					return fmt.Errorf("drop invalid index %s: %w", sub[1], err)
				}
			}
		}
		if _, err := conn.Exec(ctx, stmt); err != nil {
			if conn.PgConn().TxStatus() != 'I' {
				// A failed statement between the migration's own BEGIN and
				// COMMIT: leave the session clean for the lock's release.
				_, _ = conn.Exec(context.WithoutCancel(ctx), `ROLLBACK`)
			}
			return fmt.Errorf("%w (statement: %s)", err, firstLine(stmt))
		}
	}
	_, err := conn.Exec(ctx, recordMigration, m.Version, m.Name)
	return err
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(strings.TrimSpace(s), "\n")
	return s
}

// splitStatements splits SQL into statements at the semicolons outside
// quotes, comments and dollar-quoted bodies, and drops statements that are
// only comments or blanks.
func splitStatements(sql string) []string {
	var (
		out   []string
		start int
		code  bool // the current statement has more than comments
	)
	for i := 0; i < len(sql); i++ {
		switch c := sql[i]; {
		case c == '-' && strings.HasPrefix(sql[i:], "--"):
			if j := strings.IndexByte(sql[i:], '\n'); j >= 0 {
				i += j
			} else {
				i = len(sql)
			}
			if !code { // leading comments are not part of the statement
				start = min(i+1, len(sql))
			}
		case c == '/' && strings.HasPrefix(sql[i:], "/*"):
			if j := strings.Index(sql[i+2:], "*/"); j >= 0 {
				i += j + 3
			} else {
				i = len(sql)
			}
			if !code {
				start = min(i+1, len(sql))
			}
		case c == '\'' || c == '"':
			code = true
			for i++; i < len(sql); i++ {
				if sql[i] == c {
					if i+1 < len(sql) && sql[i+1] == c {
						i++
						continue
					}
					break
				}
			}
		case c == '$':
			code = true
			if tag := dollarTag.FindString(sql[i:]); tag != "" {
				if j := strings.Index(sql[i+len(tag):], tag); j >= 0 {
					i += len(tag) + j + len(tag) - 1
				} else {
					i = len(sql)
				}
			}
		case c == ';':
			if code {
				out = append(out, strings.TrimSpace(sql[start:i]))
			}
			start, code = i+1, false
		case c != ' ' && c != '\t' && c != '\n' && c != '\r':
			code = true
		}
	}
	if code {
		out = append(out, strings.TrimSpace(sql[start:]))
	}
	return out
}

// dollarTag matches the opening of a dollar-quoted string: $$ or $tag$.
var dollarTag = regexp.MustCompile(`^\$([A-Za-z_][A-Za-z0-9_]*)?\$`)
