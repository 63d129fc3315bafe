package main

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	outboxsql "github.com/outboxhq/outbox/sql"

	"github.com/outboxhq/outbox/route"
)

// Every benchmark event has this type; the routes send it to one queue.
const (
	eventType  = "bench.event.created"
	benchQueue = "outbox_bench"
	routesYAML = "routes:\n  - prefix: \"bench.\"\n    queue: " + benchQueue + "\n"
	// wakeLockClass is dispatcher.wakeLockClass (unexported there).
	wakeLockClass = 1868720215
)

// env is one bench run: its database, an admin pool on it, the routes and
// a temp dir (routes file, outboxd binary).
type env struct {
	serverURL string
	dbName    string
	dbURL     string
	admin     *pgxpool.Pool
	routes    *route.Table
	tmp       string
	repo      string
	keep      bool
	outboxd   string // built lazily
	quiet     *slog.Logger
}

// envs counts the envs of this process: the first one's database is
// outbox_bench_<pid>, a later one's outbox_bench_<pid>_<n> (tests run
// several at once).
var envs atomic.Int64

func newEnv(ctx context.Context, o *Options) (*env, error) {
	name := fmt.Sprintf("outbox_bench_%d", os.Getpid())
	if n := envs.Add(1); n > 1 {
		name += fmt.Sprintf("_%d", n)
	}
	e := &env{serverURL: o.URL, dbName: name, repo: o.Repo, keep: o.Keep}
	var err error
	e.routes, err = route.New([]route.Rule{{Prefix: "bench.", Queues: []string{benchQueue}}})
	if err != nil {
		return nil, err
	}
	e.quiet = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	if o.Verbose {
		e.quiet = slog.Default()
	}

	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	conn, err := pgx.Connect(cctx, o.URL)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w (set TEST_DATABASE_URL, or run `make bench`, which starts a Postgres)", redact(o.URL), err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	if _, err := conn.Exec(cctx, "CREATE DATABASE "+pgx.Identifier{e.dbName}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create database %s: %w", e.dbName, err)
	}
	logf("created database %s", e.dbName)
	e.dbURL, err = withDatabase(o.URL, e.dbName)
	if err != nil {
		e.close()
		return nil, err
	}
	e.admin, err = e.pool(ctx, "public", 4, "bench-admin")
	if err != nil {
		e.close()
		return nil, err
	}
	if e.tmp, err = os.MkdirTemp("", "outbox-bench-"); err != nil {
		e.close()
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(e.tmp, "routes.yaml"), []byte(routesYAML), 0o644); err != nil {
		e.close()
		return nil, err
	}
	return e, nil
}

func (e *env) close() {
	if e.admin != nil {
		e.admin.Close()
	}
	if e.tmp != "" {
		_ = os.RemoveAll(e.tmp)
	}
	if e.keep {
		logf("kept database %s", e.dbName)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, e.serverURL)
	if err != nil {
		logf("drop database %s: %v", e.dbName, err)
		return
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{e.dbName}.Sanitize()+" WITH (FORCE)"); err != nil {
		logf("drop database %s: %v", e.dbName, err)
		return
	}
	logf("dropped database %s", e.dbName)
}

// schemaURL is the bench database's URL with search_path set.
func (e *env) schemaURL(schema, appName string) string {
	return withParams(e.dbURL, map[string]string{"search_path": schema, "application_name": appName})
}

// pool opens a pool whose search_path is schema.
func (e *env) pool(ctx context.Context, schema string, maxConns int32, appName string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.schemaURL(schema, appName))
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = maxConns
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := p.Ping(ctx); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// migrated creates schema, migrates it (River's and the outbox's
// migrations) and returns a pool on it.
func (e *env) migrated(ctx context.Context, schema string, maxConns int32) (*pgxpool.Pool, error) {
	if _, err := e.admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create schema %s: %w", schema, err)
	}
	p, err := e.pool(ctx, schema, maxConns, "bench-"+schema)
	if err != nil {
		return nil, err
	}
	if _, err := outboxsql.Migrate(ctx, p, nil); err != nil {
		p.Close()
		return nil, fmt.Errorf("migrate %s: %w", schema, err)
	}
	return p, nil
}

