// Command outbox-demo is `make demo`. On a throwaway database it runs:
//
//   - outboxd as the "general" group: the dispatcher, plus River workers
//     with outboxd's built-in log handler for the general queues;
//   - this binary again (-receivers) as the "mail" group, a separate
//     process that embeds package outboxriver the way your service would,
//     with real receivers: mail writes to a mailbox table (WithIdempotency),
//     webhook POSTs to a local HTTP receiver the demo starts (WithClaim),
//     audit appends to an audit table (WithIdempotency).
//
// It pays a few hundred invoices (each transaction writes the invoice and
// publishes its events), makes the webhook receiver fail once (a retry),
// then inserts a second job for an event already handled (a duplicate
// delivery, suppressed), checks the ledger, prints latency percentiles and
// `outboxctl explain` of the retried event, and exits by itself.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/plural"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
	outboxsql "github.com/outboxhq/outbox/sql"
)

func main() {
	receivers := flag.Bool("receivers", false, "run as the mail group's receivers process (the demo starts it)")
	invoices := flag.Int("invoices", 300, "invoices to pay")
	rate := flag.Int("rate", 100, "invoices per second")
	keep := flag.Bool("keep", false, "keep the demo database (to run outboxctl explain on it afterwards)")
	serve := flag.Bool("serve", false, "after the summary, keep a dispatcher running with the operator console and River UI until Ctrl-C")
	flag.Parse()
	var err error
	if *receivers {
		err = runReceivers()
	} else {
		err = run(*invoices, *rate, *keep, *serve)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// The mail group's queues; the general group works every other routed
// queue.
var mailQueues = []string{"outbox_mail:20", "outbox_webhook:5", "outbox_audit"}

const demoTables = `
CREATE TABLE invoice (id bigint PRIMARY KEY, tenant_id text NOT NULL, amount_cents int NOT NULL, paid_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE mailbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id bigint NOT NULL, invoice_id bigint NOT NULL,
    recipient text NOT NULL, subject text NOT NULL, handler_started_at timestamptz NOT NULL, written_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE audit_log (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id bigint NOT NULL, event_type text NOT NULL,
    tenant_id text, payload jsonb NOT NULL, at timestamptz NOT NULL DEFAULT now());`

// hookServer is the local webhook receiver. It answers 503 to the first
// POST (the injected transient failure) and 200 to the others.
type hookServer struct {
	mu       sync.Mutex
	posts    int
	failedID int64
	accepted map[int64]int
}

func (h *hookServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body struct {
		EventID int64 `json:"event_id"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.posts++
	if h.posts == 1 {
		h.failedID = body.EventID
		http.Error(w, "injected transient failure", http.StatusServiceUnavailable)
		return
	}
	h.accepted[body.EventID]++
	fmt.Fprintf(w, "delivery-%d", h.posts)
}

func run(invoices, rate int, keep, serve bool) error {
	if invoices < 10 || rate < 1 {
		return errors.New("-invoices must be at least 10 and -rate at least 1")
	}
	began := time.Now()
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
	defer func() { _ = admin.Close(context.Background()) }()
	sweepDemoDatabases(ctx, admin)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+dbName); err != nil {
		return err
	}
	// The database is dropped however run ends (an error, Ctrl-C); with
	// -keep it is marked so that a later run's sweep leaves it alone.
	if keep {
		if _, err := admin.Exec(ctx, "COMMENT ON DATABASE "+dbName+" IS '"+keptComment+"'"); err != nil {
			return err
		}
	} else {
		defer func() {
			dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if _, err := admin.Exec(dctx, "DROP DATABASE IF EXISTS "+dbName+" WITH (FORCE)"); err != nil {
				fmt.Fprintf(os.Stderr, "demo: could not drop the demo database %s: %v (drop it by hand)\n", dbName, err)
			}
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

	step("1/6 migrating a fresh database " + dbName + " (outbox, River, demo tables invoice/mailbox/audit_log)")
	if _, err := outboxsql.Migrate(ctx, pool, logger); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, demoTables); err != nil {
		return err
	}

	step("2/6 starting the local webhook receiver (its first POST fails with 503: the injected transient failure)")
	hook := &hookServer{accepted: map[int64]int{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: hook, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer func() { _ = srv.Close() }()
	hookURL := "http://" + ln.Addr().String() + "/hook"

	routesFile, _ := filepath.Abs("docs/examples/routes.yaml")
	routes, err := route.Load(routesFile)
	if err != nil {
		return err
	}
	var general []string
	for _, q := range routes.AllQueues() {
		if !slices.ContainsFunc(mailQueues, func(m string) bool { return strings.SplitN(m, ":", 2)[0] == q }) {
			general = append(general, q)
		}
	}
	groups := "general=" + strings.Join(general, ",") + ";mail=" + strings.Join(mailQueues, ",")

	step("3/6 starting two worker groups as separate processes")
	fmt.Printf("    OUTBOX_WORKER_GROUPS=%s\n", groups)
	fmt.Println("    general: outboxd with the dispatcher and the built-in log handler")
	fmt.Println("    mail:    this binary with -receivers, real handlers for mail., webhook. and audit.")
	bin, cleanup, err := buildTools()
	if err != nil {
		return err
	}
	defer cleanup()
	env := append(os.Environ(), "DATABASE_URL="+dbURL, "OUTBOX_ROUTES_FILE="+routesFile, "OUTBOX_WORKER_GROUPS="+groups, "OUTBOX_LOG_LEVEL=warn")
	procs := &processes{}
	defer procs.kill()
	if err := procs.start("general", exec.Command(filepath.Join(bin, "outboxd")), append(env,
		"OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_WORKER_GROUP=general", "OUTBOX_WORKER_HANDLER=log")); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	if err := procs.start("mail", exec.Command(self, "-receivers"), append(env,
		"OUTBOX_WORKER_GROUP=mail", "DEMO_WEBHOOK_URL="+hookURL)); err != nil {
		return err
	}
	// Ready when outboxd listens and River has registered every queue of
	// both groups.
	want := len(routes.AllQueues())
	if err := waitUntil(ctx, 20*time.Second, "both groups to start", procs, func() (bool, error) {
		var listening, queues int
		err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND query ILIKE 'listen%'),
		                                  (SELECT count(*) FROM river_queue)`, dbName).Scan(&listening, &queues)
		return listening > 0 && queues >= want, err
	}); err != nil {
		return err
	}

	step(fmt.Sprintf("4/6 paying %d invoices at %d/s: each transaction writes the invoice and publishes billing.invoice.paid, mail.receipt.requested, audit.invoice.paid (and every 10th webhook.invoice.paid)", invoices, rate))
	committed := map[int64]time.Time{}
	mailEvents := make([]int64, 0, invoices)
	webhooks := 0
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for i := 1; i <= invoices; i++ {
		select {
		case <-tick.C:
		case <-ctx.Done():
			return ctx.Err()
		}
		tenant := fmt.Sprintf("tenant-%d", i%7)
		payload, _ := json.Marshal(invoicePayload{InvoiceID: int64(i), AmountCents: 1000 + i, Email: fmt.Sprintf("billing+%d@example.com", i)})
		events := []outbox.Event{
			{Type: "billing.invoice.paid", TenantID: tenant, Payload: payload, DispatchKey: fmt.Sprintf("invoice:%d:paid", i)},
			{Type: "mail.receipt.requested", TenantID: tenant, Payload: payload},
			{Type: "audit.invoice.paid", TenantID: tenant, Payload: payload},
		}
		if i%10 == 1 {
			events = append(events, outbox.Event{Type: "webhook.invoice.paid", TenantID: tenant, Payload: payload})
			webhooks++
		}
		var res []outbox.Published
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO invoice (id, tenant_id, amount_cents) VALUES ($1, $2, $3)`, i, tenant, 1000+i); err != nil {
				return err
			}
			var err error
			res, err = outbox.PublishMany(ctx, tx, events)
			return err
		})
		if err != nil {
			return err
		}
		now := time.Now()
		for _, r := range res {
			committed[r.ID] = now
		}
		mailEvents = append(mailEvents, res[1].ID)
	}
	published := len(committed)
	jobs := 3*invoices + webhooks

	step("5/6 waiting for every job; then delivering two events a second time (a forced duplicate job each)")
	completed := func() (int, error) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE state = 'completed'`).Scan(&n)
		return n, err
	}
	if err := waitUntil(ctx, 30*time.Second, fmt.Sprintf("%d jobs to complete", jobs), procs, func() (bool, error) {
		n, err := completed()
		return n == jobs, err
	}); err != nil {
		return err
	}
	hook.mu.Lock()
	retried := hook.failedID
	hook.mu.Unlock()
	if retried == 0 {
		return errors.New("the webhook receiver never failed: no retry to show")
	}
	ins, err := outboxriver.NewInsertClient(pool, outboxriver.InsertClientConfig{})
	if err != nil {
		return err
	}
	for _, id := range []int64{mailEvents[0], retried} {
		if err := redeliver(ctx, pool, ins, id); err != nil {
			return err
		}
	}
	if err := waitUntil(ctx, 20*time.Second, "the duplicate jobs to complete", procs, func() (bool, error) {
		n, err := completed()
		return n == jobs+2, err
	}); err != nil {
		return err
	}

	step("6/6 stopping both groups (SIGTERM)")
	if err := procs.stop(30 * time.Second); err != nil {
		return err
	}
	if err := report(ctx, pool, reportInput{
		published: published, invoices: invoices, webhooks: webhooks, jobs: jobs,
		committed: committed, hook: hook, retried: retried, dupMail: mailEvents[0],
	}); err != nil {
		return err
	}

	fmt.Printf("\n$ outboxctl explain %d   # the webhook event that failed once (503), then was delivered\n", retried)
	explain := exec.Command(filepath.Join(bin, "outboxctl"), "explain", fmt.Sprint(retried))
	explain.Env = append(os.Environ(), "DATABASE_URL="+dbURL, "OUTBOX_ROUTES_FILE="+routesFile)
	explain.Stdout, explain.Stderr = os.Stdout, os.Stderr
	if err := explain.Run(); err != nil {
		return fmt.Errorf("outboxctl explain: %w", err)
	}
	if keep {
		fmt.Printf("\nThe database %s is kept: DATABASE_URL=%s go run ./cmd/outboxctl explain <event-id>\n", dbName, dbURL)
	}
	fmt.Printf("\ndemo finished in %s\n", time.Since(began).Round(100*time.Millisecond))
	if !serve {
		fmt.Println("\nTo look at these events in the operator console and River UI, run `make demo DEMO_FLAGS=-serve`:")
		fmt.Println("it keeps a dispatcher running after the summary and prints the console's address (docs/console.md).")
		return nil
	}
	return serveConsole(ctx, bin, env)
}

