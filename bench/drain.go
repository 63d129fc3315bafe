package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox"
	outboxriver "github.com/outboxhq/outbox/river"
)

// dispatchConcurrency is OUTBOX_DISPATCH_CONCURRENCY's default; the raw
// River inserts use as many goroutines.
const dispatchConcurrency = 10

// DrainResults is the drain scenario plus the resources of its dispatchers.
type DrainResults struct {
	N    int           `json:"n"`
	Raw  []RawResult   `json:"raw_river"`
	Runs []DrainResult `json:"runs"`
}

// RawResult is River's InsertManyTx alone: N jobs in transactions of Batch
// jobs, Concurrency at a time, through the same insert-only client the
// dispatcher uses.
type RawResult struct {
	Batch       int     `json:"batch"`
	Concurrency int     `json:"concurrency"`
	Jobs        int     `json:"jobs"`
	Seconds     float64 `json:"seconds"`
	PerSecond   float64 `json:"jobs_per_second"`
}

// DrainResult is one backlog of N events drained by Dispatchers outboxd
// processes with OUTBOX_DISPATCH_BATCH_SIZE=Batch.
type DrainResult struct {
	Dispatchers int     `json:"dispatchers"`
	Batch       int     `json:"batch"`
	Concurrency int     `json:"concurrency,omitempty"`
	Events      int     `json:"events"`
	Seconds     float64 `json:"seconds_to_last_handoff"`
	PerSecond   float64 `json:"events_per_second"`
	RawRatio    float64 `json:"ratio_to_raw_river"`
	// Per process: peak RSS (VmHWM) and CPU seconds (user+system) spent
	// while draining.
	PeakRSSMiB []float64 `json:"peak_rss_mib"`
	CPUSeconds []float64 `json:"cpu_seconds"`
	CPUPer100k float64   `json:"cpu_seconds_per_100k_events"`
	MaxRSSMiB  float64   `json:"max_peak_rss_mib"`
	RiverJobs  int       `json:"river_jobs"`
	// WaitEvents are the dispatchers' backends' samples in
	// pg_stat_activity while draining.
	WaitEvents   []string `json:"pg_wait_events"`
	DoneEvents   int      `json:"done_events"`
	DBCPUSeconds float64  `json:"-"`
}

func runDrain(ctx context.Context, e *env, o *Options) (*DrainResults, error) {
	res := &DrainResults{N: o.N}
	bin, err := e.buildOutboxd(ctx)
	if err != nil {
		return nil, err
	}
	raw := map[int]float64{}
	for _, b := range o.Batches {
		r, err := rawRiver(ctx, e, o.N, b)
		if err != nil {
			return nil, fmt.Errorf("raw River InsertMany (batch %d): %w", b, err)
		}
		logf("raw River InsertManyTx, %d jobs in batches of %d × %d goroutines: %.0f jobs/s", r.Jobs, b, r.Concurrency, r.PerSecond)
		raw[b] = r.PerSecond
		res.Raw = append(res.Raw, r)
	}
	for _, b := range o.Batches {
		for _, k := range o.Dispatchers {
			r, err := drainOnce(ctx, e, bin, o.N, k, b, o.Concurrency)
			if err != nil {
				return nil, fmt.Errorf("drain with %d dispatcher(s), batch %d: %w", k, b, err)
			}
			r.RawRatio = r.PerSecond / raw[b]
			logf("drain %d × batch %d: %d events in %.2f s = %.0f ev/s (%.2f× raw River); peak RSS %.1f MiB; %.2f CPU s per 100k",
				k, b, r.Events, r.Seconds, r.PerSecond, r.RawRatio, r.MaxRSSMiB, r.CPUPer100k)
			res.Runs = append(res.Runs, r)
		}
	}
	// Scaling: with one batch in flight per dispatcher the dispatcher, not
	// the database, is the bottleneck, which shows what more dispatchers
	// add; at the default concurrency one dispatcher already saturates a
	// small server (docs/benchmarks-record.md, "Drain: the database's two
	// cores are the limit").
	if c := o.ScalingConcurrency; c > 0 && c != o.Concurrency && len(o.Batches) > 0 {
		b := o.Batches[0]
		for _, k := range o.Dispatchers {
			r, err := drainOnce(ctx, e, bin, o.N, k, b, c)
			if err != nil {
				return nil, fmt.Errorf("scaling drain with %d dispatcher(s), concurrency %d: %w", k, c, err)
			}
			r.RawRatio = r.PerSecond / raw[b]
			logf("drain %d × batch %d, concurrency %d: %.0f ev/s (%.2f× raw River)", k, b, c, r.PerSecond, r.RawRatio)
			res.Runs = append(res.Runs, r)
		}
	}
	return res, nil
}

