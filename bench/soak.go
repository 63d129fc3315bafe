package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	outboxriver "github.com/outboxhq/outbox/river"
)

// SoakResults is the soak scenario: an open-loop producer at one rate for a
// long time through a real outboxd, River workers in this process working
// every job, and a sample of latency, backlog, table sizes and vacuum
// activity every interval.
type SoakResults struct {
	Rate      int    `json:"rate"`
	Duration  string `json:"duration"`
	Interval  string `json:"interval"`
	Producers int    `json:"producers"`
	Workers   int    `json:"workers"`
	// Published and Worked count events over the whole run; NotWorked are
	// the jobs still not started when the run gave up waiting.
	Published int `json:"published"`
	Worked    int `json:"worked"`
	NotWorked int `json:"not_worked"`
	// NotSent counts events due before the end that the lagging producers
	// had not begun when it came.
	NotSent  int     `json:"not_sent"`
	Achieved float64 `json:"achieved_rate"`
	// Handoff and EndToEnd are over the whole run.
	Handoff  *Summary     `json:"handoff"`
	EndToEnd *Summary     `json:"end_to_end"`
	Samples  []SoakSample `json:"samples"`
	Indexes  []string     `json:"indexes"`
	Outboxd  string       `json:"outboxd"`
}

// SoakSample is one interval of the soak.
type SoakSample struct {
	// At is the end of the interval, seconds since the producers started.
	At float64 `json:"at_s"`
	// Final: the sample taken after the producers stopped and the workers
	// finished (or one more interval passed); its interval is short.
	Final bool `json:"final,omitempty"`
	// Published, Handed and Worked count the events committed, handed off
	// and started by a worker in the interval, per second.
	Published float64 `json:"published_per_s"`
	Handed    float64 `json:"handed_per_s"`
	Worked    float64 `json:"worked_per_s"`
	// HandoffP99 and EndToEndP50/P99 are over the events handed off,
	// respectively started, in the interval (ms; 0 when none).
	HandoffP99  float64 `json:"handoff_p99_ms"`
	EndToEndP50 float64 `json:"end_to_end_p50_ms"`
	EndToEndP99 float64 `json:"end_to_end_p99_ms"`
	// Pending events (due or not) and available River jobs at the end.
	Pending   int64 `json:"pending_events"`
	Available int64 `json:"available_jobs"`
	// Tables: outbox_event and river_job.
	Tables map[string]SoakTable `json:"tables"`
}

// SoakTable is one table's size and vacuum state at a sample.
type SoakTable struct {
	// TotalBytes is pg_total_relation_size (heap, TOAST, every index).
	TotalBytes int64 `json:"total_bytes"`
	// HeapBytes is pg_relation_size of the heap alone.
	HeapBytes int64 `json:"heap_bytes"`
	// IndexBytes is pg_relation_size of each index, by name.
	IndexBytes  map[string]int64 `json:"index_bytes"`
	LiveTuples  int64            `json:"n_live_tup"`
	DeadTuples  int64            `json:"n_dead_tup"`
	Autovacuum  int64            `json:"autovacuum_count"`
	Autoanalyze int64            `json:"autoanalyze_count"`
}

// soakTables are the tables a soak sample reads.
var soakTables = []string{"outbox_event", "river_job"}

// soakTableSQL reads one table's sizes and pg_stat_user_tables counters in
// the soak's schema ($1 schema, $2 table).
const soakTableSQL = `
SELECT pg_total_relation_size(c.oid), pg_relation_size(c.oid),
       coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0), coalesce(s.autovacuum_count, 0), coalesce(s.autoanalyze_count, 0),
       coalesce((SELECT json_object_agg(i.indexrelid::regclass::text, pg_relation_size(i.indexrelid))
                 FROM pg_index i WHERE i.indrelid = c.oid), '{}')
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = $1 AND c.relname = $2`

