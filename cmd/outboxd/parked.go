package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/internal/plural"
	"github.com/outboxhq/outbox/internal/service"
)

// parkedCheckEvery is how often the dispatcher's process looks for newly
// parked ordering keys.
const parkedCheckEvery = 5 * time.Second

// parkedQueryTimeout bounds one check's query.
const parkedQueryTimeout = 5 * time.Second

// parkedLimit bounds one check: the keys parked most recently come first,
// so a newly parked key is always among them while fewer than this many
// keys are parked after it between two checks.
const parkedLimit = 1000

// parkedSQL lists the parked keys, most recently parked first, through
// outbox_ordering_key_parked_idx (nothing to read when none is parked),
// with the head event's type when the event is still stored.
const parkedSQL = `
SELECT k.tenant_id, k.ordering_key, k.queue, k.head_job_id, coalesce(k.head_event_id, 0), k.parked_state, k.parked_at,
       (SELECT count(*) FROM outbox_ordering_wait w WHERE w.tenant_id = k.tenant_id AND w.ordering_key = k.ordering_key AND w.queue = k.queue),
       coalesce(e.event_type, '')
FROM outbox_ordering_key k
LEFT JOIN outbox_event e ON e.id = k.head_event_id
WHERE k.parked_at IS NOT NULL
ORDER BY k.parked_at DESC
LIMIT $1`

// parking identifies one parking of a key: a key unparked and parked
// again (a new head, or the same head failing again) is a new parking.
type parking struct {
	tenant, key, queue string
	job                int64
	at                 time.Time
}

// parkedWatch raises alert.ParkedKey once per newly parked key (tenant,
// key, queue), as a service (internal/service). Its memory is its own: a
// restarted process alerts again for the keys still parked, and each
// dispatcher process alerts (Sentry groups them per key, under its rate
// limit).
type parkedWatch struct {
	pool   *pgxpool.Pool
	al     alert.Alerter
	logger *slog.Logger
	tick   time.Duration
	life   service.Lifecycle

	// checks counts the completed checks (a test signal).
	checks atomic.Int64
}

// Start starts the watch.
func (w *parkedWatch) Start(ctx context.Context) error {
	return w.life.Go(ctx, func(run, _ context.Context) { w.loop(run) })
}

// Stop stops the watch and waits for it.
func (w *parkedWatch) Stop(ctx context.Context) error { return w.life.Stop(ctx) }

// loop checks at once, then every tick, until ctx ends. A failed check is
// logged once until a check succeeds again.
func (w *parkedWatch) loop(ctx context.Context) {
	t := time.NewTicker(w.tick)
	defer t.Stop()
	seen := map[parking]struct{}{}
	failing := false
	for {
		next, err := w.check(ctx, seen)
		switch {
		case err == nil:
			seen, failing = next, false
			w.checks.Add(1)
		case ctx.Err() != nil:
			return
		case !failing:
			failing = true
			w.logger.Warn("cannot look for parked ordering keys (retrying)", slog.String("error", err.Error()))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// check reads the parked keys, alerts for those not in seen, and returns
// the parkings it read (the next seen).
func (w *parkedWatch) check(ctx context.Context, seen map[parking]struct{}) (map[parking]struct{}, error) {
	qctx, cancel := context.WithTimeout(ctx, parkedQueryTimeout)
	defer cancel()
	rows, err := w.pool.Query(qctx, parkedSQL, parkedLimit)
	if err != nil {
		return nil, fmt.Errorf("read parked ordering keys: %w", err)
	}
	type row struct {
		p                parking
		event, waiting   int64
		state, eventType string
	}
	var found []row
	var r row
	_, err = pgx.ForEachRow(rows, []any{&r.p.tenant, &r.p.key, &r.p.queue, &r.p.job, &r.event, &r.state, &r.p.at, &r.waiting, &r.eventType}, func() error {
		found = append(found, r)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read parked ordering keys: %w", err)
	}
	next := make(map[parking]struct{}, len(found))
	for _, f := range found {
		next[f.p] = struct{}{}
		if _, ok := seen[f.p]; ok {
			continue
		}
		tenant := "no tenant"
		if f.p.tenant != "" {
			tenant = fmt.Sprintf("tenant %q", f.p.tenant)
		}
		w.al.Alert(ctx, alert.Alert{
			Reason: alert.ParkedKey,
			Message: fmt.Sprintf("ordering key %q (%s) is parked in queue %s: its head job %d (event %d) is %s, and %s behind it; list parked keys with `outboxctl keys`, then retry or skip the head with `outboxctl unpark`",
				f.p.key, tenant, f.p.queue, f.p.job, f.event, f.state, plural.Of(f.waiting, "later job waits", "later jobs wait")),
			EventID:     f.event,
			EventType:   f.eventType,
			TenantID:    f.p.tenant,
			OrderingKey: f.p.key,
			Queue:       f.p.queue,
			JobID:       f.p.job,
		})
	}
	return next, nil
}
