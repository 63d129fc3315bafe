package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/dispatcher"
)

// Producer variants: the same table and Publish call, three wake triggers.
const (
	variantShipped = "a-shipped"
	variantNone    = "b-no-trigger"
	variantNaive   = "c-naive-notify"
)

// ProducerCell is one (dispatcher state, clients, variant) measurement.
type ProducerCell struct {
	State   string  `json:"dispatcher"` // idle or busy
	Clients int     `json:"clients"`
	Variant string  `json:"variant"`
	Tx      int64   `json:"transactions"`
	Seconds float64 `json:"seconds"`
	TPS     float64 `json:"tps"`
	// Ratio is TPS over the no-trigger variant's in the same row.
	Ratio float64 `json:"ratio_to_no_trigger"`
	// Samples are the TPS of each repetition; TPS is their median. The
	// variants of a row are measured in turn, repetition by repetition,
	// with the order rotated, so that drift of the machine hits all alike.
	Samples []float64 `json:"tps_samples"`
	// BusyThroughout: for busy cells, the backlog was not exhausted.
	BusyThroughout bool  `json:"busy_throughout,omitempty"`
	Backlog        int   `json:"backlog,omitempty"`
	Wakes          int64 `json:"dispatcher_wakes"`
	Batches        int64 `json:"dispatcher_batches"`
	// WaitEvents are the producers' and dispatcher's backends' samples in
	// pg_stat_activity.
	WaitEvents []string `json:"pg_wait_events"`
	Dispatched int64    `json:"dispatched"`
}

// naiveTriggerSQL replaces the shipped wake with a per-row NOTIFY that every
// producer transaction pays at commit (the reference the design avoids).
const naiveTriggerSQL = `
DROP TRIGGER outbox_event_wake ON outbox_event;
DROP TRIGGER outbox_event_wake_requeue ON outbox_event;
CREATE FUNCTION outbox_wake_naive() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_wake', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_event_notify AFTER INSERT ON outbox_event
    FOR EACH ROW EXECUTE FUNCTION outbox_wake_naive();`

const noTriggerSQL = `
DROP TRIGGER outbox_event_wake ON outbox_event;
DROP TRIGGER outbox_event_wake_requeue ON outbox_event;`

func runProducer(ctx context.Context, e *env, o *Options, drain *DrainResults) ([]ProducerCell, error) {
	schemas := map[string]string{variantShipped: "prod_a", variantNone: "prod_b", variantNaive: "prod_c"}
	pools := map[string]*pgxpool.Pool{}
	defer func() {
		for _, p := range pools {
			p.Close()
		}
	}()
	maxClients := 0
	for _, c := range o.Clients {
		maxClients = max(maxClients, c)
	}
	for _, v := range []string{variantShipped, variantNone, variantNaive} {
		p, err := e.migrated(ctx, schemas[v], int32(maxClients+2))
		if err != nil {
			return nil, err
		}
		pools[v] = p
		switch v {
		case variantNone:
			_, err = p.Exec(ctx, noTriggerSQL)
		case variantNaive:
			_, err = p.Exec(ctx, naiveTriggerSQL)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v, err)
		}
	}

	// A busy dispatcher must not run out of backlog during a cell: size it
	// from the drain rate measured earlier in this run (or a guess).
	rate := 25_000.0
	if drain != nil && len(drain.Runs) > 0 {
		rate = drain.Runs[0].PerSecond
	}
	backlog := max(5_000, int(rate*o.ProducerDuration.Seconds()*1.3))

	var cells []ProducerCell
	for _, state := range []string{"none", "idle", "busy"} {
		for _, clients := range o.Clients {
			row := map[string]*ProducerCell{}
			var rowCells []*ProducerCell
			variants := []string{variantShipped, variantNone, variantNaive}
			for rep := range o.ProducerReps {
				for i := range variants {
					v := variants[(i+rep)%len(variants)]
					c, err := producerCell(ctx, e, pools[v], o, state, clients, v, backlog)
					if err != nil {
						return nil, fmt.Errorf("%s, %d clients, dispatcher %s: %w", v, clients, state, err)
					}
					if prev := row[v]; prev != nil {
						c.Samples = append(append([]float64(nil), prev.Samples...), c.TPS)
						c.Tx += prev.Tx
						c.Seconds += prev.Seconds
						c.Wakes += prev.Wakes
						c.Batches += prev.Batches
						c.BusyThroughout = c.BusyThroughout && prev.BusyThroughout
					} else {
						c.Samples = []float64{c.TPS}
						rowCells = append(rowCells, &c)
					}
					c.TPS = median(c.Samples)
					if prev := row[v]; prev != nil {
						*prev = c
					} else {
						row[v] = &c
					}
				}
			}
			base := row[variantNone].TPS
			for _, c := range rowCells {
				c.Ratio = c.TPS / base
				cells = append(cells, *c)
			}
			logf("producer, dispatcher %s, %2d clients: a %.0f tps (%.2f×), b %.0f tps, c %.0f tps (%.2f×)", state, clients,
				row[variantShipped].TPS, row[variantShipped].Ratio, base, row[variantNaive].TPS, row[variantNaive].Ratio)
		}
	}
	return cells, nil
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if n := len(s); n%2 == 1 {
		return s[n/2]
	} else {
		return (s[n/2-1] + s[n/2]) / 2
	}
}