// soakClocks holds the per-event reads of a soak: commit times until the
// event was both handed off and worked, and the current interval's
// histograms.
type soakClocks struct {
	mu     sync.Mutex
	commit map[int64]time.Time
	// seen[0] and seen[1] are bitsets by event id (ids are dense): handed
	// off, worked. A read of an event already seen is not counted again.
	seen [2][]uint64
	// early holds reads that came before the producer recorded the
	// commit (a descheduled producer goroutine), applied when it does.
	early   map[int64][2]time.Time
	handH   *hdrhistogram.Histogram
	workH   *hdrhistogram.Histogram
	allHand *hdrhistogram.Histogram
	allWork *hdrhistogram.Histogram
	worked  atomic.Int64
	handed  int64
}

// The kinds of read, indexes of soakClocks.seen.
const (
	handedRead = 0
	workedRead = 1
)

func newSoakClocks() *soakClocks {
	return &soakClocks{
		commit: map[int64]time.Time{}, early: map[int64][2]time.Time{},
		handH: newHist(), workH: newHist(), allHand: newHist(), allWork: newHist(),
	}
}

func (c *soakClocks) has(kind int, id int64) bool {
	w := int(id / 64)
	return w < len(c.seen[kind]) && c.seen[kind][w]&(1<<(id%64)) != 0
}

func (c *soakClocks) set(kind int, id int64) {
	w := int(id / 64)
	for len(c.seen[kind]) <= w {
		c.seen[kind] = append(c.seen[kind], 0)
	}
	c.seen[kind][w] |= 1 << (id % 64)
}

// committed records id's commit time and applies the reads that came first.
func (c *soakClocks) committed(id int64, t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.commit[id] = t
	if e, ok := c.early[id]; ok {
		delete(c.early, id)
		for kind, at := range e {
			if !at.IsZero() {
				c.count(kind, id, at)
			}
		}
	}
}

// done records that id was handed off or worked (kind) at t; it reports
// whether this was the first such read of id.
func (c *soakClocks) done(kind int, id int64, t time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.has(kind, id) {
		return false
	}
	c.set(kind, id)
	if _, ok := c.commit[id]; !ok {
		e := c.early[id]
		e[kind] = t
		c.early[id] = e
		return true
	}
	c.count(kind, id, t)
	return true
}

// count records a read of a committed event; once it was both handed off
// and worked, the event is forgotten.
func (c *soakClocks) count(kind int, id int64, t time.Time) {
	d := t.Sub(c.commit[id])
	if kind == handedRead {
		record(c.handH, d)
		record(c.allHand, d)
		c.handed++
	} else {
		record(c.workH, d)
		record(c.allWork, d)
	}
	if c.has(handedRead, id) && c.has(workedRead, id) {
		delete(c.commit, id)
	}
}

// firstUnhanded is the lowest id committed and not yet seen handed off
// (the next handoff read starts there), or after+1 when there is none.
func (c *soakClocks) firstUnhanded(after int64) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	lo := after + 1
	for id := range c.commit {
		if !c.has(handedRead, id) && id < lo {
			lo = id
		}
	}
	return lo
}

// soakWorker records when a worker starts each job (the first run wins).
type soakWorker struct {
	river.WorkerDefaults[outboxriver.EventArgs]
	c *soakClocks
}

func (w *soakWorker) Work(_ context.Context, job *river.Job[outboxriver.EventArgs]) error {
	if w.c.done(workedRead, job.Args.EventID, time.Now()) {
		w.c.worked.Add(1)
	}
	return nil
}

// soakWorkers is the worker count of the soak's River client, as in the
// rates scenario.
const soakWorkers = 50

