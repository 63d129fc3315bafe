// Package metrics exposes the outbox's Prometheus metrics
// (github.com/prometheus/client_golang).
//
// Counters come from the dispatcher's batches (dispatcher.Config.OnBatch =
// Metrics.OnBatch) and from its alerts (wrap the alerter with
// Metrics.Alerter); gauges of the table (pending, due, oldest due age,
// failed) are read from the database at scrape time with one bounded query
// through the partial indexes (ReadBacklog), and those of per-key ordering
// (parked keys, waiting jobs, oldest wait, held keys) with another
// (ReadOrdering); the listener's and the loop's state come from the
// dispatcher (SetDispatcher).
//
// Handoff latency is measured at the end of each batch as now minus the
// event's created_at: created_at is stamped by the database when the
// producer's INSERT runs, a little before its commit, so the histogram
// slightly over-states commit-to-handoff (by the producer's time between
// insert and commit) and includes any clock skew between this host and the
// database. Events retried after a failure carry their backoff in it too.
//
// Routes are labelled by the matching rule's prefix ("mail."), so the
// label's cardinality is the number of rules; unroutable events have
// route="none".
package metrics

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/route"
)

// Config configures New.
type Config struct {
	// Pool reads the table gauges at scrape time; nil leaves them out.
	Pool *pgxpool.Pool
	// Routes label failed events (alerts carry only the type) by rule
	// prefix; nil labels them "unknown". Dispatched events carry the rule
	// that routed them (claim.Handed.Route), so they are not routed again.
	Routes *route.Table
	// QueryTimeout bounds the scrape-time queries (both together). 0 means
	// 2 s.
	QueryTimeout time.Duration
}

// Metrics holds the collectors. Create it with New and Register it.
type Metrics struct {
	cfg Config
	d   atomic.Pointer[dispatcher.Dispatcher]

	dispatched *prometheus.CounterVec
	failed     *prometheus.CounterVec
	jobs       prometheus.Counter
	retried    prometheus.Counter
	batches    prometheus.Counter
	batchSize  prometheus.Histogram
	latency    prometheus.Histogram
	retention  prometheus.Counter
	ginPages   prometheus.Counter
	ginSeconds prometheus.Counter
	db         *dbCollector
}

// New builds the collectors.
func New(cfg Config) *Metrics {
	if cfg.QueryTimeout == 0 {
		cfg.QueryTimeout = 2 * time.Second
	}
	m := &Metrics{cfg: cfg}
	m.dispatched = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_events_dispatched_total",
		Help: "Events handed to River (marked done), by route prefix.",
	}, []string{"route"})
	m.failed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_events_failed_total",
		Help: "Events moved to failed, by route prefix and reason (unroutable, dead_letter).",
	}, []string{"route", "reason"})
	m.jobs = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_jobs_inserted_total",
		Help: "River jobs inserted by the dispatcher (one per event and target queue).",
	})
	m.retried = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_events_retried_total",
		Help: "Failed dispatch attempts rescheduled with backoff.",
	})
	m.batches = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_batches_total",
		Help: "Batches that claimed at least one event.",
	})
	m.batchSize = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "outbox_batch_size",
		Help:    "Events claimed per batch.",
		Buckets: []float64{1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000},
	})
	m.latency = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "outbox_handoff_latency_seconds",
		Help:    "Commit-to-handoff latency: batch end minus the event's created_at (database clock at insert).",
		Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 1800},
	})
	m.retention = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_retention_deleted_total",
		Help: "Done events deleted by the retention job run in this process.",
	})
	m.ginPages = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_river_gin_clean_pages_total",
		Help: "Pending-list pages of River's GIN indexes merged by this process's cleaner (OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS).",
	})
	m.ginSeconds = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_river_gin_clean_seconds_total",
		Help: "Time this process's cleaner spent merging River's GIN pending lists.",
	})
	m.db = &dbCollector{m: m}
	return m
}

// SetDispatcher makes the listener/loop gauges and the dispatcher's
// counters available (the dispatcher is built after Metrics, because its
// Config takes OnBatch).
func (m *Metrics) SetDispatcher(d *dispatcher.Dispatcher) { m.d.Store(d) }

