// Command outbox-demo is `make demo`: it creates a throwaway database,
// migrates it, starts a real outboxd with the reference routes, runs River
// workers for every routed queue, publishes a few hundred billing events the
// way the README shows (the business row and its events in one
// transaction), and prints how many were handed off and how long each took
// from the producer's commit to the worker's start. It exits by itself.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
	outboxsql "github.com/outboxhq/outbox/sql"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// timings records the producer's commit and the worker's start per event.
type timings struct {
	mu        sync.Mutex
	committed map[int64]time.Time
	started   map[int64]time.Time
	jobs      int
	all       chan struct{}
	want      int
}

func (t *timings) commit(ids []int64, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, id := range ids {
		t.committed[id] = at
	}
}

func (t *timings) start(id int64, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.jobs++
	if _, seen := t.started[id]; !seen {
		t.started[id] = at
	}
	if t.jobs == t.want {
		close(t.all)
	}
}

// demoWorker works every outbox job: it only records when it started.
type demoWorker struct {
	river.WorkerDefaults[outboxriver.EventArgs]
	t *timings
}

func (w *demoWorker) Work(_ context.Context, job *river.Job[outboxriver.EventArgs]) error {
	w.t.start(job.Args.EventID, time.Now())
	return nil
}

func run() error {
	var (
		invoices = flag.Int("invoices", 300, "invoices to pay (each publishes 2 events)")
		rate     = flag.Int("rate", 100, "invoices per second")
		keep     = flag.Bool("keep", false, "keep the demo database")
	)
	flag.Parse()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	baseURL := os.Getenv("DATABASE_URL")
	if baseURL == "" {
		baseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	ctx, stop := signalContext()
	defer stop()

	// A throwaway database for this run.
	dbName := fmt.Sprintf("outbox_demo_%d", os.Getpid())
	admin, err := pgx.Connect(ctx, baseURL)
	if err != nil {
		return fmt.Errorf("connect (set DATABASE_URL): %w", err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+dbName); err != nil {
		return err
	}
	if !*keep {
		defer func() {
			_, _ = admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+dbName+" WITH (FORCE)")
		}()
	}
	cfg, err := pgxpool.ParseConfig(baseURL)
	if err != nil {
		return err
	}
	cfg.ConnConfig.Database = dbName
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	dbURL := fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", cfg.ConnConfig.User, cfg.ConnConfig.Host, cfg.ConnConfig.Port, dbName)
	if cfg.ConnConfig.Password != "" {
		dbURL = fmt.Sprintf("postgres://%s:%s@%s:%d/%s?sslmode=disable", cfg.ConnConfig.User, cfg.ConnConfig.Password, cfg.ConnConfig.Host, cfg.ConnConfig.Port, dbName)
	}

	step("1/5 migrating a fresh database " + dbName)
	if _, err := outboxsql.Migrate(ctx, pool, logger); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE invoice (id bigint PRIMARY KEY, tenant_id text NOT NULL, amount_cents int NOT NULL, paid_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return err
	}

	step("2/5 starting outboxd (the dispatcher) with docs/examples/routes.yaml")
	routesFile, _ := filepath.Abs("docs/examples/routes.yaml")
	routes, err := route.Load(routesFile)
	if err != nil {
		return err
	}
	bin, cleanup, err := buildOutboxd()
	if err != nil {
		return err
	}
	defer cleanup()
	daemon := exec.Command(bin)
	daemon.Env = append(os.Environ(),
		"DATABASE_URL="+dbURL,
		"OUTBOX_DISPATCHER_ENABLED=true",
		"OUTBOX_ROUTES_FILE="+routesFile,
		"OUTBOX_LOG_LEVEL=warn",
	)
	daemon.Stdout, daemon.Stderr = os.Stderr, os.Stderr
	if err := daemon.Start(); err != nil {
		return err
	}
	daemonDone := make(chan error, 1)
	go func() { daemonDone <- daemon.Wait() }()
	defer func() {
		if daemon.ProcessState == nil {
			_ = daemon.Process.Kill()
			<-daemonDone
		}
	}()

	step("3/5 starting River workers for every routed queue")
	t := &timings{committed: map[int64]time.Time{}, started: map[int64]time.Time{}, all: make(chan struct{}), want: *invoices * 2}
	workers := river.NewWorkers()
	river.AddWorker(workers, &demoWorker{t: t})
	queues := map[string]int{}
	for _, q := range routes.AllQueues() {
		queues[q] = 20
	}
	wcfg := outboxriver.WorkerConfig(workers, queues, outboxriver.WorkerLatency{})
	wcfg.Logger = logger
	client, err := river.NewClient(riverpgxv5.New(pool), wcfg)
	if err != nil {
		return err
	}
	if err := client.Start(ctx); err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = client.Stop(sctx)
	}()
	// Wait for outboxd's LISTEN connection (until then it would poll).
	for i := 0; ; i++ {
		var listening int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND query ILIKE 'listen%'`, dbName).Scan(&listening); err != nil {
			return err
		}
		if listening > 0 {
			break
		}
		if i > 500 {
			return errors.New("outboxd did not start listening within 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}

	step(fmt.Sprintf("4/5 paying %d invoices at %d/s: each transaction writes the invoice and publishes billing.invoice.paid + mail.receipt.requested", *invoices, *rate))
	tick := time.NewTicker(time.Second / time.Duration(*rate))
	defer tick.Stop()
	for i := 1; i <= *invoices; i++ {
		<-tick.C
		tenant := fmt.Sprintf("tenant-%d", i%7)
		var ids []int64
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO invoice (id, tenant_id, amount_cents) VALUES ($1, $2, $3)`, i, tenant, 1000+i); err != nil {
				return err
			}
			payload, _ := json.Marshal(map[string]any{"invoice_id": i, "amount_cents": 1000 + i})
			res, err := outbox.PublishMany(ctx, tx, []outbox.Event{
				{Type: "billing.invoice.paid", TenantID: tenant, Payload: payload, DispatchKey: fmt.Sprintf("invoice:%d:paid", i)},
				{Type: "mail.receipt.requested", TenantID: tenant, Payload: payload},
			})
			for _, r := range res {
				ids = append(ids, r.ID)
			}
			return err
		})
		if err != nil {
			return err
		}
		t.commit(ids, time.Now())
	}

	step("5/5 waiting for every job to start")
	select {
	case <-t.all:
	case <-time.After(30 * time.Second):
		return fmt.Errorf("only %d of %d jobs started within 30s", t.jobs, t.want)
	case <-ctx.Done():
		return ctx.Err()
	}

	_ = daemon.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-daemonDone:
		if err != nil {
			return fmt.Errorf("outboxd did not exit cleanly: %w", err)
		}
	case <-time.After(30 * time.Second):
		return errors.New("outboxd did not stop within 30s of SIGTERM")
	}
	return report(ctx, pool, t)
}