func producerCell(ctx context.Context, e *env, p *pgxpool.Pool, o *Options, state string, clients int, variant string, backlog int) (ProducerCell, error) {
	cell := ProducerCell{State: state, Clients: clients, Variant: variant}
	if _, err := p.Exec(ctx, `TRUNCATE outbox_event, river_job`); err != nil {
		return cell, err
	}
	if state == "busy" {
		if err := loadBacklog(ctx, p, backlog); err != nil {
			return cell, err
		}
		cell.Backlog = backlog
	}
	// State "none" runs no dispatcher: the trigger's own cost, no NOTIFY
	// (the wake lock is free).
	var d *dispatcher.Dispatcher
	if state != "none" {
		var err error
		d, err = dispatcher.New(p, dispatcher.Config{Routes: e.routes, Logger: e.quiet})
		if err != nil {
			return cell, err
		}
		if err := d.Start(ctx); err != nil {
			return cell, err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_ = d.Stop(sctx)
		}()
	}
	stats := func() dispatcher.Stats {
		if d == nil {
			return dispatcher.Stats{}
		}
		return d.Stats()
	}
	switch state {
	case "idle":
		if err := waitWakeLock(ctx, p, 10*time.Second); err != nil {
			return cell, err
		}
	case "busy":
		// Wait until the dispatcher is draining.
		for d.Stats().Batches == 0 {
			time.Sleep(time.Millisecond)
		}
	}

	pp, err := e.pool(ctx, p.Config().ConnConfig.RuntimeParams["search_path"], int32(clients), "bench-producer")
	if err != nil {
		return cell, err
	}
	defer pp.Close()
	// Open the connections before the clock starts.
	var warm sync.WaitGroup
	for range clients {
		warm.Add(1)
		go func() {
			defer warm.Done()
			if c, err := pp.Acquire(ctx); err == nil {
				time.Sleep(20 * time.Millisecond)
				c.Release()
			}
		}()
	}
	warm.Wait()

	payload := json.RawMessage(`{"order_id":12345,"amount_cents":4200,"currency":"EUR","note":"bench"}`)
	var (
		n       atomic.Int64
		wg      sync.WaitGroup
		first   atomic.Value
		stopped atomic.Bool
	)
	s0 := stats()
	sampler := startSampler(ctx, e.admin, "bench-%")
	start := time.Now()
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stopped.Load() {
				tx, err := pp.Begin(ctx)
				if err == nil {
					_, err = outbox.Publish(ctx, tx, outbox.Event{Type: eventType, Payload: payload})
					if err == nil {
						err = tx.Commit(ctx)
					} else {
						_ = tx.Rollback(ctx)
					}
				}
				if err != nil {
					first.Store(err)
					return
				}
				n.Add(1)
			}
		}()
	}
	time.Sleep(o.ProducerDuration)
	stopped.Store(true)
	wg.Wait()
	elapsed := time.Since(start)
	cell.WaitEvents = sampler.stop()
	if err, _ := first.Load().(error); err != nil {
		return cell, err
	}
	s1 := stats()
	cell.Tx = n.Load()
	cell.Seconds = elapsed.Seconds()
	cell.TPS = float64(cell.Tx) / cell.Seconds
	cell.Wakes = s1.Wakes - s0.Wakes
	cell.Batches = s1.Batches - s0.Batches
	cell.Dispatched = s1.Events - s0.Events
	if state == "busy" {
		// Still busy at the end if more events are pending than the
		// producers wrote (their rows queue behind the backlog).
		var pending int64
		if err := p.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE status = 'pending'`).Scan(&pending); err != nil {
			return cell, err
		}
		cell.BusyThroughout = pending > 0 && s1.Batches-s0.Batches > 0
	}
	return cell, nil
}
