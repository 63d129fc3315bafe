package outboxsql

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

//go:embed migrations/*.up.sql
var migrationFS embed.FS

// Migration is one numbered outbox migration.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

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
		out = append(out, Migration{Version: v, Name: rest, SQL: string(body)})
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

	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1, hashtext('outbox_migrate:' || current_schema()))`, migrateLockClass); err != nil {
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
		if applied[m.Version] {
			continue
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO outbox_schema_migration (version, name) VALUES ($1, $2)`, m.Version, m.Name)
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("migrate: outbox migration %03d_%s: %w", m.Version, m.Name, err)
		}
		logger.InfoContext(ctx, "applied outbox migration", slog.Int("version", m.Version), slog.String("name", m.Name), slog.String("schema", res.Schema))
		res.OutboxApplied = append(res.OutboxApplied, m.Version)
		res.OutboxVersion = max(res.OutboxVersion, m.Version)
	}
	return res, nil
}