func benchArgs(id int64) outboxriver.EventArgs {
	return outboxriver.EventArgs{
		EventID: id, EventType: eventType,
		Payload:   json.RawMessage(`{"order_id":12345,"amount_cents":4200,"currency":"EUR","note":"bench"}`),
		CreatedAt: time.Now(),
	}
}

func rawRiver(ctx context.Context, e *env, n, batch int) (RawResult, error) {
	r := RawResult{Batch: batch, Concurrency: dispatchConcurrency, Jobs: n}
	p, err := e.migrated(ctx, fmt.Sprintf("raw_b%d", batch), dispatchConcurrency+2)
	if err != nil {
		return r, err
	}
	defer p.Close()
	rc, err := outboxriver.NewInsertClient(p, outboxriver.InsertClientConfig{})
	if err != nil {
		return r, err
	}
	chunks := make(chan int, n/batch+1)
	for i := 0; i < n; i += batch {
		chunks <- min(batch, n-i)
	}
	close(chunks)
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	start := time.Now()
	for range dispatchConcurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for size := range chunks {
				params := make([]river.InsertManyParams, size)
				for i := range params {
					params[i] = river.InsertManyParams{Args: benchArgs(int64(i)), InsertOpts: &river.InsertOpts{Queue: benchQueue}}
				}
				err := pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
					_, err := rc.InsertManyTx(ctx, tx, params)
					return err
				})
				if err != nil {
					once.Do(func() { first = err })
					return
				}
			}
		}()
	}
	wg.Wait()
	if first != nil {
		return r, first
	}
	r.Seconds = time.Since(start).Seconds()
	r.PerSecond = float64(n) / r.Seconds
	return r, nil
}

// proc is one outboxd subprocess.
type proc struct {
	cmd    *exec.Cmd
	stderr *os.File
}

func startOutboxd(ctx context.Context, e *env, bin, schema string, i, batch, concurrency int) (*proc, error) {
	logPath := filepath.Join(e.tmp, fmt.Sprintf("outboxd-%s-%d.log", schema, i))
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = append(os.Environ(),
		"DATABASE_URL="+e.schemaURL(schema, fmt.Sprintf("bench-outboxd-%d", i)),
		"OUTBOX_DISPATCHER_ENABLED=true",
		"OUTBOX_ROUTES_FILE="+filepath.Join(e.tmp, "routes.yaml"),
		"OUTBOX_DISPATCH_BATCH_SIZE="+strconv.Itoa(batch),
		"OUTBOX_LOG_LEVEL=warn",
	)
	if concurrency > 0 {
		cmd.Env = append(cmd.Env, "OUTBOX_DISPATCH_CONCURRENCY="+strconv.Itoa(concurrency))
	}
	cmd.Stdout = f
	cmd.Stderr = f
	if err := cmd.Start(); err != nil {
		_ = f.Close()
		return nil, err
	}
	return &proc{cmd: cmd, stderr: f}, nil
}

func (p *proc) stop() error {
	defer func() { _ = p.stderr.Close() }()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- p.cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done //nolint:errcheck // the process was killed; its exit error says nothing new
		return fmt.Errorf("outboxd %d did not exit within 30 s of SIGTERM", p.cmd.Process.Pid)
	}
}

func (p *proc) log() string {
	b, _ := os.ReadFile(p.stderr.Name())
	return strings.TrimSpace(string(b))
}