func report(ctx context.Context, pool *pgxpool.Pool, t *timings) error {
	var done, pending, jobs int
	var handoffP50, handoffP99 float64
	err := pool.QueryRow(ctx, `
		SELECT (SELECT count(*) FROM outbox_event WHERE status = 'done'),
		       (SELECT count(*) FROM outbox_event WHERE status <> 'done'),
		       (SELECT count(*) FROM river_job),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM j.created_at - e.created_at) * 1000),
		       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM j.created_at - e.created_at) * 1000)
		FROM outbox_event e JOIN river_job j ON j.id = e.river_job_ids[1]`).Scan(&done, &pending, &jobs, &handoffP50, &handoffP99)
	if err != nil {
		return err
	}
	t.mu.Lock()
	lat := make([]time.Duration, 0, len(t.started))
	for id, s := range t.started {
		if c, ok := t.committed[id]; ok {
			lat = append(lat, s.Sub(c))
		}
	}
	t.mu.Unlock()
	slices.Sort(lat)
	pct := func(p float64) time.Duration {
		if len(lat) == 0 {
			return 0
		}
		return lat[min(len(lat)-1, int(p*float64(len(lat))))]
	}
	fmt.Println()
	fmt.Println("outbox demo summary")
	fmt.Printf("  events published         %d\n", len(t.committed))
	fmt.Printf("  events handed off (done) %d   not done: %d\n", done, pending)
	fmt.Printf("  River jobs created       %d   (one per event and routed queue)\n", jobs)
	fmt.Printf("  jobs worked              %d\n", t.jobs)
	fmt.Printf("  handoff, event created_at → River job created_at (database clock): p50 %.2f ms, p99 %.2f ms\n", handoffP50, handoffP99)
	fmt.Printf("  commit → worker start (one process clock): p50 %s  p90 %s  p99 %s  max %s\n",
		round(pct(0.50)), round(pct(0.90)), round(pct(0.99)), round(pct(1)))
	if done != len(t.committed) || pending != 0 || jobs != len(t.committed) {
		return fmt.Errorf("ledger mismatch: published %d, done %d, jobs %d", len(t.committed), done, jobs)
	}
	return nil
}

func round(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }

func step(s string) { fmt.Println("==>", s) }

func buildOutboxd() (string, func(), error) {
	dir, err := os.MkdirTemp("", "outbox-demo")
	if err != nil {
		return "", nil, err
	}
	bin := filepath.Join(dir, "outboxd")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/outboxd")
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("build outboxd: %w", err)
	}
	return bin, func() { os.RemoveAll(dir) }, nil
}
