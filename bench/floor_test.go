package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// testEnv makes an env on the test server, closed when the test ends, and
// a context that ends within two minutes.
func testEnv(t testing.TB) (context.Context, *env) {
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

// BenchmarkOneEventHandoff times the handoff of one event, the whole of a
// light stream's batch, with nothing else running: the floor relay's
// statement (floorHandoffSQL, on its own session) against the dispatcher's
// (claim.Handoff.Batch, whose batches after the first are the one-statement
// claim sent in one round trip), in one schema each on the same server.
// Publishing the event is left out of the timing. The two run three times each,
// interleaved; on the bench's production-like cluster:
//
//	OUTBOX_PG_THROWAWAY=1 OUTBOX_PG_PROFILE=production bash ../scripts/with-postgres.sh \
//	    go test -run '^$' -bench OneEventHandoff -benchtime 3000x
//
// The difference between the two is what the dispatcher's statement adds
// to the floor's at 200 events/s: docs/benchmarks-record.md, "The
// dispatcher's statement against the floor's".
func BenchmarkOneEventHandoff(b *testing.B) {
	ctx, e := testEnv(b)
	fp, err := e.migrated(ctx, "floor_bench", 4)
	if err != nil {
		b.Fatal(err)
	}
	defer fp.Close()
	conn, err := pgx.ConnectConfig(ctx, fp.Config().ConnConfig.Copy())
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	if _, err := conn.Exec(ctx, `SET synchronous_commit = off`); err != nil {
		b.Fatal(err)
	}
	dp, err := e.migrated(ctx, "dispatcher_bench", 4)
	if err != nil {
		b.Fatal(err)
	}
	defer dp.Close()
	h := &claim.Handoff{Pool: dp, Routes: e.routes}

	// Interleaved: -count would run each one's repetitions back to back.
	for range 3 {
		b.Run("floor", func(b *testing.B) {
			oneEvent(ctx, b, fp, func() int {
				var (
					ids []int64
					n   int64
				)
				if err := conn.QueryRow(ctx, floorHandoffSQL, benchQueue, floorBatch).Scan(&ids, &n); err != nil {
					b.Fatal(err)
				}
				return len(ids)
			})
		})
		b.Run("dispatcher", func(b *testing.B) {
			oneEvent(ctx, b, dp, func() int {
				res, err := h.Batch(ctx, 100)
				if err != nil {
					b.Fatal(err)
				}
				return res.Done
			})
		})
	}
}

// oneEvent publishes one event with p, untimed, then times handoff, which
// must hand that one event off, b.N times.
func oneEvent(ctx context.Context, b *testing.B, p *pgxpool.Pool, handoff func() int) {
	for b.Loop() {
		b.StopTimer()
		if _, err := p.Exec(ctx, `SELECT outbox_publish($1, '{"n":1}')`, eventType); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if n := handoff(); n != 1 {
			b.Fatalf("handed off %d events of 1", n)
		}
	}
}
