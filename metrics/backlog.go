package metrics

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/schemacheck"
)

// Backlog splits the pending events at the database's now(): the due ones
// are the dispatcher's backlog (they should drain within a batch or two),
// the scheduled ones wait on purpose (a NotBefore in the future, or the
// backoff after a failed attempt). A million reminders due tomorrow are
// Scheduled, not Due, so they do not look like a stalled dispatcher.
type Backlog struct {
	// Due is the number of pending events with scheduled_at <= now().
	Due int64 `json:"pending_due"`
	// DueOver is how many of them have been due for longer than the
	// threshold given to ReadBacklog (the dispatcher is behind).
	DueOver int64 `json:"pending_due_over_threshold"`
	// OldestDueAge is how long the oldest due event has been due (0 when
	// none): its lag, counted from its due time, not from when it was
	// published.
	OldestDueAge time.Duration `json:"oldest_due_age_ns"`
	// Scheduled is the number of pending events with scheduled_at > now().
	Scheduled int64 `json:"pending_scheduled"`
	// Held is how many of the Scheduled events wait for an earlier event
	// of their ordering key that cannot move for a while (delayed, backing
	// off, dead-lettered): the dispatcher moved their due time
	// (docs/ordering.md, "Held in the outbox"). 0 on a schema before
	// migration 021.
	Held int64 `json:"pending_held"`
	// NextDue is when the earliest scheduled event falls due (the zero
	// time when none), by the database's clock.
	NextDue time.Time `json:"next_scheduled_due_at"`
	// NextDueIn is how long until NextDue, by the database's clock (0
	// when none is scheduled).
	NextDueIn time.Duration `json:"next_scheduled_due_in_ns"`
	// Failed and Processing count the rows in those statuses (dead letters,
	// and rows a dispatcher of another version left processing).
	Failed     int64 `json:"failed"`
	Processing int64 `json:"processing"`
}

// backlogSQL is the select list of the statement that reads a Backlog
// (backlogHeldSQL, backlogNoHeldSQL). $1 is the "behind" threshold in
// seconds.
// Every count is a range of the claim index (status = 'pending', ordered by
// scheduled_at): the due part ends at now() and costs what the backlog
// costs; the scheduled count reads every scheduled entry (about 25 ms per
// 100,000; the held count, backlogHeldSQL's, reads held_from of those
// rows too), so a caller on a hot path should read it less often than the
// due part. Run it in the same snapshot as other figures that must agree
// with it (outboxctl stats runs one REPEATABLE READ, read-only
// transaction).
const backlogSQL = `
SELECT count(*) FILTER (WHERE status = 'pending' AND scheduled_at <= now()),
       count(*) FILTER (WHERE status = 'pending' AND scheduled_at <= now() - make_interval(secs => $1)),
       coalesce(extract(epoch FROM now() - min(scheduled_at) FILTER (WHERE status = 'pending' AND scheduled_at <= now())), 0)::float8,
       count(*) FILTER (WHERE status = 'pending' AND scheduled_at > now()),
       min(scheduled_at) FILTER (WHERE status = 'pending' AND scheduled_at > now()),
       coalesce(extract(epoch FROM min(scheduled_at) FILTER (WHERE status = 'pending' AND scheduled_at > now()) - now()), 0)::float8,
       count(*) FILTER (WHERE status = 'failed'),
       count(*) FILTER (WHERE status = 'processing')`

const backlogFromSQL = `
FROM outbox_event
WHERE status IN ('pending', 'processing', 'failed')`

// backlogHeldSQL reads a Backlog with the held count (Backlog.Held), for a
// schema with migration 021's held_from; backlogNoHeldSQL counts none.
var (
	backlogHeldSQL = backlogSQL + `,
       count(*) FILTER (WHERE status = 'pending' AND scheduled_at > now() AND held_from IS NOT NULL)` + backlogFromSQL
	backlogNoHeldSQL = backlogSQL + `,
       0::bigint` + backlogFromSQL
)

// Querier is what ReadBacklog needs: a pgx.Tx, *pgx.Conn or *pgxpool.Pool.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ReadBacklog reads the pending events split into due and scheduled (due
// events older than behind count in DueOver) and the failed and processing
// counts, in one statement (after a catalog lookup for migration 021's
// column): the gauges of every scrape and outboxctl stats read the same
// figures the same way.
func ReadBacklog(ctx context.Context, q Querier, behind time.Duration) (Backlog, error) {
	var (
		b       Backlog
		oldestS float64
		nextS   float64
		next    *time.Time
	)
	// Asked at every read, not remembered: one process may read schemas
	// of several versions (a pool per schema), and the lookup costs a
	// round trip, not a scan.
	withHeld, err := schemacheck.HeldFrom(ctx, q)
	if err != nil {
		return Backlog{}, err
	}
	query := backlogNoHeldSQL
	if withHeld {
		query = backlogHeldSQL
	}
	if err := q.QueryRow(ctx, query, behind.Seconds()).Scan(&b.Due, &b.DueOver, &oldestS, &b.Scheduled, &next, &nextS, &b.Failed, &b.Processing, &b.Held); err != nil {
		return Backlog{}, fmt.Errorf("read the pending backlog: %w", err)
	}
	b.OldestDueAge = time.Duration(oldestS * float64(time.Second))
	b.NextDueIn = time.Duration(nextS * float64(time.Second))
	if next != nil {
		b.NextDue = *next
	}
	return b, nil
}
