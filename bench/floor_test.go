package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// testEnv makes an env on the test server, closed when the test ends, and
// a context that ends within two minutes.
func testEnv(t *testing.T) (context.Context, *env) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	e, err := newEnv(ctx, &Options{URL: defaultURL(), Repo: ".."})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.close)
	return ctx, e
}

// TestFloorRelay runs the latency scenario's floor relay against a real
// Postgres: every event published after it started is handed off once,
// as one River job of the bench queue whose args decode as the outbox's,
// worked by River, and marked done with that job's id.
func TestFloorRelay(t *testing.T) {
	t.Parallel()
	ctx, e := testEnv(t)
	p, err := e.migrated(ctx, "floor_test", 8)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c := newClocks()
	rc, err := workerClient(ctx, e, p, c)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rc.Stop(context.WithoutCancel(ctx)) }()
	relay, err := startFloorRelay(ctx, p, c)
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = relay.stop()
		}
	}()

	// More than a batch in one transaction (the relay loops while its
	// batches come back full), then single events.
	const first, more = floorBatch + 30, 20
	var ids []int64
	publish := func(n int) {
		tx, err := p.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		for range n {
			pub, err := outbox.Publish(ctx, tx, outbox.Event{Type: eventType, Payload: json.RawMessage(`{"n":1}`)})
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, pub.ID)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	publish(first)
	for range more {
		publish(1)
	}
	pgtest.WaitFor(t, time.Minute, "every job worked", func() bool { return c.worked.Load() >= int64(len(ids)) })
	if got := c.worked.Load(); got != int64(len(ids)) {
		t.Fatalf("%d jobs worked for %d events", got, len(ids))
	}
	if err := relay.stop(); err != nil {
		t.Fatalf("relay: %v", err)
	}
	stopped = true

	c.mu.Lock()
	for _, id := range ids {
		if _, ok := c.handoff[id]; !ok {
			t.Errorf("event %d: no handoff mark", id)
		}
		if _, ok := c.work[id]; !ok {
			t.Errorf("event %d: not worked (args did not carry its id)", id)
		}
	}
	c.mu.Unlock()
	var done, jobs, bad int
	if err := p.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE e.status = 'done'),
       count(j.id),
       count(*) FILTER (WHERE cardinality(e.river_job_ids) <> 1 OR j.queue <> $1 OR j.kind <> 'outbox_event')
FROM outbox_event e LEFT JOIN river_job j ON j.id = e.river_job_ids[1]`, benchQueue).Scan(&done, &jobs, &bad); err != nil {
		t.Fatal(err)
	}
	if done != len(ids) || jobs != len(ids) || bad != 0 {
		t.Errorf("%d events: %d done, %d with their job, %d with a wrong job", len(ids), done, jobs, bad)
	}
	var total int
	if err := p.QueryRow(ctx, `SELECT count(*) FROM river_job`).Scan(&total); err != nil {
		t.Fatal(err)
	}
	if total != len(ids) {
		t.Errorf("%d River jobs for %d events", total, len(ids))
	}
}
