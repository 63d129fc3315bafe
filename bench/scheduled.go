package main

import (
	"context"
	"fmt"
	"time"

	"github.com/outboxhq/outbox/claim"
)

// ScheduledResult is the claim of due events beside a backlog of events
// scheduled for later (delayed events, issue 12): the claim's index is
// ordered by scheduled_at, so future rows should cost the claim of due
// ones nothing.
type ScheduledResult struct {
	// Backlog is the number of pending events due tomorrow.
	Backlog int `json:"backlog"`
	// Batch is the time of one claim.Handoff.Batch that hands off Due
	// events (claim, River insert, mark done, commit).
	Batch *Summary `json:"batch"`
	// Empty is the time of a pass that finds nothing due (what an idle
	// dispatcher runs before it sleeps).
	Empty *Summary `json:"empty_pass"`
	Due   int      `json:"due_per_batch"`
}

// runScheduled measures, in one schema per backlog size, rounds of "publish
// Due events, time one Batch" and "time one empty pass".
func runScheduled(ctx context.Context, e *env, o *Options) ([]ScheduledResult, error) {
	backlogs := []int{0, 100_000}
	rounds := 200
	if o.Quick {
		backlogs = []int{0, 20_000}
		rounds = 50
	}
	const due = 100
	var out []ScheduledResult
	for _, n := range backlogs {
		schema := fmt.Sprintf("scheduled_%d", n)
		p, err := e.migrated(ctx, schema, 4)
		if err != nil {
			return nil, err
		}
		err = func() error {
			defer p.Close()
			if n > 0 {
				logf("scheduled: %d events due tomorrow", n)
				if _, err := p.Exec(ctx, `
					INSERT INTO outbox_event (event_type, payload, scheduled_at)
					SELECT $1, '{"reminder":true}', now() + interval '1 day' + make_interval(secs => g % 86400)
					FROM generate_series(1, $2) g`, eventType, n); err != nil {
					return fmt.Errorf("scheduled backlog: %w", err)
				}
			}
			// The steady state autovacuum reaches: statistics fresh.
			if _, err := p.Exec(ctx, `ANALYZE outbox_event`); err != nil {
				return err
			}
			h := &claim.Handoff{Pool: p, Routes: e.routes, MaxRetries: 6}
			batch, empty := newHist(), newHist()
			for range rounds {
				if _, err := p.Exec(ctx, `SELECT outbox_publish($1, '{}'::jsonb) FROM generate_series(1, $2)`, eventType, due); err != nil {
					return err
				}
				t0 := time.Now()
				res, err := h.Batch(ctx, due)
				if err != nil {
					return err
				}
				record(batch, time.Since(t0))
				if res.Done != due {
					return fmt.Errorf("scheduled: a batch handed off %d events, want %d (the backlog must not be claimed)", res.Done, due)
				}
				t0 = time.Now()
				if res, err = h.Batch(ctx, due); err != nil {
					return err
				}
				record(empty, time.Since(t0))
				if res.Claimed != 0 {
					return fmt.Errorf("scheduled: the empty pass claimed %d events", res.Claimed)
				}
			}
			r := ScheduledResult{Backlog: n, Batch: summarize(batch), Empty: summarize(empty), Due: due}
			r.Batch.CDF, r.Empty.CDF = nil, nil
			logf("scheduled: backlog %d: batch of %d p50 %.2f ms p99 %.2f ms; empty pass p50 %.2f ms p99 %.2f ms",
				n, due, r.Batch.P50, r.Batch.P99, r.Empty.P50, r.Empty.P99)
			out = append(out, r)
			return nil
		}()
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}