func drainOnce(ctx context.Context, e *env, bin string, n, k, batch, concurrency int) (DrainResult, error) {
	r := DrainResult{Dispatchers: k, Batch: batch, Events: n, Concurrency: concurrency}
	schema := fmt.Sprintf("drain_%dx%d_c%d", k, batch, concurrency)
	p, err := e.migrated(ctx, schema, 4)
	if err != nil {
		return r, err
	}
	defer p.Close()

	var procs []*proc
	defer func() {
		for _, pr := range procs {
			if err := pr.stop(); err != nil {
				logf("outboxd: %v\n%s", err, pr.log())
			}
		}
	}()
	for i := range k {
		pr, err := startOutboxd(ctx, e, bin, schema, i, batch, concurrency)
		if err != nil {
			return r, err
		}
		procs = append(procs, pr)
	}
	// Ready: one holds the wake lock and all k are LISTENing.
	if err := waitWakeLock(ctx, p, 30*time.Second); err != nil {
		return r, fmt.Errorf("%w\n%s", err, procs[0].log())
	}
	if err := waitListeners(ctx, p, k); err != nil {
		return r, err
	}
	time.Sleep(500 * time.Millisecond) // the others give up on the wake lock (250 ms) and sleep

	// The backlog is written in one transaction and committed at once, so
	// that every dispatcher starts from an idle, listening state and the
	// clock starts at the commit.
	tx, err := p.Begin(ctx)
	if err != nil {
		return r, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := publishBacklog(ctx, tx, n); err != nil {
		return r, err
	}
	cpu0 := make([]float64, k)
	for i, pr := range procs {
		cpu0[i], _ = procCPUSeconds(pr.cmd.Process.Pid)
	}
	if err := tx.Commit(ctx); err != nil {
		return r, err
	}
	start := time.Now()
	sampler := startSampler(ctx, e.admin, "bench-outboxd-%")
	deadline := start.Add(10 * time.Minute)
	for {
		var pending bool
		if err := p.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM outbox_event WHERE status = 'pending')`).Scan(&pending); err != nil {
			return r, err
		}
		if !pending {
			break
		}
		if time.Now().After(deadline) {
			return r, fmt.Errorf("backlog not drained within 10 minutes\n%s", procs[0].log())
		}
		time.Sleep(5 * time.Millisecond)
	}
	r.Seconds = time.Since(start).Seconds()
	r.PerSecond = float64(n) / r.Seconds
	r.WaitEvents = sampler.stop()
	var cpuSum float64
	for i, pr := range procs {
		pid := pr.cmd.Process.Pid
		rss, err := procPeakRSSMiB(pid)
		if err != nil {
			return r, err
		}
		cpu, err := procCPUSeconds(pid)
		if err != nil {
			return r, err
		}
		r.PeakRSSMiB = append(r.PeakRSSMiB, rss)
		r.CPUSeconds = append(r.CPUSeconds, cpu-cpu0[i])
		r.MaxRSSMiB = max(r.MaxRSSMiB, rss)
		cpuSum += cpu - cpu0[i]
	}
	r.CPUPer100k = cpuSum * 100_000 / float64(n)
	if err := p.QueryRow(ctx, `SELECT (SELECT count(*) FROM river_job), (SELECT count(*) FROM outbox_event WHERE status = 'done')`).Scan(&r.RiverJobs, &r.DoneEvents); err != nil {
		return r, err
	}
	if r.RiverJobs != n || r.DoneEvents != n {
		return r, fmt.Errorf("after the drain: %d River jobs and %d done events, want %d of each", r.RiverJobs, r.DoneEvents, n)
	}
	return r, nil
}

// publishBacklog writes n events in tx with PublishMany, 10,000 at a time.
func publishBacklog(ctx context.Context, tx pgx.Tx, n int) error {
	payload := json.RawMessage(`{"order_id":12345,"amount_cents":4200,"currency":"EUR","note":"bench"}`)
	for i := 0; i < n; i += outbox.MaxPublishMany {
		events := make([]outbox.Event, min(outbox.MaxPublishMany, n-i))
		for j := range events {
			events[j] = outbox.Event{Type: eventType, Payload: payload}
		}
		if _, err := outbox.PublishMany(ctx, tx, events); err != nil {
			return err
		}
	}
	return nil
}

// loadBacklog commits n events in transactions of up to 10,000.
func loadBacklog(ctx context.Context, p *pgxpool.Pool, n int) error {
	for i := 0; i < n; i += outbox.MaxPublishMany {
		err := pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
			return publishBacklog(ctx, tx, min(outbox.MaxPublishMany, n-i))
		})
		if err != nil {
			return err
		}
	}
	return nil
}

func waitListeners(ctx context.Context, p *pgxpool.Pool, k int) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		err := p.QueryRow(ctx, `SELECT count(DISTINCT application_name) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name LIKE 'bench-outboxd-%'
			  AND query ILIKE 'listen %' AND state = 'idle'`).Scan(&n)
		if err != nil {
			return err
		}
		if n >= k {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d outboxd listeners connected within 30 s", n, k)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// procPeakRSSMiB reads VmHWM (peak resident set) of a process.
func procPeakRSSMiB(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			f := strings.Fields(v) // "12345 kB"
			kb, err := strconv.ParseFloat(f[0], 64)
			if err != nil {
				return 0, err
			}
			return kb / 1024, nil
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%d/status", pid)
}

// procCPUSeconds reads utime+stime of a process from /proc/PID/stat.
func procCPUSeconds(pid int) (float64, error) {
	f, err := procStatFields(pid)
	if err != nil {
		return 0, err
	}
	return ticks(f[11]) + ticks(f[12]), nil
}

// clockTicks is sysconf(_SC_CLK_TCK), 100 on Linux.
const clockTicks = 100
