package admin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/config"
	"github.com/outboxhq/outbox/internal/plural"
	"github.com/outboxhq/outbox/metrics"
	"github.com/outboxhq/outbox/retention"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// behindAfter is how long past due a pending event counts as "behind".
const behindAfter = 60 * time.Second

// DefaultStalledAfter is StatsOpts.StalledAfter when it is 0.
const DefaultStalledAfter = 10 * time.Minute

// StatsOpts are the options of Stats.
type StatsOpts struct {
	// StalledAfter: a River job running longer than this is stalled.
	// 0 (or less) means DefaultStalledAfter.
	StalledAfter time.Duration
	// Routes, when set, adds a row for every route queue (with or without
	// jobs) and lets Stats list the routes whose queue no worker works.
	Routes *route.Table
	// WorkedQueues, when not nil, are the River queues that some worker
	// works (an empty, non-nil slice: none). When nil and Routes is set,
	// the queues River workers reported recently in river_queue are used;
	// when nil without Routes, the worked queues are unknown.
	WorkedQueues []string
	// WorkedQueuesSource says where WorkedQueues came from (a flag, an
	// environment variable); it is reported in Stats.WorkedQueuesSource.
	WorkedQueuesSource string
	// Thresholds raise Stats.Alerts. The zero value alerts on any
	// dispatcher lag, stalled job, failed event, discarded job and parked
	// ordering key;
	// DefaultThresholds are outboxctl's defaults.
	Thresholds Thresholds
}

// Thresholds of the alerts: an alert is raised when its value is above the
// threshold. A negative threshold turns the alert off.
type Thresholds struct {
	// MaxBehind: pending events due for more than 60 s ("dispatcher_behind").
	MaxBehind int64
	// MaxStalled: outbox River jobs stalled ("river_jobs_stalled").
	MaxStalled int64
	// MaxFailed: failed events, dead-lettered or unroutable ("events_failed").
	MaxFailed int64
	// MaxDiscarded: outbox River jobs discarded ("river_jobs_discarded").
	MaxDiscarded int64
	// MaxParked: parked ordering keys ("keys_parked").
	MaxParked int64
}

// DefaultThresholds are outboxctl stats' defaults: more than 1000 events
// behind, any stalled job, any failed event, any parked ordering key;
// discarded jobs off.
func DefaultThresholds() Thresholds {
	return Thresholds{MaxBehind: 1000, MaxStalled: 0, MaxFailed: 0, MaxDiscarded: -1, MaxParked: 0}
}

// Stats is one consistent snapshot of the outbox and its River jobs.
type Stats struct {
	// Events counts outbox_event rows by status, every status present.
	Events map[string]int64 `json:"events"`
	// OldestDuePendingAgeS is how long the oldest due pending event has
	// been due, in seconds (0 when none is).
	OldestDuePendingAgeS float64 `json:"oldest_due_pending_age_seconds"`
	// PendingDueOver60s counts pending events due for more than 60 s.
	PendingDueOver60s int64 `json:"pending_due_over_60s"`
	// PendingDue is the dispatcher's backlog: pending events that are due
	// (scheduled_at <= now()).
	PendingDue int64 `json:"pending_due"`
	// PendingScheduled counts pending events that wait on purpose (a
	// NotBefore in the future, the backoff after a failed attempt, or an
	// earlier event of their ordering key whose due time they were moved
	// to, docs/ordering.md "Held in the outbox"): not a backlog, however
	// many.
	PendingScheduled int64 `json:"pending_scheduled"`
	// PendingHeld counts the scheduled events that wait for an earlier
	// event of their ordering key (metrics.Backlog.Held).
	PendingHeld int64 `json:"pending_held"`
	// NextScheduledDueAt is when the earliest scheduled event falls due
	// (nil when none is scheduled).
	NextScheduledDueAt *time.Time `json:"next_scheduled_due_at"`
	// Queues are the outbox's River jobs per queue, sorted by queue.
	Queues []QueueStats `json:"queues"`
	// StalledAfterS is StatsOpts.StalledAfter in seconds.
	StalledAfterS float64 `json:"stalled_after_seconds"`
	// WorkedQueuesKnown is true when the worked queues were known (given,
	// or read from river_queue): QueueStats.Worked and UnworkedRoutes are
	// then filled in.
	WorkedQueuesKnown  bool   `json:"worked_queues_known"`
	WorkedQueuesSource string `json:"worked_queues_source,omitempty"`
	// UnworkedRoutes are the routes whose queue no worker works.
	UnworkedRoutes []UnworkedRoute `json:"unworked_routes"`
	// Alerts are the thresholds crossed, in a fixed order.
	Alerts []Alert `json:"alerts"`
	// RetentionLastFinished is when the retention job last finished; nil
	// when it never has.
	RetentionLastFinished *time.Time `json:"retention_last_finished_at"`
	// Ordering is the state of per-key ordering (all zero when unused).
	Ordering OrderingStats `json:"ordering"`
}