// Register registers every collector.
func (m *Metrics) Register(reg prometheus.Registerer) error {
	gauge := func(name, help string, f func(*dispatcher.Dispatcher) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 {
			if d := m.d.Load(); d != nil {
				return f(d)
			}
			return 0
		})
	}
	counter := func(name, help string, f func(dispatcher.Stats) int64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 {
			if d := m.d.Load(); d != nil {
				return float64(f(d.Stats()))
			}
			return 0
		})
	}
	cs := []prometheus.Collector{
		m.dispatched, m.failed, m.jobs, m.retried, m.batches, m.batchSize, m.latency, m.retention, m.ginPages, m.ginSeconds, m.db,
		gauge("outbox_listener_connected", "1 while the LISTEN connection is up (0 in poll-only mode).", func(d *dispatcher.Dispatcher) float64 { return b2f(d.ListenerConnected()) }),
		gauge("outbox_dispatcher_running", "1 while the dispatch loop runs.", func(d *dispatcher.Dispatcher) float64 { return b2f(d.Running()) }),
		counter("outbox_dispatcher_wakes_total", "Dispatcher wake-ups by notification.", func(s dispatcher.Stats) int64 { return s.Wakes }),
		counter("outbox_dispatcher_polls_total", "Dispatcher wake-ups by the poll fallback.", func(s dispatcher.Stats) int64 { return s.Polls }),
		counter("outbox_dispatcher_passes_total", "Claim transactions of the dispatch loop, including those that found nothing.", func(s dispatcher.Stats) int64 { return s.Passes }),
		counter("outbox_dispatcher_errors_total", "Failed dispatch passes.", func(s dispatcher.Stats) int64 { return s.Errors }),
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func (m *Metrics) routeOf(eventType string) string {
	if m.cfg.Routes == nil {
		return "unknown"
	}
	r, ok := m.cfg.Routes.Match(eventType)
	if !ok {
		return "none"
	}
	return r.Prefix
}

// OnBatch records one batch; use it as dispatcher.Config.OnBatch.
func (m *Metrics) OnBatch(r claim.Result) {
	m.batches.Inc()
	m.batchSize.Observe(float64(r.Claimed))
	m.jobs.Add(float64(r.Jobs))
	m.retried.Add(float64(r.Retried))
	now := time.Now()
	for _, h := range r.Handed {
		m.latency.Observe(max(now.Sub(h.CreatedAt).Seconds(), 0))
		m.dispatched.WithLabelValues(h.Route).Inc()
	}
}

// OnRetentionBatch records rows deleted by retention; use it as
// retention.Config.OnBatch.
func (m *Metrics) OnRetentionBatch(deleted int) { m.retention.Add(float64(deleted)) }

// OnGINClean records one call of River's GIN cleaner; use it as
// outboxriver.GINCleanerConfig.OnClean.
func (m *Metrics) OnGINClean(pages int64, took time.Duration) {
	m.ginPages.Add(float64(pages))
	m.ginSeconds.Add(took.Seconds())
}

// Alerter returns an alerter that counts failed events (unroutable,
// dead_letter) by route and forwards every alert to next.
func (m *Metrics) Alerter(next alert.Alerter) alert.Alerter {
	return alert.Func(func(ctx context.Context, a alert.Alert) {
		switch a.Reason {
		case alert.Unroutable, alert.DeadLetter:
			m.failed.WithLabelValues(m.routeOf(a.EventType), string(a.Reason)).Inc()
		}
		if next != nil {
			next.Alert(ctx, a)
		}
	})
}

// dbCollector reads the table gauges at scrape time.
type dbCollector struct{ m *Metrics }

// behindAfter is how long past due a pending event counts as behind
// (outbox_pending_due_over_60s_events).
const behindAfter = 60 * time.Second

var (
	descPending     = prometheus.NewDesc("outbox_pending_events", "Pending events (due or scheduled later).", nil, nil)
	descDue         = prometheus.NewDesc("outbox_pending_due_events", "Pending events that are due now (the dispatcher's backlog).", nil, nil)
	descScheduled   = prometheus.NewDesc("outbox_pending_scheduled_events", "Pending events not due yet (a NotBefore in the future, a retry's backoff, or an earlier event of their ordering key): waiting on purpose, not a backlog.", nil, nil)
	descHeld        = prometheus.NewDesc("outbox_pending_held_events", "Of the scheduled events, those that wait for an earlier event of their ordering key that is delayed, backing off, dead-lettered or processing (their due time was moved).", nil, nil)
	descNextDue     = prometheus.NewDesc("outbox_next_scheduled_due_seconds", "Seconds until the earliest scheduled pending event is due (0 when none).", nil, nil)
	descBehind      = prometheus.NewDesc("outbox_pending_due_over_60s_events", "Pending events due for more than 60 s (the dispatcher is behind).", nil, nil)
	descOldest      = prometheus.NewDesc("outbox_oldest_pending_age_seconds", "Age of the oldest due pending event, since it became due (0 when none).", nil, nil)
	descFailedNow   = prometheus.NewDesc("outbox_failed_events", "Events in status failed (waiting for an operator).", nil, nil)
	descProcessing  = prometheus.NewDesc("outbox_processing_events", "Events in status processing.", nil, nil)
	descScrapeError = prometheus.NewDesc("outbox_database_up", "1 when the scrape-time queries of the outbox tables succeeded.", nil, nil)

	descOrderingKeys      = prometheus.NewDesc("outbox_ordering_keys", "Ordering keys (tenant, key, queue) with an unfinished ordered River job, parked or not.", nil, nil)
	descParkedKeys        = prometheus.NewDesc("outbox_ordering_parked_keys", "Parked ordering keys, by the state of the head job that parked them (discarded, cancelled, deleted): their later jobs wait for outboxctl unpark.", []string{"state"}, nil)
	descWaitingJobs       = prometheus.NewDesc("outbox_ordering_waiting_jobs", "Ordered jobs waiting in their key's line behind its head job.", nil, nil)
	descParkedWaitingJobs = prometheus.NewDesc("outbox_ordering_parked_waiting_jobs", "Ordered jobs waiting in the line of a parked key.", nil, nil)
	descOldestWait        = prometheus.NewDesc("outbox_ordering_oldest_wait_seconds", "How long the longest-waiting ordered job has waited behind its key (0 when none waits).", nil, nil)
	descParkedOldestWait  = prometheus.NewDesc("outbox_ordering_parked_oldest_wait_seconds", "How long the first job in line behind a parked key has waited, the longest among parked keys (0 when none waits).", nil, nil)
	descOldestParkedAge   = prometheus.NewDesc("outbox_ordering_oldest_parked_age_seconds", "How long the key parked longest ago has been parked (0 when none is).", nil, nil)
	descHeldKeys          = prometheus.NewDesc("outbox_ordering_held_keys", "Ordering keys whose later events wait in the outbox behind a failed event of the key (requeue or cancel it).", nil, nil)
)

func (c *dbCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPending, descDue, descScheduled, descHeld, descNextDue, descBehind, descOldest, descFailedNow, descProcessing, descScrapeError,
		descOrderingKeys, descParkedKeys, descWaitingJobs, descParkedWaitingJobs, descOldestWait, descParkedOldestWait, descOldestParkedAge, descHeldKeys} {
		ch <- d
	}
}

