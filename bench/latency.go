package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/dispatcher"
	outboxriver "github.com/outboxhq/outbox/river"
)

// Latency modes.
const (
	modeNotify      = "notify"
	modePoll        = "poll"
	modeRiverDirect = "river-direct"
)

// LatencyResult is one mode of the latency scenario.
type LatencyResult struct {
	Mode     string `json:"mode"`
	Rate     int    `json:"rate"`
	Duration string `json:"duration"`
	// Events is the number of events measured: those due after the
	// warmup. Published counts the warmup's too.
	Events    int `json:"events"`
	Published int `json:"published"`
	// Warmup is how long the run was offered the rate before the events
	// it measures (loadSpec.warmup), and WarmupEvents how many it
	// published meanwhile; WarmupEndToEnd is their end to end time, kept
	// apart: a cold start (new sessions, first plans, cold caches), not
	// the steady state the percentiles above describe.
	Warmup         string        `json:"warmup,omitempty"`
	WarmupEvents   int           `json:"warmup_events,omitempty"`
	WarmupEndToEnd *Summary      `json:"warmup_end_to_end,omitempty"`
	Worked         int           `json:"worked"`
	Handoff        *Summary      `json:"handoff,omitempty"`
	EndToEnd       *Summary      `json:"end_to_end"`
	Commit         *Summary      `json:"producer_commit"`
	Clamped        int           `json:"clamped_negative"`
	Stats          *dispatchStat `json:"dispatcher,omitempty"`
	// Achieved is Published over the time the producers took, events/s.
	Achieved float64 `json:"achieved_rate"`
	// NotSent counts the events whose transaction had not begun by the
	// producers' cutoff (see loadSpec.cutoff): a producer that cannot
	// keep up sheds the rest instead of running on for minutes.
	NotSent int `json:"not_sent,omitempty"`
	// ProducerLag is how late the producers began transactions against
	// their open-loop schedule (a producer that cannot keep up lags).
	ProducerLag *Summary `json:"producer_lag,omitempty"`
	// DrainSeconds is the time from the last producer commit to the last
	// job's start (negative: not every job started within the limit).
	DrainSeconds float64 `json:"drain_seconds"`
	// Segments attribute the end-to-end time (see attribute).
	Segments []Segment `json:"segments,omitempty"`
	// Peer describes a peer job queue's run (its version and settings).
	Peer string `json:"peer,omitempty"`
	// Waits are the pg_stat_activity samples of each role's active
	// backends (producers, dispatcher, workers) while the events flowed.
	Waits map[string][]string `json:"pg_wait_events,omitempty"`
	// CPU is the CPU time per measured event, from the warmup's end
	// to the last job's start (rates scenario).
	CPU *CPUCost `json:"cpu,omitempty"`
	// GINCleanPages counts the pending-list pages of River's GIN indexes
	// that the outbox modes' cleaner merged (outboxriver.GINCleaner).
	GINCleanPages int64 `json:"gin_clean_pages,omitempty"`
}

type dispatchStat struct {
	Batches int64 `json:"batches"`
	Events  int64 `json:"events"`
	Wakes   int64 `json:"wakes"`
	Polls   int64 `json:"polls"`
	Errors  int64 `json:"errors"`
}

// clocks holds every event's clock reads, all taken in this process with
// time.Now (monotonic): right after the producer's Commit returned, right
// after the dispatcher's batch committed (OnBatch), and when the River
// worker's Work began. The first read of each kind wins.
//
// created and attempted are the River job's created_at (the database's
// clock at the start of the inserting transaction: the dispatcher's claim
// transaction, or the producer's own for river-direct) and attempted_at
// (the database's clock when River's fetch locked the job), read from the
// job the worker is given. They carry no monotonic reading: segments that
// mix them with this process's reads use the wall clock, which the server
// and this process share on this machine.
type clocks struct {
	mu                    sync.Mutex
	commit, handoff, work map[int64]time.Time
	created, attempted    map[int64]time.Time
	worked                atomic.Int64
	lastWork              time.Time
}

func newClocks() *clocks {
	return &clocks{
		commit: map[int64]time.Time{}, handoff: map[int64]time.Time{}, work: map[int64]time.Time{},
		created: map[int64]time.Time{}, attempted: map[int64]time.Time{},
	}
}

func (c *clocks) mark(m map[int64]time.Time, t time.Time, ids ...int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, id := range ids {
		if _, ok := m[id]; !ok {
			m[id] = t
		}
	}
}

