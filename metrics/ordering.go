package metrics

import (
	"context"
	"fmt"
	"time"
)

// Ordering is the state of per-key ordering (migration 011): the keys with
// an unfinished ordered River job, the parked ones, the jobs waiting behind
// them, and the keys held back in the outbox by a dead-lettered event. All
// zero when ordering is unused.
type Ordering struct {
	// Keys is the number of (tenant, ordering key, queue) with an
	// unfinished ordered job: the rows of outbox_ordering_key.
	Keys int64 `json:"keys"`
	// ParkedDiscarded, ParkedCancelled and ParkedDeleted count the parked
	// keys by parked_state: the head job was discarded (out of attempts),
	// cancelled, or deleted before its turn. A parked key's later jobs wait
	// for an operator (outboxctl keys, outboxctl unpark).
	ParkedDiscarded int64 `json:"parked_discarded"`
	ParkedCancelled int64 `json:"parked_cancelled"`
	ParkedDeleted   int64 `json:"parked_deleted"`
	// Waiting is the number of ordered jobs that wait behind their key's
	// head (the rows of outbox_ordering_wait); WaitingParked, how many of
	// them wait behind a parked key.
	Waiting       int64 `json:"waiting"`
	WaitingParked int64 `json:"waiting_parked"`
	// OldestWait is how long the job that has waited longest behind a key
	// has waited (0 when none waits).
	OldestWait time.Duration `json:"oldest_wait_ns"`
	// OldestParkedWait is the same among parked keys: how long the first
	// job in line behind a parked key has waited (0 when no job waits
	// behind a parked key).
	OldestParkedWait time.Duration `json:"oldest_parked_wait_ns"`
	// OldestParkedAge is how long the key parked longest ago has been
	// parked (0 when none is).
	OldestParkedAge time.Duration `json:"oldest_parked_age_ns"`
	// HeldKeys is the number of (tenant, ordering key) whose later events
	// wait in the outbox, pending or processing, behind a failed (dead-lettered or
	// unroutable) event of the key: the claim hands them off only once the
	// failed one is requeued or cancelled.
	HeldKeys int64 `json:"held_keys"`
}

// Parked is the number of parked keys, whatever their parked_state.
func (o Ordering) Parked() int64 { return o.ParkedDiscarded + o.ParkedCancelled + o.ParkedDeleted }

// orderingSQL reads an Ordering in one statement, each part bounded by an
// index or by the small table it counts:
//
//   - the counts read outbox_ordering_key, one row per key in flight (a
//     seq scan of the keys in flight, nothing when ordering is unused);
//   - the waiting jobs and the oldest wait are one pass over
//     outbox_ordering_wait (count and min(since)): it holds only the jobs
//     waiting now, so the pass is proportional to them (measured: 40 to
//     150 ms for 90,000 on a loaded machine); an index on since would make
//     the oldest wait one probe but cost every ordered job an index entry;
//   - the jobs waiting behind parked keys are counted through the parked
//     keys (outbox_ordering_key_parked_idx) and the wait table's key;
//   - among parked keys (outbox_ordering_key_parked_idx), the first job in
//     line of each (its primary key, ordered by position) gives the oldest
//     wait: jobs of a key are inserted in position order, one handoff
//     after the other, so the first in line has waited longest;
//   - the held keys start from the failed events (outbox_event_dead_idx)
//     that have an ordering key and probe outbox_event_ordering_idx for a
//     later pending event of the key.
//
// Run it in the same snapshot as figures that must agree with it.
const orderingSQL = `
WITH k AS (
    SELECT count(*) AS keys,
           count(*) FILTER (WHERE parked_state = 'discarded') AS discarded,
           count(*) FILTER (WHERE parked_state = 'cancelled') AS cancelled,
           count(*) FILTER (WHERE parked_state = 'deleted') AS deleted,
           min(parked_at) AS oldest_parked_at
    FROM outbox_ordering_key
),
w AS (
    SELECT count(*) AS waiting, min(since) AS oldest FROM outbox_ordering_wait
),
wp AS (
    SELECT count(*) AS waiting
    FROM outbox_ordering_key k
    JOIN outbox_ordering_wait x ON x.tenant_id = k.tenant_id AND x.ordering_key = k.ordering_key AND x.queue = k.queue
    WHERE k.parked_at IS NOT NULL
),
p AS (
    SELECT min(w.since) AS oldest
    FROM outbox_ordering_key k
    CROSS JOIN LATERAL (
        SELECT x.since FROM outbox_ordering_wait x
        WHERE x.tenant_id = k.tenant_id AND x.ordering_key = k.ordering_key AND x.queue = k.queue
        ORDER BY x.position, x.job_id
        LIMIT 1) w
    WHERE k.parked_at IS NOT NULL
),
h AS (
    SELECT count(DISTINCT (coalesce(f.tenant_id, ''), f.ordering_key)) AS held
    FROM outbox_event f
    WHERE f.status = 'failed' AND f.ordering_key IS NOT NULL
      AND EXISTS (
          SELECT 1 FROM outbox_event e
          WHERE e.ordering_key IS NOT NULL AND e.status IN ('pending', 'processing')
            AND coalesce(e.tenant_id, '') = coalesce(f.tenant_id, '') AND e.ordering_key = f.ordering_key
            AND e.ordering_position > f.ordering_position)
)
SELECT k.keys, k.discarded, k.cancelled, k.deleted, w.waiting, wp.waiting,
       coalesce(extract(epoch FROM now() - w.oldest), 0)::float8,
       coalesce(extract(epoch FROM now() - p.oldest), 0)::float8,
       coalesce(extract(epoch FROM now() - k.oldest_parked_at), 0)::float8,
       h.held
FROM k, w, wp, p, h`

// ReadOrdering reads the state of per-key ordering in one statement: the
// gauges of every scrape and outboxctl stats read the same figures the
// same way. On empty ordering tables it costs a few index probes.
func ReadOrdering(ctx context.Context, q Querier) (Ordering, error) {
	var (
		o                               Ordering
		oldestS, oldestParkedS, parkedS float64
	)
	err := q.QueryRow(ctx, orderingSQL).Scan(&o.Keys, &o.ParkedDiscarded, &o.ParkedCancelled, &o.ParkedDeleted,
		&o.Waiting, &o.WaitingParked, &oldestS, &oldestParkedS, &parkedS, &o.HeldKeys)
	if err != nil {
		return Ordering{}, fmt.Errorf("read the ordering keys (has `outboxctl migrate` run migration 011?): %w", err)
	}
	o.OldestWait = seconds(oldestS)
	o.OldestParkedWait = seconds(oldestParkedS)
	o.OldestParkedAge = seconds(parkedS)
	return o, nil
}

// seconds converts a non-negative number of seconds (clamped at 0: the
// database's clock is the reference, but a row stamped by a transaction
// that started after the reading one has a later time) to a Duration.
func seconds(s float64) time.Duration {
	return time.Duration(max(s, 0) * float64(time.Second))
}