// waitWakeLock waits until an idle dispatcher holds the wake lock of the
// pool's schema (the dispatcher is then listening and idle).
func waitWakeLock(ctx context.Context, p *pgxpool.Pool, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var held bool
		err := p.QueryRow(ctx, `
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = $1::bigint::oid AND objid = (outbox_wake_lock_key()::bigint & 4294967295)::oid
      AND objsubid = 2 AND mode = 'ExclusiveLock' AND granted)`, wakeLockClass).Scan(&held)
		if err != nil {
			return fmt.Errorf("wait for the wake lock: %w", err)
		}
		if held {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no dispatcher took the wake lock within %s", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// buildOutboxd builds ./cmd/outboxd of the repo into the temp dir once.
func (e *env) buildOutboxd(ctx context.Context) (string, error) {
	if e.outboxd != "" {
		return e.outboxd, nil
	}
	bin := filepath.Join(e.tmp, "outboxd")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/outboxd")
	cmd.Dir = e.repo
	cmd.Stderr = os.Stderr
	cmd.Stdout = os.Stderr
	logf("building outboxd from %s", e.repo)
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go build ./cmd/outboxd in %s: %w", e.repo, err)
	}
	e.outboxd = bin
	return bin, nil
}

func withDatabase(raw, db string) (string, error) {
	if strings.HasPrefix(raw, "postgres://") || strings.HasPrefix(raw, "postgresql://") {
		u, err := url.Parse(raw)
		if err != nil {
			return "", err
		}
		u.Path = "/" + db
		return u.String(), nil
	}
	return raw + " dbname=" + db, nil
}

func withParams(raw string, params map[string]string) string {
	if strings.HasPrefix(raw, "postgres://") || strings.HasPrefix(raw, "postgresql://") {
		u, err := url.Parse(raw)
		if err == nil {
			q := u.Query()
			for k, v := range params {
				q.Set(k, v)
			}
			u.RawQuery = q.Encode()
			return u.String()
		}
	}
	for k, v := range params {
		raw += " " + k + "=" + v
	}
	return raw
}

func redact(raw string) string {
	cfg, err := pgx.ParseConfig(raw)
	if err != nil || cfg.Password == "" {
		return raw
	}
	return strings.ReplaceAll(raw, cfg.Password, "xxxxx")
}

// Meta describes the run and the machine.
type Meta struct {
	Started    string            `json:"started"`
	Elapsed    string            `json:"elapsed"`
	Command    string            `json:"command"`
	Quick      bool              `json:"quick"`
	GoVersion  string            `json:"go_version"`
	CPU        string            `json:"cpu"`
	Cores      int               `json:"cores"`
	MemTotal   string            `json:"mem_total"`
	Kernel     string            `json:"kernel"`
	Postgres   string            `json:"postgres"`
	PGSettings map[string]string `json:"pg_settings"`
	// Warning is set when the server's settings are not production-like.
	Warning     string `json:"warning,omitempty"`
	LoadAvg     string `json:"loadavg_start"`
	LoadAvgEnd  string `json:"loadavg_end"`
	Rate        int    `json:"rate"`
	Duration    string `json:"duration"`
	N           int    `json:"n"`
	Commit      string `json:"commit"`
	OtherConns  int    `json:"other_connections_at_start"`
	Description string `json:"description"`
}

func (e *env) meta(ctx context.Context, o *Options, start time.Time) Meta {
	m := Meta{
		Started:   start.UTC().Format(time.RFC3339),
		Command:   strings.TrimSpace("go run . " + strings.Join(os.Args[1:], " ")),
		Quick:     o.Quick,
		GoVersion: runtime.Version(),
		Cores:     runtime.NumCPU(),
		LoadAvg:   loadAvg(),
		Rate:      o.Rate,
		Duration:  o.Duration.String(),
		N:         o.N,
	}
	m.CPU = firstField("/proc/cpuinfo", "model name")
	m.MemTotal = firstField("/proc/meminfo", "MemTotal")
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	_ = e.admin.QueryRow(ctx, `SELECT version()`).Scan(&m.Postgres)
	m.PGSettings = map[string]string{}
	// current_setting prints a value with its unit as postgresql.conf would
	// ("2GB"); setting || unit printed 262144 pages of 8kB as "2621448kB".
	rows, err := e.admin.Query(ctx, `SELECT name, current_setting(name) FROM pg_settings
		WHERE name IN ('fsync','synchronous_commit','shared_buffers','max_connections','wal_level','full_page_writes',
		               'autovacuum','max_wal_size','checkpoint_completion_target','effective_cache_size','work_mem')`)
	if err == nil {
		for rows.Next() {
			var k, v string
			if rows.Scan(&k, &v) == nil {
				m.PGSettings[k] = v
			}
		}
		rows.Close()
	}
	if m.PGSettings["autovacuum"] != "on" || m.PGSettings["fsync"] != "on" {
		m.Warning = fmt.Sprintf("NOT PRODUCTION-LIKE: autovacuum=%s fsync=%s synchronous_commit=%s shared_buffers=%s: figures about dead rows, plans, bloat, commit latency and long runs do not transfer to a production server (run `make bench` without BENCH_PG=existing for a production-like throwaway cluster)",
			m.PGSettings["autovacuum"], m.PGSettings["fsync"], m.PGSettings["synchronous_commit"], m.PGSettings["shared_buffers"])
		logf("WARNING: %s", m.Warning)
	}
	_ = e.admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND datname <> current_database()`).Scan(&m.OtherConns)
	if out, err := exec.Command("git", "-C", o.Repo, "rev-parse", "--short", "HEAD").Output(); err == nil {
		m.Commit = strings.TrimSpace(string(out))
	}
	return m
}

func firstField(path, key string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == key {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}
