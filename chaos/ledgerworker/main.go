// Command ledgerworker is the River worker process of the chaos suite's
// ordering scenarios (chaos/ordering_test.go); nothing else runs it.
//
// It is a plain River worker for the outbox's job kind that knows nothing
// about ordering: the guarantee must hold for any worker. Its client comes
// from outboxriver.QueuesConfig, as a service embedding the outbox would
// build it (so NewOrderedCompletionMiddleware is installed), with a short
// job timeout, a short stuck-job rescue and a short fixed retry delay, so
// that a job whose process was killed is retried within the test's time.
//
// Every run of a job appends a start record to LEDGER_FILE before the work
// and an end record after it, one JSON object per line, written with one
// write(2) each on an O_APPEND file: a record the process wrote survives
// its kill -9 and does not depend on the database being up. The chaos
// ledger (orderLedger) reads these files.
//
// Environment: DATABASE_URL, LEDGER_FILE, LEDGER_QUEUES (comma-separated),
// LEDGER_MAX_WORKERS (per queue), LEDGER_WORK_MS ("min-max": each run
// sleeps a random time in that range).
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	outboxriver "github.com/outboxhq/outbox/river"
)

// The rescue settings: a job runs for at most jobTimeout; one still
// running after rescueAfter (its process died) is retried by River's
// rescuer, which runs every 30 s on the leader (not configurable in River),
// after retryDelay.
const (
	jobTimeout  = 2 * time.Second
	rescueAfter = 5 * time.Second
	retryDelay  = 100 * time.Millisecond
)

// Record is one line of a ledger file. The chaos tests decode the same
// fields.
type Record struct {
	// Kind is "start" or "end".
	Kind    string `json:"kind"`
	JobID   int64  `json:"job_id"`
	Attempt int    `json:"attempt"`
	EventID int64  `json:"event_id"`
	Queue   string `json:"queue"`
	Tenant  string `json:"tenant"`
	Key     string `json:"key"`
	// Position is the job's outbox_ordering_position metadata.
	Position int64 `json:"position"`
	// At is the wall clock in Unix nanoseconds (every process of the test
	// runs on one host and reads the same clock).
	At int64 `json:"at"`
	// OK is set on an end record when the work returned nil.
	OK bool `json:"ok,omitempty"`
}

// ledger appends records to the file.
type ledger struct {
	mu sync.Mutex
	f  *os.File
}

func (l *ledger) write(r Record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	_, err = l.f.Write(append(b, '\n'))
	return err
}

// worker sleeps a random time between its start and end records.
type worker struct {
	river.WorkerDefaults[outboxriver.EventArgs]
	ledger   *ledger
	min, max time.Duration
}

// jobMeta is what the worker reads from a job's metadata.
type jobMeta struct {
	Tenant   string `json:"outbox_tenant_id"`
	Key      string `json:"outbox_ordering_key"`
	Position int64  `json:"outbox_ordering_position"`
}

// Work implements river.Worker.
func (w *worker) Work(ctx context.Context, job *river.Job[outboxriver.EventArgs]) error {
	var m jobMeta
	if err := json.Unmarshal(job.Metadata, &m); err != nil {
		return fmt.Errorf("job %d: metadata: %w", job.ID, err)
	}
	r := Record{Kind: "start", JobID: job.ID, Attempt: job.Attempt, EventID: job.Args.EventID, Queue: job.Queue,
		Tenant: m.Tenant, Key: m.Key, Position: m.Position, At: time.Now().UnixNano()}
	if err := w.ledger.write(r); err != nil {
		return fmt.Errorf("job %d: ledger start record: %w", job.ID, err)
	}
	d := w.min
	if w.max > w.min {
		d += rand.N(w.max - w.min)
	}
	var err error
	select {
	case <-time.After(d):
	case <-ctx.Done():
		err = ctx.Err()
	}
	r.Kind, r.At, r.OK = "end", time.Now().UnixNano(), err == nil
	if werr := w.ledger.write(r); werr != nil && err == nil {
		err = fmt.Errorf("job %d: ledger end record: %w", job.ID, werr)
	}
	return err
}

// fixedRetry retries every failed or rescued job after retryDelay.
type fixedRetry struct{}

func (fixedRetry) NextRetry(*rivertype.JobRow) time.Time { return time.Now().Add(retryDelay) }

// workRange parses "min-max" milliseconds.
func workRange(s string) (time.Duration, time.Duration, error) {
	lo, hi, ok := strings.Cut(s, "-")
	if !ok {
		hi = lo
	}
	a, err := strconv.Atoi(lo)
	if err != nil {
		return 0, 0, fmt.Errorf("LEDGER_WORK_MS=%q: must be min-max milliseconds: %w", s, err)
	}
	b, err := strconv.Atoi(hi)
	if err != nil || b < a || a < 0 {
		return 0, 0, fmt.Errorf("LEDGER_WORK_MS=%q: must be min-max milliseconds with 0 <= min <= max", s)
	}
	return time.Duration(a) * time.Millisecond, time.Duration(b) * time.Millisecond, nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "ledgerworker:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	lo, hi, err := workRange(os.Getenv("LEDGER_WORK_MS"))
	if err != nil {
		return err
	}
	maxWorkers, err := strconv.Atoi(os.Getenv("LEDGER_MAX_WORKERS"))
	if err != nil || maxWorkers < 1 {
		return fmt.Errorf("LEDGER_MAX_WORKERS=%q: must be a positive integer", os.Getenv("LEDGER_MAX_WORKERS"))
	}
	var queues []outboxriver.Queue
	for q := range strings.SplitSeq(os.Getenv("LEDGER_QUEUES"), ",") {
		if q != "" {
			queues = append(queues, outboxriver.Queue{Name: q, MaxWorkers: maxWorkers})
		}
	}
	if len(queues) == 0 {
		return fmt.Errorf("LEDGER_QUEUES must name at least one queue")
	}
	f, err := os.OpenFile(os.Getenv("LEDGER_FILE"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("LEDGER_FILE: %w", err)
	}
	defer func() { _ = f.Close() }()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	defer pool.Close()

	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	workers := river.NewWorkers()
	if err := river.AddWorkerSafely(workers, &worker{ledger: &ledger{f: f}, min: lo, max: hi}); err != nil {
		return err
	}
	cfg := outboxriver.QueuesConfig(workers, queues, outboxriver.WorkerLatency{})
	cfg.ID = outboxriver.GroupClientID("ledger")
	cfg.Logger = logger
	cfg.JobTimeout = jobTimeout
	cfg.RescueStuckJobsAfter = rescueAfter
	cfg.RetryPolicy = fixedRetry{}
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		return err
	}
	if err := client.Start(ctx); err != nil {
		return fmt.Errorf("start River client: %w", err)
	}
	fmt.Fprintln(os.Stderr, "ledgerworker started")
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return client.Stop(sctx)
}