// benchWorker marks when River starts working an outbox job.
type benchWorker struct {
	river.WorkerDefaults[outboxriver.EventArgs]
	c *clocks
}

func (w *benchWorker) Work(_ context.Context, job *river.Job[outboxriver.EventArgs]) error {
	now := time.Now()
	c, id := w.c, job.Args.EventID
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.work[id]; ok {
		return nil
	}
	c.work[id] = now
	c.lastWork = now
	c.created[id] = job.CreatedAt
	if job.AttemptedAt != nil {
		c.attempted[id] = *job.AttemptedAt
	}
	c.worked.Add(1)
	return nil
}

func runLatency(ctx context.Context, e *env, o *Options) ([]LatencyResult, error) {
	var out []LatencyResult
	for _, mode := range []string{modeNotify, modePoll, modeRiverDirect, modeFloor} {
		logf("latency %s: %d ev/s for %s", mode, o.Rate, o.Duration)
		schema := map[string]string{modeNotify: "lat_notify", modePoll: "lat_poll", modeRiverDirect: "lat_river", modeFloor: "lat_floor"}[mode]
		r, err := latencyMode(ctx, e, loadSpec{
			mode: mode, rate: o.Rate, duration: o.Duration, schema: schema,
			producers: 8, drainLimit: 30 * time.Second, warmup: o.Warmup,
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", mode, err)
		}
		logf("latency %s: %s", mode, r.line())
		out = append(out, r)
	}
	return out, nil
}

// loadSpec is one open-loop run of one mode.
type loadSpec struct {
	mode     string
	rate     int
	duration time.Duration
	schema   string // created and migrated for this run
	// producers is how many goroutines run the producer transactions.
	producers int
	// drainLimit is how long to wait, after the last commit, for the
	// workers to start every job.
	drainLimit time.Duration
	// tolerateBacklog: jobs not started within drainLimit are a result
	// (DrainSeconds < 0), not an error.
	tolerateBacklog bool
	// cutoff, when positive: events whose transaction has not begun this
	// long after the start are not sent (counted in NotSent).
	cutoff time.Duration
	// warmup: the rate is offered this long before the events measured
	// (their due times start after it); the warmup's events are handed
	// off and worked like the others but kept out of every percentile,
	// the attribution and the CPU per event. Every mode of a scenario
	// gets the same.
	warmup time.Duration
	// sample: run the dispatcher on its own pool and sample the
	// producers', dispatcher's and workers' backends in pg_stat_activity
	// while the events flow (LatencyResult.Waits).
	sample bool
}

// Application names of the latency runs' pools (sampled by role).
const (
	appWorkers    = "bench-workers"
	appDispatcher = "bench-dispatcher"
)

// producerCutoff is when an open-loop run of d stops sending events that
// are late: d plus half of it, at least 2 s more.
func producerCutoff(d time.Duration) time.Duration { return d + max(2*time.Second, d/2) }

func (r LatencyResult) line() string {
	s := ""
	if r.Handoff != nil {
		s += fmt.Sprintf("handoff p50 %.2f ms p99 %.2f ms; ", r.Handoff.P50, r.Handoff.P99)
	}
	if r.EndToEnd != nil {
		s += fmt.Sprintf("end-to-end p50 %.2f ms p99 %.2f ms", r.EndToEnd.P50, r.EndToEnd.P99)
	}
	return s
}

// workerClient starts a River client working benchQueue with w, configured
// as the outbox recommends (outboxriver.WorkerConfig: 1 ms FetchCooldown).
func workerClient(ctx context.Context, e *env, p *pgxpool.Pool, c *clocks) (*river.Client[pgx.Tx], error) {
	workers := river.NewWorkers()
	river.AddWorker(workers, &benchWorker{c: c})
	cfg := outboxriver.WorkerConfig(workers, map[string]int{benchQueue: 50}, outboxriver.WorkerLatency{})
	cfg.Logger = e.quiet
	rc, err := river.NewClient(riverpgxv5.New(p), cfg)
	if err != nil {
		return nil, err
	}
	if err := rc.Start(ctx); err != nil {
		return nil, err
	}
	return rc, nil
}

func latencyMode(ctx context.Context, e *env, spec loadSpec) (_ LatencyResult, retErr error) {
	mode, schema := spec.mode, spec.schema
	res := LatencyResult{Mode: mode, Rate: spec.rate, Duration: spec.duration.String()}
	p, err := e.migrated(ctx, schema, int32(max(24, spec.producers+8)))
	if err != nil {
		return res, err
	}
	defer p.Close()
	wp, err := e.pool(ctx, schema, 12, appWorkers)
	if err != nil {
		return res, err
	}
	defer wp.Close()

	c := newClocks()
	rc, err := workerClient(ctx, e, wp, c)
	if err != nil {
		return res, fmt.Errorf("start the River workers: %w", err)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = rc.Stop(sctx)
	}()

	var (
		d        *dispatcher.Dispatcher
		gc       *outboxriver.GINCleaner
		insertRC *river.Client[pgx.Tx]
	)
	switch mode {
	case modeNotify, modePoll:
		dp := p
		if spec.sample {
			if dp, err = e.pool(ctx, schema, 12, appDispatcher); err != nil {
				return res, err
			}
			defer dp.Close()
		}
		d, err = dispatcher.New(dp, dispatcher.Config{
			Routes:         e.routes,
			ListenDisabled: mode == modePoll,
			PollInterval:   time.Second,
			Logger:         e.quiet,
			OnBatch: func(r claim.Result) {
				now := time.Now()
				ids := make([]int64, len(r.Handed))
				for i, h := range r.Handed {
					ids[i] = h.ID
				}
				c.mark(c.handoff, now, ids...)
			},
		})
		if err != nil {
			return res, err
		}
		if err := d.Start(ctx); err != nil {
			return res, err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			_ = d.Stop(sctx)
		}()
		if mode == modeNotify {
			if err := waitWakeLock(ctx, p, 10*time.Second); err != nil {
				return res, err
			}
		}
		// outboxd merges River's GIN pending lists beside its dispatcher
		// (OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS); River-direct and the floor
		// run River as it comes, without.
		if gc, err = outboxriver.NewGINCleaner(p, outboxriver.GINCleanerConfig{}); err != nil {
			return res, err
		}
		if err := gc.Start(ctx); err != nil {
			return res, err
		}
		defer func() { _ = gc.Stop(context.WithoutCancel(ctx)) }()
	case modeRiverDirect:
		insertRC, err = outboxriver.NewInsertClient(p, outboxriver.InsertClientConfig{})
		if err != nil {
			return res, err
		}
	case modeFloor:
		relay, err := startFloorRelay(ctx, p, c)
		if err != nil {
			return res, err
		}
		defer func() {
			if err := relay.stop(); err != nil {
				retErr = err // what stopped the jobs, rather than their absence
			}
		}()
	}
	// Let the worker client's listener and producers settle.
	time.Sleep(300 * time.Millisecond)

	// Open-loop producer: event i is due at start + i/rate, whatever the
	// previous commits took; a few goroutines run the transactions.
	total := int(float64(spec.rate) * spec.duration.Seconds())
	res.Events = total
	warmN := int(float64(spec.rate) * spec.warmup.Seconds())
	if warmN > 0 {
		res.Warmup = spec.warmup.String()
	}
	due := make(chan time.Time, warmN+total)
	var (
		wg         sync.WaitGroup
		seq        atomic.Int64
		published  atomic.Int64
		prodErr    atomic.Value
		commitH    = newHist()
		lagH       = newHist()
		commitMu   sync.Mutex
		lastCommit time.Time
		notSent    atomic.Int64
		// warm holds the ids of the events due within the warmup.
		warm = map[int64]bool{}
	)
	payload := json.RawMessage(`{"order_id":12345,"amount_cents":4200,"currency":"EUR","note":"bench"}`)
	var sampler *roleSampler
	if spec.sample {
		sampler = startRoleSampler(ctx, e.admin, 20*time.Millisecond, map[string]string{
			"bench-" + schema: "producers", appDispatcher: "dispatcher", appWorkers: "workers",
		})
		defer func() {
			if sampler != nil {
				sampler.stop()
			}
		}()
	}
	var (
		meter *cpuMeter
		cpu0  cpuReading
	)
	if spec.sample {
		// Read first when the warmup ends (the loop below).
		meter = newCPUMeter(ctx, e.admin)
	}
	// Event i is due at start + i/rate, whatever the previous commits
	// took (open loop).
	interval := time.Second / time.Duration(spec.rate)
	start := time.Now()
	// measured is when the events measured are due from: the warmup's end.
	measured := start.Add(time.Duration(warmN) * interval)
	for range max(1, spec.producers) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for at := range due {
				begin := time.Now()
				if spec.cutoff > 0 && begin.Sub(measured) > spec.cutoff {
					notSent.Add(1)
					continue
				}
				id, err := produceOne(ctx, p, mode, insertRC, payload, &seq)
				now := time.Now()
				if err != nil {
					prodErr.Store(err)
					continue
				}
				c.mark(c.commit, now, id)
				published.Add(1)
				commitMu.Lock()
				if at.Before(measured) {
					warm[id] = true
				} else {
					record(commitH, now.Sub(begin))
					record(lagH, begin.Sub(at))
				}
				if now.After(lastCommit) {
					lastCommit = now
				}
				commitMu.Unlock()
			}
		}()
	}
	for i := range warmN + total {
		if i == warmN && meter != nil {
			cpu0 = meter.read()
		}
		at := start.Add(time.Duration(i) * interval)
		if wait := time.Until(at); wait > 0 {
			select {
			case <-ctx.Done():
				close(due)
				wg.Wait()
				return res, ctx.Err()
			case <-time.After(wait):
			}
		}
		due <- at
	}
	close(due)
	wg.Wait()
	if err, _ := prodErr.Load().(error); err != nil {
		return res, fmt.Errorf("producer: %w", err)
	}
	res.Published = int(published.Load())
	res.NotSent = int(notSent.Load())
	if res.Published == 0 {
		return res, fmt.Errorf("no event was published")
	}
	res.Achieved = float64(res.Published) / max(lastCommit.Sub(start), spec.warmup+spec.duration).Seconds()
	res.WarmupEvents = len(warm)

	// Wait for the workers to start every job (poll mode needs up to a
	// poll interval more).
	deadline := lastCommit.Add(spec.drainLimit)
	for c.worked.Load() < int64(res.Published) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	res.Worked = int(c.worked.Load())
	if meter != nil {
		res.CPU = meter.cost(cpu0, meter.read(), res.Published-res.WarmupEvents)
	}
	if sampler != nil {
		res.Waits = sampler.stop()
		sampler = nil
	}
	res.DrainSeconds = -1
	if res.Worked < res.Published {
		if !spec.tolerateBacklog {
			return res, fmt.Errorf("only %d of %d jobs were worked within %s", res.Worked, res.Published, spec.drainLimit)
		}
	} else {
		c.mu.Lock()
		res.DrainSeconds = max(0, c.lastWork.Sub(lastCommit).Seconds())
		c.mu.Unlock()
	}
	if gc != nil {
		_, res.GINCleanPages = gc.Stats()
	}
	if d != nil {
		s := d.Stats()
		res.Stats = &dispatchStat{Batches: s.Batches, Events: s.Events, Wakes: s.Wakes, Polls: s.Polls, Errors: s.Errors}
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	hh, eh, wh := newHist(), newHist(), newHist()
	for id := range warm {
		if tw, ok := c.work[id]; ok {
			record(wh, tw.Sub(c.commit[id]))
		}
		// Out of the percentiles below and of the attribution.
		delete(c.commit, id)
	}
	if res.WarmupEndToEnd = summarize(wh); res.WarmupEndToEnd != nil {
		res.WarmupEndToEnd.CDF = nil
	}
	for id, tc := range c.commit {
		if th, ok := c.handoff[id]; ok {
			if th.Before(tc) {
				res.Clamped++
			}
			record(hh, th.Sub(tc))
		}
		if tw, ok := c.work[id]; ok {
			if tw.Before(tc) {
				res.Clamped++
			}
			record(eh, tw.Sub(tc))
		}
	}
	res.Handoff = summarize(hh)
	res.EndToEnd = summarize(eh)
	res.Commit = summarize(commitH)
	if res.Commit != nil {
		res.Commit.CDF = nil
	}
	if res.ProducerLag = summarize(lagH); res.ProducerLag != nil {
		res.ProducerLag.CDF = nil
	}
	res.Segments = attribute(c, mode != modeRiverDirect)
	return res, nil
}

// produceOne runs one producer transaction and returns the id that the
// worker will see as EventArgs.EventID.
func produceOne(ctx context.Context, p *pgxpool.Pool, mode string, insertRC *river.Client[pgx.Tx], payload json.RawMessage, seq *atomic.Int64) (int64, error) {
	tx, err := p.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var id int64
	if mode == modeRiverDirect {
		id = seq.Add(1)
		_, err = insertRC.InsertTx(ctx, tx, outboxriver.EventArgs{
			EventID: id, EventType: eventType, Payload: payload, CreatedAt: time.Now(),
		}, &river.InsertOpts{Queue: benchQueue})
	} else {
		var pub outbox.Published
		pub, err = outbox.Publish(ctx, tx, outbox.Event{Type: eventType, Payload: payload})
		id = pub.ID
	}
	if err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, err
	}
	return id, nil
}