// serveConsole starts one outboxd (dispatcher and the general group) with
// its HTTP listener on a free loopback port, prints the addresses of the
// operator console and River UI, and waits for Ctrl-C.
func serveConsole(ctx context.Context, bin string, env []string) error {
	procs := &processes{}
	defer procs.kill()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	if err := procs.start("console", exec.Command(filepath.Join(bin, "outboxd")), append(env,
		"OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_WORKER_GROUP=general", "OUTBOX_WORKER_HANDLER=log",
		"OUTBOX_HTTP_ADDR="+addr)); err != nil {
		return err
	}
	if err := waitUntil(ctx, 20*time.Second, "the console to answer", procs, func() (bool, error) {
		resp, err := http.Get("http://" + addr + "/console/")
		if err != nil {
			return false, nil //nolint:nilerr // not up yet: ask again
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	}); err != nil {
		return err
	}
	fmt.Printf("\noperator console: http://%s/console/\nRiver UI:         http://%s/riverui/\n", addr, addr)
	fmt.Println("(read-only: set OUTBOX_CONSOLE_TOKEN for requeue and cancel; Ctrl-C stops it and drops the demo database)")
	<-ctx.Done()
	return procs.stop(30 * time.Second)
}

// keptComment marks a database kept with -keep.
const keptComment = "outbox-demo -keep"

// sweepDemoDatabases drops the databases that earlier runs left behind
// when they were killed (SIGKILL, a closed terminal) before they could drop
// them: outbox_demo_<pid> databases that nobody is connected to (a running
// demo always is) and that -keep did not mark.
func sweepDemoDatabases(ctx context.Context, admin *pgx.Conn) {
	rows, err := admin.Query(ctx, `
		SELECT d.datname FROM pg_database d
		WHERE d.datname ~ '^outbox_demo_[0-9]+$'
		  AND coalesce(shobj_description(d.oid, 'pg_database'), '') <> $1
		  AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)`, keptComment)
	if err != nil {
		return
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return
	}
	for _, n := range names {
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{n}.Sanitize()); err == nil {
			fmt.Printf("==> dropped %s, left behind by an earlier demo run that was killed\n", n)
		}
	}
}