// OrderingStats is the state of per-key ordering (metrics.Ordering, with
// the ages in seconds).
type OrderingStats struct {
	// Keys counts the (tenant, ordering key, queue) with an unfinished
	// ordered River job, parked or not.
	Keys int64 `json:"keys"`
	// Parked counts the parked keys: their head job was discarded,
	// cancelled or deleted, and their later jobs wait for outboxctl unpark.
	Parked int64 `json:"parked_keys"`
	// ParkedByState splits Parked by parked_state: discarded, cancelled
	// and deleted, each always present.
	ParkedByState map[string]int64 `json:"parked_keys_by_state"`
	// Waiting counts the ordered jobs waiting in the line behind their key's
	// head; WaitingParked, those behind a parked key.
	Waiting       int64 `json:"waiting_jobs"`
	WaitingParked int64 `json:"waiting_jobs_behind_parked"`
	// OldestWaitS is how long the longest-waiting job has waited behind
	// its key, in seconds (0 when none waits); OldestParkedWaitS, the
	// same behind parked keys.
	OldestWaitS       float64 `json:"oldest_wait_seconds"`
	OldestParkedWaitS float64 `json:"oldest_parked_wait_seconds"`
	// OldestParkedAgeS is how long the key parked longest ago has been
	// parked, in seconds (0 when none is).
	OldestParkedAgeS float64 `json:"oldest_parked_age_seconds"`
	// HeldKeys counts the (tenant, ordering key) whose later events wait in
	// the outbox behind a failed event of the key (requeue or cancel it).
	HeldKeys int64 `json:"held_keys"`
}

func orderingStats(o metrics.Ordering) OrderingStats {
	return OrderingStats{
		Keys:   o.Keys,
		Parked: o.Parked(),
		ParkedByState: map[string]int64{
			"discarded": o.ParkedDiscarded, "cancelled": o.ParkedCancelled, "deleted": o.ParkedDeleted},
		Waiting:           o.Waiting,
		WaitingParked:     o.WaitingParked,
		OldestWaitS:       o.OldestWait.Seconds(),
		OldestParkedWaitS: o.OldestParkedWait.Seconds(),
		OldestParkedAgeS:  o.OldestParkedAge.Seconds(),
		HeldKeys:          o.HeldKeys,
	}
}

// QueueStats counts the outbox's River jobs in one queue.
type QueueStats struct {
	Queue     string `json:"queue"`
	Available int64  `json:"available"`
	Running   int64  `json:"running"`
	Retryable int64  `json:"retryable"`
	Discarded int64  `json:"discarded"`
	// Stalled jobs are running for longer than StatsOpts.StalledAfter.
	Stalled int64 `json:"stalled"`
	// Worked says whether some worker works the queue; nil when unknown.
	Worked *bool `json:"worked,omitempty"`
}

// UnworkedRoute is a route whose queue no worker works: its jobs wait
// forever.
type UnworkedRoute struct {
	Prefix string `json:"prefix"`
	Queue  string `json:"queue"`
}

// Alert is one threshold crossed.
type Alert struct {
	// Name is dispatcher_behind, river_jobs_stalled, events_failed,
	// river_jobs_discarded, keys_parked or routes_unworked.
	Name      string  `json:"name"`
	Value     float64 `json:"value"`
	Threshold float64 `json:"threshold"`
	// Message says what it means and what to do.
	Message string `json:"message"`
}