func runSoak(ctx context.Context, e *env, o *Options) (*SoakResults, error) {
	const schema = "soak"
	res := &SoakResults{Rate: o.SoakRate, Duration: o.SoakDuration.String(), Interval: o.SoakInterval.String(),
		Producers: rateProducers(o.SoakRate), Workers: soakWorkers}
	p, err := e.migrated(ctx, schema, int32(res.Producers+8))
	if err != nil {
		return nil, err
	}
	defer p.Close()
	defer func() {
		if _, err := e.admin.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS soak CASCADE"); err != nil {
			logf("soak: drop schema: %v", err)
		}
	}()

	c := newSoakClocks()
	wp, err := e.pool(ctx, schema, 12, appWorkers)
	if err != nil {
		return nil, err
	}
	defer wp.Close()
	workers := river.NewWorkers()
	river.AddWorker(workers, &soakWorker{c: c})
	cfg := outboxriver.WorkerConfig(workers, map[string]int{benchQueue: soakWorkers}, outboxriver.WorkerLatency{})
	cfg.Logger = e.quiet
	rc, err := river.NewClient(riverpgxv5.New(wp), cfg)
	if err != nil {
		return nil, err
	}
	if err := rc.Start(ctx); err != nil {
		return nil, err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = rc.Stop(sctx)
	}()

	bin, err := e.buildOutboxd(ctx)
	if err != nil {
		return nil, err
	}
	pr, err := startOutboxd(ctx, e, bin, schema, 0, 100, 0)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := pr.stop(); err != nil {
			logf("soak: outboxd: %v\n%s", err, pr.log())
		}
	}()
	if err := waitWakeLock(ctx, p, 30*time.Second); err != nil {
		return nil, fmt.Errorf("%w\n%s", err, pr.log())
	}
	res.Outboxd = "one outboxd (./cmd/outboxd) at its defaults (batch 100, concurrency 10, linger and River fetch settings as shipped), no workers of its own"

	// The handoff of each event is read from outbox_event.processed_at
	// (the database's clock, right after River's insert in the handoff
	// transaction), from the lowest id not yet seen handed off (a
	// primary-key range, so the read does not grow with the table).
	var maxRead int64
	readHandoffs := func() error {
		rows, err := p.Query(ctx, `SELECT id, processed_at FROM outbox_event WHERE id >= $1 AND processed_at IS NOT NULL`, c.firstUnhanded(maxRead))
		if err != nil {
			return err
		}
		type hand struct {
			id int64
			at time.Time
		}
		hs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (hand, error) {
			var h hand
			return h, r.Scan(&h.id, &h.at)
		})
		if err != nil {
			return err
		}
		for _, h := range hs {
			c.done(handedRead, h.id, h.at)
			maxRead = max(maxRead, h.id)
		}
		return nil
	}

	// Open-loop producer: event i is due at start + i/rate; a generator
	// hands due times to the producer goroutines.
	var (
		published atomic.Int64
		prodErr   atomic.Value
		wg        sync.WaitGroup
		due       = make(chan time.Time, 4096)
		lastMu    sync.Mutex
		last      time.Time
	)
	payload := json.RawMessage(`{"order_id":12345,"amount_cents":4200,"currency":"EUR","note":"bench"}`)
	// gctx ends the run: the generator stops and the producers send
	// nothing more.
	gctx, stopGen := context.WithCancel(ctx)
	var notSent atomic.Int64
	for range res.Producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range due {
				if gctx.Err() != nil {
					notSent.Add(1) // past the end of the run
					continue
				}
				id, err := produceOne(ctx, p, modeNotify, nil, payload, nil)
				now := time.Now()
				if err != nil {
					prodErr.Store(err)
					continue
				}
				c.committed(id, now)
				published.Add(1)
				lastMu.Lock()
				if now.After(last) {
					last = now
				}
				lastMu.Unlock()
			}
		}()
	}
	start := time.Now()
	genDone := make(chan struct{})
	go func() {
		defer close(genDone)
		defer close(due)
		interval := time.Second / time.Duration(o.SoakRate)
		total := int(float64(o.SoakRate) * o.SoakDuration.Seconds())
		for i := range total {
			at := start.Add(time.Duration(i) * interval)
			if wait := time.Until(at); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-gctx.Done():
					t.Stop()
					return
				case <-t.C:
				}
			}
			select {
			case due <- at:
			case <-gctx.Done():
				return
			}
		}
	}()
	defer func() {
		stopGen()
		<-genDone
		wg.Wait()
	}()

	tick := time.NewTicker(o.SoakInterval)
	defer tick.Stop()
	var prevPub, prevWorked, prevHanded int64
	prevAt := start
	sample := func(now time.Time, final bool) error {
		if err := readHandoffs(); err != nil {
			return fmt.Errorf("read handoffs: %w", err)
		}
		s := SoakSample{At: now.Sub(start).Seconds(), Final: final, Tables: map[string]SoakTable{}}
		secs := now.Sub(prevAt).Seconds()
		pub, worked := published.Load(), c.worked.Load()
		c.mu.Lock()
		handed := c.handed
		if v := c.handH.ValueAtQuantile(99); c.handH.TotalCount() > 0 {
			s.HandoffP99 = float64(v) / 1000
		}
		if c.workH.TotalCount() > 0 {
			s.EndToEndP50 = float64(c.workH.ValueAtQuantile(50)) / 1000
			s.EndToEndP99 = float64(c.workH.ValueAtQuantile(99)) / 1000
		}
		c.handH.Reset()
		c.workH.Reset()
		c.mu.Unlock()
		s.Published = float64(pub-prevPub) / secs
		s.Worked = float64(worked-prevWorked) / secs
		s.Handed = float64(handed-prevHanded) / secs
		prevPub, prevWorked, prevHanded, prevAt = pub, worked, handed, now
		if err := p.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_event WHERE status = 'pending'), (SELECT count(*) FROM river_job WHERE state = 'available')`).Scan(&s.Pending, &s.Available); err != nil {
			return fmt.Errorf("backlog: %w", err)
		}
		for _, t := range soakTables {
			tb, err := readSoakTable(ctx, e.admin, schema, t)
			if err != nil {
				return fmt.Errorf("%s: %w", t, err)
			}
			s.Tables[t] = tb
		}
		res.Samples = append(res.Samples, s)
		logf("soak %4.0fs: published %.0f/s, handed %.0f/s, worked %.0f/s; handoff p99 %.1f ms, end-to-end p99 %.1f ms; pending %d, available %d; dead tuples %d / %d",
			s.At, s.Published, s.Handed, s.Worked, s.HandoffP99, s.EndToEndP99, s.Pending, s.Available,
			s.Tables["outbox_event"].DeadTuples, s.Tables["river_job"].DeadTuples)
		return nil
	}
	end := start.Add(o.SoakDuration)
	for time.Now().Before(end) {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case now := <-tick.C:
			if err := sample(now, false); err != nil {
				return nil, err
			}
		}
	}
	// The producers stop at the end whatever they have not sent.
	stopGen()
	<-genDone
	wg.Wait()
	if err, _ := prodErr.Load().(error); err != nil {
		return nil, fmt.Errorf("producer: %w", err)
	}
	res.Published = int(published.Load())
	res.NotSent = int(notSent.Load())
	lastMu.Lock()
	res.Achieved = float64(res.Published) / max(last.Sub(start), o.SoakDuration).Seconds()
	lastMu.Unlock()
	// Let the workers finish the backlog (at most one interval more),
	// then take the last sample.
	deadline := time.Now().Add(o.SoakInterval)
	for c.worked.Load() < int64(res.Published) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if err := sample(time.Now(), true); err != nil {
		return nil, err
	}
	res.Worked = int(c.worked.Load())
	res.NotWorked = res.Published - res.Worked
	c.mu.Lock()
	res.Handoff, res.EndToEnd = summarize(c.allHand), summarize(c.allWork)
	c.mu.Unlock()
	for _, s := range []*Summary{res.Handoff, res.EndToEnd} {
		if s != nil {
			s.CDF = nil
		}
	}
	if len(res.Samples) > 0 {
		for _, t := range soakTables {
			for name := range res.Samples[len(res.Samples)-1].Tables[t].IndexBytes {
				res.Indexes = append(res.Indexes, name)
			}
		}
		sort.Strings(res.Indexes)
	}
	return res, nil
}

func readSoakTable(ctx context.Context, p *pgxpool.Pool, schema, table string) (SoakTable, error) {
	var (
		t   SoakTable
		idx []byte
	)
	err := p.QueryRow(ctx, soakTableSQL, schema, table).Scan(&t.TotalBytes, &t.HeapBytes, &t.LiveTuples, &t.DeadTuples, &t.Autovacuum, &t.Autoanalyze, &idx)
	if err != nil {
		return t, err
	}
	if err := json.Unmarshal(idx, &t.IndexBytes); err != nil {
		return t, err
	}
	// Index names without the schema, as the docs name them.
	for k, v := range t.IndexBytes {
		if short, ok := strings.CutPrefix(k, schema+"."); ok {
			delete(t.IndexBytes, k)
			t.IndexBytes[short] = v
		}
	}
	return t, nil
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

// soakMarkdown writes the soak's summary, its time series and the index
// sizes at the first, middle and last sample.
func soakMarkdown(b *strings.Builder, s *SoakResults) {
	fmt.Fprintf(b, "## Soak: %d events/s offered for %s, sampled every %s\n\n", s.Rate, s.Duration, s.Interval)
	fmt.Fprintf(b, "%s; %d producer goroutines (open loop); a River client in the bench process with %d workers works every job. "+
		"Published %d (%.0f ev/s achieved; %d due events not sent by the end), worked %d, not worked at the end %d.", s.Outboxd, s.Producers, s.Workers, s.Published, s.Achieved, s.NotSent, s.Worked, s.NotWorked)
	if s.Handoff != nil && s.EndToEnd != nil {
		fmt.Fprintf(b, " Whole run: handoff p50 / p99 / p99.9 %.2f / %.2f / %.2f ms, end to end %.2f / %.2f / %.2f ms.",
			s.Handoff.P50, s.Handoff.P99, s.Handoff.P999, s.EndToEnd.P50, s.EndToEnd.P99, s.EndToEnd.P999)
	}
	b.WriteString(" Handoff: the producer's commit to the event's processed_at (database clock, in the handoff transaction); end to end: to the worker's start.\n\n")
	b.WriteString("| t (s) | published /s | handed /s | worked /s | handoff p99 ms | e2e p50 / p99 ms | pending events | available jobs | outbox_event MiB (heap) | river_job MiB (heap) | dead tuples outbox / river | autovacuum outbox / river | autoanalyze outbox / river |\n")
	b.WriteString("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, x := range s.Samples {
		o, r := x.Tables["outbox_event"], x.Tables["river_job"]
		at := fmt.Sprintf("%.0f", x.At)
		if x.Final {
			at += " (end: producers stopped, backlog worked)"
		}
		fmt.Fprintf(b, "| %s | %.0f | %.0f | %.0f | %.2f | %.2f / %.2f | %d | %d | %.1f (%.1f) | %.1f (%.1f) | %d / %d | %d / %d | %d / %d |\n",
			at, x.Published, x.Handed, x.Worked, x.HandoffP99, x.EndToEndP50, x.EndToEndP99, x.Pending, x.Available,
			mib(o.TotalBytes), mib(o.HeapBytes), mib(r.TotalBytes), mib(r.HeapBytes), o.DeadTuples, r.DeadTuples,
			o.Autovacuum, r.Autovacuum, o.Autoanalyze, r.Autoanalyze)
	}
	if n := len(s.Samples); n > 0 {
		picks := []int{0, n / 2, n - 1}
		fmt.Fprintf(b, "\nIndex sizes (MiB, pg_relation_size) at t = %.0f, %.0f and %.0f s:\n\n| index | first | middle | last |\n|---|--:|--:|--:|\n",
			s.Samples[picks[0]].At, s.Samples[picks[1]].At, s.Samples[picks[2]].At)
		for _, t := range soakTables {
			for _, name := range s.Indexes {
				if _, ok := s.Samples[n-1].Tables[t].IndexBytes[name]; !ok {
					continue
				}
				cells := make([]string, len(picks))
				for i, k := range picks {
					cells[i] = fmt.Sprintf("%.2f", mib(s.Samples[k].Tables[t].IndexBytes[name]))
				}
				fmt.Fprintf(b, "| %s | %s |\n", name, strings.Join(cells, " | "))
			}
		}
	}
	b.WriteString("\n")
}