// redeliver inserts a second River job with the args and queue of event
// id's first job: a duplicate delivery, as an operator's re-run or a
// rescued job would cause.
func redeliver(ctx context.Context, pool *pgxpool.Pool, ins *river.Client[pgx.Tx], id int64) error {
	var (
		raw   []byte
		queue string
	)
	if err := pool.QueryRow(ctx, `SELECT j.args, j.queue FROM outbox_event e JOIN river_job j ON j.id = e.river_job_ids[1] WHERE e.id = $1`, id).Scan(&raw, &queue); err != nil {
		return fmt.Errorf("redeliver event %d: %w", id, err)
	}
	var args outboxriver.EventArgs
	if err := json.Unmarshal(raw, &args); err != nil {
		return err
	}
	_, err := ins.Insert(ctx, args, &river.InsertOpts{Queue: queue})
	return err
}

type reportInput struct {
	published, invoices, webhooks, jobs int
	committed                           map[int64]time.Time
	hook                                *hookServer
	retried, dupMail                    int64
}

func report(ctx context.Context, pool *pgxpool.Pool, in reportInput) error {
	var done, notDone, mailbox, audit int
	var handoffP50, handoffP99, startP50, startP90, startP99 float64
	err := pool.QueryRow(ctx, `
		SELECT (SELECT count(*) FROM outbox_event WHERE status = 'done'),
		       (SELECT count(*) FROM outbox_event WHERE status <> 'done'),
		       (SELECT count(*) FROM mailbox),
		       (SELECT count(*) FROM audit_log),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM j.created_at - e.created_at) * 1000),
		       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM j.created_at - e.created_at) * 1000),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM j.attempted_at - e.created_at) * 1000) FILTER (WHERE j.attempt = 1),
		       percentile_cont(0.9) WITHIN GROUP (ORDER BY extract(epoch FROM j.attempted_at - e.created_at) * 1000) FILTER (WHERE j.attempt = 1),
		       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM j.attempted_at - e.created_at) * 1000) FILTER (WHERE j.attempt = 1)
		FROM outbox_event e JOIN river_job j ON j.id = ANY(e.river_job_ids)`).
		Scan(&done, &notDone, &mailbox, &audit, &handoffP50, &handoffP99, &startP50, &startP90, &startP99)
	if err != nil {
		return err
	}

	// commit (this process's clock) → mail receiver start (the receivers
	// process's clock; same host, same wall clock).
	rows, err := pool.Query(ctx, `SELECT event_id, handler_started_at FROM mailbox`)
	if err != nil {
		return err
	}
	var lat []time.Duration
	for rows.Next() {
		var id int64
		var at time.Time
		if err := rows.Scan(&id, &at); err != nil {
			return err
		}
		if c, ok := in.committed[id]; ok {
			lat = append(lat, at.Sub(c))
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	slices.Sort(lat)
	pct := func(p float64) time.Duration {
		if len(lat) == 0 {
			return 0
		}
		return lat[min(len(lat)-1, int(p*float64(len(lat))))].Round(10 * time.Microsecond)
	}

	type groupRow struct {
		group, queue string
		jobs         int
		retried      int
	}
	grows, err := pool.Query(ctx, `
		SELECT split_part(attempted_by[1], '_', 1), queue, count(*), count(*) FILTER (WHERE attempt > 1)
		FROM river_job WHERE state = 'completed' GROUP BY 1, 2 ORDER BY 1, 2`)
	if err != nil {
		return err
	}
	byGroup, err := pgx.CollectRows(grows, func(r pgx.CollectableRow) (groupRow, error) {
		var g groupRow
		return g, r.Scan(&g.group, &g.queue, &g.jobs, &g.retried)
	})
	if err != nil {
		return err
	}
	var dupJobs, dupMailRows, dupSuppressed int
	if err := pool.QueryRow(ctx, `
		SELECT (SELECT count(*) FROM river_job WHERE (args->>'event_id')::bigint IN ($1, $2) AND state = 'completed'),
		       (SELECT count(*) FROM mailbox WHERE event_id = $1),
		       (SELECT count(*) FROM outbox_receipt WHERE event_id IN ($1, $2) AND state = 'done')`, in.dupMail, in.retried).
		Scan(&dupJobs, &dupMailRows, &dupSuppressed); err != nil {
		return err
	}
	in.hook.mu.Lock()
	posts, accepted, acceptedRetried := in.hook.posts, len(in.hook.accepted), in.hook.accepted[in.retried]
	in.hook.mu.Unlock()

	fmt.Println()
	fmt.Println("outbox demo summary")
	fmt.Printf("  events published              %d   (%d invoices)\n", in.published, in.invoices)
	fmt.Printf("  events handed off (done)      %d   not done: %d\n", done, notDone)
	fmt.Printf("  River jobs completed          %d   (+2 forced duplicates)\n", in.jobs)
	for _, g := range byGroup {
		extra := ""
		if g.retried > 0 {
			extra = fmt.Sprintf("   %d needed a retry", g.retried)
		}
		fmt.Printf("    group %-8s %-30s %9s%s\n", g.group, g.queue, plural.Of(g.jobs, "job", "jobs"), extra)
	}
	fmt.Printf("  mail: mailbox rows            %d   (one per mail event)\n", mailbox)
	fmt.Printf("  audit: audit_log rows         %d   (one per audit event)\n", audit)
	fmt.Printf("  webhook: POSTs received       %d   (%d events accepted once each, plus the injected 503)\n", posts, accepted)
	fmt.Printf("  retry: event %d got 503 on attempt 1; the claim was released and attempt 2 delivered it\n", in.retried)
	fmt.Printf("  duplicates: events %d (mail) and %d (webhook) each ran as a second job; %s, %s, %s, %s: suppressed\n",
		in.dupMail, in.retried, plural.Of(dupJobs, "job", "jobs"), plural.Of(dupSuppressed, "receipt", "receipts"),
		plural.Of(dupMailRows, "mailbox row", "mailbox rows"), plural.Of(acceptedRetried, "accepted POST", "accepted POSTs"))
	fmt.Printf("  handoff, event created_at → River job created_at (database clock): p50 %.2f ms, p99 %.2f ms\n", handoffP50, handoffP99)
	fmt.Printf("  event created_at → first attempt (database clock, both groups): p50 %.2f ms  p90 %.2f ms  p99 %.2f ms\n", startP50, startP90, startP99)
	fmt.Printf("  commit → mail receiver start (wall clock, other process): p50 %s  p90 %s  p99 %s  max %s\n", pct(0.50), pct(0.90), pct(0.99), pct(1))

	var problems []string
	if done != in.published || notDone != 0 {
		problems = append(problems, fmt.Sprintf("%d of %s done", done, plural.Of(in.published, "event", "events")))
	}
	if mailbox != in.invoices || audit != in.invoices {
		problems = append(problems, fmt.Sprintf("mailbox %s and audit_log %s, want %d each", plural.Of(mailbox, "row", "rows"), plural.Of(audit, "row", "rows"), in.invoices))
	}
	if accepted != in.webhooks || posts != in.webhooks+1 || acceptedRetried != 1 {
		problems = append(problems, fmt.Sprintf("webhook: %s, %s accepted, want %d and %d", plural.Of(posts, "POST", "POSTs"), plural.Of(accepted, "event", "events"), in.webhooks+1, in.webhooks))
	}
	if dupJobs != 4 || dupMailRows != 1 || dupSuppressed != 2 {
		problems = append(problems, "the duplicate deliveries were not suppressed")
	}
	if len(problems) > 0 {
		return fmt.Errorf("ledger mismatch: %s", strings.Join(problems, "; "))
	}
	fmt.Println("  ledger: every event handed off once, every effect applied once")
	return nil
}

func step(s string) { fmt.Println("==>", s) }

// processes are the demo's child processes; their output is prefixed.
type processes struct {
	mu    sync.Mutex
	procs []*proc
}

type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

func (ps *processes) start(name string, cmd *exec.Cmd, env []string) error {
	cmd.Env = env
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	var wg sync.WaitGroup
	wg.Add(2)
	go prefix(&wg, os.Stdout, stdout, "    ["+name+" group] ")
	go prefix(&wg, os.Stderr, stderr, "    ["+name+" group] ")
	go func() {
		wg.Wait()
		p.err = cmd.Wait()
		close(p.done)
	}()
	ps.mu.Lock()
	ps.procs = append(ps.procs, p)
	ps.mu.Unlock()
	return nil
}

func prefix(wg *sync.WaitGroup, w io.Writer, r io.Reader, pfx string) {
	defer wg.Done()
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	for sc.Scan() {
		fmt.Fprintln(w, pfx+sc.Text())
	}
}

// exited returns an error when a process ended early.
func (ps *processes) exited() error {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for _, p := range ps.procs {
		select {
		case <-p.done:
			return fmt.Errorf("the %s group exited early: %w", p.name, p.err)
		default:
		}
	}
	return nil
}

// stop sends SIGTERM to every process and waits for clean exits.
func (ps *processes) stop(d time.Duration) error {
	ps.mu.Lock()
	procs := append([]*proc(nil), ps.procs...)
	ps.mu.Unlock()
	for _, p := range procs {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	deadline := time.After(d)
	for _, p := range procs {
		select {
		case <-p.done:
			if p.err != nil {
				return fmt.Errorf("the %s group did not exit cleanly: %w", p.name, p.err)
			}
		case <-deadline:
			return fmt.Errorf("the %s group did not stop within %s of SIGTERM", p.name, d)
		}
	}
	return nil
}

// kill ends whatever still runs (after an error).
func (ps *processes) kill() {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for _, p := range ps.procs {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
}

// waitUntil polls cond every 20 ms until it holds, a process exits, ctx
// ends or d passes.
func waitUntil(ctx context.Context, d time.Duration, what string, ps *processes, cond func() (bool, error)) error {
	deadline := time.Now().Add(d)
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if err := ps.exited(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s waiting for %s", d, what)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// buildTools builds outboxd and outboxctl into a temporary directory.
func buildTools() (string, func(), error) {
	dir, err := os.MkdirTemp("", "outbox-demo")
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command("go", "build", "-o", dir+string(os.PathSeparator), "./cmd/outboxd", "./cmd/outboxctl")
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("build outboxd and outboxctl: %w", err)
	}
	return dir, func() { os.RemoveAll(dir) }, nil
}