// statusCountsSQL counts every status, zeros included.
const statusCountsSQL = `
SELECT s::text, count(e.id)
FROM unnest(enum_range(NULL::outbox_status)) AS s
LEFT JOIN outbox_event e ON e.status = s
GROUP BY s ORDER BY s`

// riverQueuesSQL counts the outbox's River jobs per queue and state: the
// envelope kind, and jobs of any kind a route gave them (they carry the
// event in their metadata);
// stalled are running jobs attempted more than $2 s ago.
const riverQueuesSQL = `
SELECT queue,
       count(*) FILTER (WHERE state = 'available'),
       count(*) FILTER (WHERE state = 'running'),
       count(*) FILTER (WHERE state = 'retryable'),
       count(*) FILTER (WHERE state = 'discarded'),
       count(*) FILTER (WHERE state = 'running' AND attempted_at < now() - make_interval(secs => $2))
FROM river_job
WHERE (kind = $1 OR metadata ? 'outbox_event_id') AND state IN ('available', 'running', 'retryable', 'discarded')
GROUP BY queue ORDER BY queue`

// retentionRunSQL reads the retention job's last finished run
// (outbox_job_run, migration 002).
const retentionRunSQL = `SELECT last_finished_at FROM outbox_job_run WHERE name = $1`

// Stats counts events by status, measures the dispatcher's lag, counts the
// outbox's River jobs per queue, reads the ordering keys (parked, waiting,
// held), finds routes nobody works and raises the alerts whose thresholds
// are crossed. The numbers come from one read-only
// snapshot, so they agree with each other.
func (c *Client) Stats(ctx context.Context, opts StatsOpts) (*Stats, error) {
	res, err := c.stats(ctx, opts)
	return res, c.explain(ctx, err)
}