func (c *dbCollector) Collect(ch chan<- prometheus.Metric) {
	pool := c.m.cfg.Pool
	if pool == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.m.cfg.QueryTimeout)
	defer cancel()
	// Each reading stands alone: when one fails, the other's gauges are
	// still reported, and outbox_database_up says that one failed.
	up := 1.0
	if b, err := ReadBacklog(ctx, pool, behindAfter); err != nil {
		up = 0
	} else {
		gauge := func(d *prometheus.Desc, v float64) { ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v) }
		gauge(descPending, float64(b.Due+b.Scheduled))
		gauge(descDue, float64(b.Due))
		gauge(descScheduled, float64(b.Scheduled))
		gauge(descHeld, float64(b.Held))
		gauge(descNextDue, b.NextDueIn.Seconds())
		gauge(descBehind, float64(b.DueOver))
		gauge(descOldest, b.OldestDueAge.Seconds())
		gauge(descFailedNow, float64(b.Failed))
		gauge(descProcessing, float64(b.Processing))
	}
	if o, err := ReadOrdering(ctx, pool); err != nil {
		up = 0
	} else {
		gauge := func(d *prometheus.Desc, v float64, labels ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
		}
		gauge(descOrderingKeys, float64(o.Keys))
		gauge(descParkedKeys, float64(o.ParkedDiscarded), "discarded")
		gauge(descParkedKeys, float64(o.ParkedCancelled), "cancelled")
		gauge(descParkedKeys, float64(o.ParkedDeleted), "deleted")
		gauge(descWaitingJobs, float64(o.Waiting))
		gauge(descParkedWaitingJobs, float64(o.WaitingParked))
		gauge(descOldestWait, o.OldestWait.Seconds())
		gauge(descParkedOldestWait, o.OldestParkedWait.Seconds())
		gauge(descOldestParkedAge, o.OldestParkedAge.Seconds())
		gauge(descHeldKeys, float64(o.HeldKeys))
	}
	ch <- prometheus.MustNewConstMetric(descScrapeError, prometheus.GaugeValue, up)
}
