package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// modeFloor is the latency scenario's floor of any relay: not the outbox's
// dispatcher but the least a relay from outbox_event to River can do. It
// holds the wake lock (so that every producer's commit sends the outbox's
// NOTIFY, as outboxd's idle, armed dispatcher does), and on each
// notification hands the due events off in one statement: claim, River
// insert, mark done and River's insert notification in one round trip and
// one transaction, committed without waiting for the WAL flush as the
// handoff is. It skips everything the product must do (routing, tenants,
// ordering, payload checks, River's insert API, retries, batch budgets,
// the loop's linger and fairness), so its end-to-end time minus
// River-direct's is a lower bound on what any outbox relay adds on this
// machine, measured in the same run (docs/benchmarks-record.md, "The
// floor").
const modeFloor = "relay-floor"

// floorBatch is how many events one statement of the floor relay hands
// off.
const floorBatch = 100

// floorHandoffSQL hands off up to $2 due events into River queue $1 in one
// statement and returns their ids; its second column only makes the
// statement send River's insert notification when it handed any off.
const floorHandoffSQL = `
WITH c AS (
    SELECT id, event_type, payload, created_at
    FROM outbox_event
    WHERE status = 'pending' AND scheduled_at <= now()
    ORDER BY scheduled_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), j AS (
    INSERT INTO river_job (args, kind, max_attempts, metadata, queue, state)
    SELECT jsonb_build_object('event_id', c.id, 'event_type', c.event_type, 'payload', c.payload, 'created_at', c.created_at),
           'outbox_event', 25, jsonb_build_object('outbox_event_id', c.id), $1::text, 'available'
    FROM c
    RETURNING id, (metadata->>'outbox_event_id')::bigint AS event_id
), d AS (
    UPDATE outbox_event e
    SET status = 'done', processed_at = clock_timestamp(), locked_until = NULL, river_job_ids = ARRAY[j.id]
    FROM j
    WHERE e.id = j.event_id
    RETURNING e.id
)
SELECT array(SELECT id FROM d),
       (SELECT count(*) FROM (SELECT pg_notify(current_schema() || '.river_insert', json_build_object('queue', $1::text)::text)
                              WHERE EXISTS (SELECT 1 FROM d)) n)`

// floorRelay is the floor relay's goroutine; stop ends it and returns its
// error.
type floorRelay struct {
	cancel context.CancelFunc
	done   chan struct{}
	err    error
}

// startFloorRelay connects to p's database and schema on a connection of
// its own, takes the wake lock, listens, and hands off every due event as
// notifications arrive, marking c.handoff when each statement returns.
func startFloorRelay(ctx context.Context, p *pgxpool.Pool, c *clocks) (*floorRelay, error) {
	conn, err := pgx.ConnectConfig(ctx, p.Config().ConnConfig.Copy())
	if err != nil {
		return nil, fmt.Errorf("floor relay: connect: %w", err)
	}
	for _, sql := range []string{
		`SET synchronous_commit = off`,
		`LISTEN outbox_wake`,
		fmt.Sprintf(`SELECT pg_advisory_lock(%d, outbox_wake_lock_key())`, wakeLockClass),
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			_ = conn.Close(context.WithoutCancel(ctx))
			return nil, fmt.Errorf("floor relay: %s: %w", sql, err)
		}
	}
	rctx, cancel := context.WithCancel(ctx)
	r := &floorRelay{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
		if err := r.loop(rctx, conn, c); rctx.Err() == nil {
			r.err = err // not what the stop did to the statement in flight
		}
	}()
	return r, nil
}

func (r *floorRelay) loop(ctx context.Context, conn *pgx.Conn, c *clocks) error {
	for {
		// Hand off until a statement finds less than a full batch, then
		// wait for the next notification (one that arrived meanwhile is
		// already buffered and returns at once).
		for {
			var (
				ids []int64
				n   int64
			)
			if err := conn.QueryRow(ctx, floorHandoffSQL, benchQueue, floorBatch).Scan(&ids, &n); err != nil {
				return fmt.Errorf("floor relay: hand off: %w", err)
			}
			c.mark(c.handoff, time.Now(), ids...)
			if len(ids) < floorBatch {
				break
			}
		}
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return fmt.Errorf("floor relay: wait: %w", err)
		}
	}
}

// stop ends the relay and returns what ended it, nil for the stop itself.
func (r *floorRelay) stop() error {
	r.cancel()
	<-r.done
	return r.err
}