func (c *Client) stats(ctx context.Context, opts StatsOpts) (*Stats, error) {
	stalledAfter := opts.StalledAfter
	if stalledAfter <= 0 {
		stalledAfter = DefaultStalledAfter
	}
	worked, workedSource := opts.WorkedQueues, opts.WorkedQueuesSource
	if worked == nil && opts.Routes != nil {
		active, err := config.ActiveQueues(ctx, c.pool, 0)
		if err != nil {
			return nil, err
		}
		if active == nil {
			active = []string{}
		}
		worked, workedSource = active, "river_queue (workers seen recently)"
	}
	workedKnown := worked != nil
	res := &Stats{Events: map[string]int64{}, Queues: []QueueStats{}, UnworkedRoutes: []UnworkedRoute{},
		Alerts: []Alert{}, StalledAfterS: stalledAfter.Seconds(), WorkedQueuesKnown: workedKnown}
	if workedKnown {
		res.WorkedQueuesSource = workedSource
	}
	// One read-only snapshot, so the numbers agree with each other.
	err := pgx.BeginTxFunc(ctx, c.pool, pgx.TxOptions{AccessMode: pgx.ReadOnly, IsoLevel: pgx.RepeatableRead}, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, statusCountsSQL)
		if err != nil {
			return fmt.Errorf("count events (has `outboxctl migrate` run?): %w", err)
		}
		for rows.Next() {
			var s string
			var n int64
			if err := rows.Scan(&s, &n); err != nil {
				rows.Close()
				return err
			}
			res.Events[s] = n
		}
		if err := rows.Err(); err != nil {
			return err
		}
		// Due and scheduled apart, in the same snapshot: a million
		// reminders due tomorrow are not a stalled dispatcher.
		backlog, err := metrics.ReadBacklog(ctx, tx, behindAfter)
		if err != nil {
			return fmt.Errorf("read pending lag: %w", err)
		}
		res.OldestDuePendingAgeS = backlog.OldestDueAge.Seconds()
		res.PendingDueOver60s = backlog.DueOver
		res.PendingDue = backlog.Due
		res.PendingScheduled = backlog.Scheduled
		res.PendingHeld = backlog.Held
		if !backlog.NextDue.IsZero() {
			next := backlog.NextDue
			res.NextScheduledDueAt = &next
		}
		rows, err = tx.Query(ctx, riverQueuesSQL, outboxriver.Kind, stalledAfter.Seconds())
		if err != nil {
			return fmt.Errorf("count River jobs: %w", err)
		}
		for rows.Next() {
			var q QueueStats
			if err := rows.Scan(&q.Queue, &q.Available, &q.Running, &q.Retryable, &q.Discarded, &q.Stalled); err != nil {
				rows.Close()
				return err
			}
			res.Queues = append(res.Queues, q)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		ordering, err := metrics.ReadOrdering(ctx, tx)
		if err != nil {
			return err
		}
		res.Ordering = orderingStats(ordering)
		err = tx.QueryRow(ctx, retentionRunSQL, retention.JobName).Scan(&res.RetentionLastFinished)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("read outbox_job_run: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}

	// Route queues with no jobs yet still get a row; with a worked-queue
	// list, every queue says whether someone works it.
	if opts.Routes != nil {
		for _, q := range opts.Routes.AllQueues() {
			if !slices.ContainsFunc(res.Queues, func(s QueueStats) bool { return s.Queue == q }) {
				res.Queues = append(res.Queues, QueueStats{Queue: q})
			}
		}
		slices.SortFunc(res.Queues, func(a, b QueueStats) int { return strings.Compare(a.Queue, b.Queue) })
	}
	if workedKnown {
		for i := range res.Queues {
			w := slices.Contains(worked, res.Queues[i].Queue)
			res.Queues[i].Worked = &w
		}
		if opts.Routes != nil {
			for _, r := range opts.Routes.Rules() {
				for _, q := range r.Queues {
					if !slices.Contains(worked, q) {
						res.UnworkedRoutes = append(res.UnworkedRoutes, UnworkedRoute{Prefix: r.Prefix, Queue: q})
					}
				}
			}
			slices.SortFunc(res.UnworkedRoutes, func(a, b UnworkedRoute) int { return strings.Compare(a.Prefix, b.Prefix) })
		}
	}
	res.raiseAlerts(opts.Thresholds, stalledAfter)
	return res, nil
}

// raiseAlerts appends the alerts whose thresholds are crossed.
func (res *Stats) raiseAlerts(th Thresholds, stalledAfter time.Duration) {
	alertIf := func(name string, value, threshold float64, msg string) {
		if threshold >= 0 && value > threshold {
			res.Alerts = append(res.Alerts, Alert{Name: name, Value: value, Threshold: threshold, Message: msg})
		}
	}
	var stalled, discarded int64
	for _, q := range res.Queues {
		stalled += q.Stalled
		discarded += q.Discarded
	}
	alertIf("dispatcher_behind", float64(res.PendingDueOver60s), float64(th.MaxBehind),
		fmt.Sprintf("%s due for more than 60s (oldest %.0fs): the dispatcher is behind or down", plural.Of(res.PendingDueOver60s, "pending event is", "pending events are"), res.OldestDuePendingAgeS))
	alertIf("river_jobs_stalled", float64(stalled), float64(th.MaxStalled),
		fmt.Sprintf("%s been running for more than %s", plural.Of(stalled, "outbox River job has", "outbox River jobs have"), stalledAfter))
	alertIf("events_failed", float64(res.Events["failed"]), float64(th.MaxFailed),
		fmt.Sprintf("%s failed (dead-lettered or unroutable): fix the cause, then requeue or cancel it", plural.Of(res.Events["failed"], "event is", "events are")))
	alertIf("river_jobs_discarded", float64(discarded), float64(th.MaxDiscarded),
		fmt.Sprintf("%s discarded: the receiver gave up", plural.Of(discarded, "outbox River job is", "outbox River jobs are")))
	o := res.Ordering
	alertIf("keys_parked", float64(o.Parked), float64(th.MaxParked),
		fmt.Sprintf("%s parked (a head job discarded, cancelled or deleted; %s behind them, the oldest for %.0fs): list them with `outboxctl keys`, then retry or skip each head with `outboxctl unpark`",
			plural.Of(o.Parked, "ordering key is", "ordering keys are"), plural.Of(o.WaitingParked, "job waits", "jobs wait"), o.OldestParkedWaitS))
	if len(res.UnworkedRoutes) > 0 {
		alertIf("routes_unworked", float64(len(res.UnworkedRoutes)), 0,
			plural.Of(len(res.UnworkedRoutes), "route sends jobs to a queue that no worker group works", "routes send jobs to queues that no worker group works"))
	}
}
