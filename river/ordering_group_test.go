package outboxriver_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// burstWorker holds the first job of every key until all of them run,
// then lets them end together: their completions arrive at the ordered
// completion middleware at once.
type burstWorker struct {
	river.WorkerDefaults[stepArgs]
	heads   int
	mu      sync.Mutex
	running int
	release chan struct{}
	log     *stepLog
}

func (w *burstWorker) Work(ctx context.Context, job *river.Job[stepArgs]) error {
	start := time.Now()
	if job.Args.Seq == 0 {
		w.mu.Lock()
		w.running++
		if w.running == w.heads {
			close(w.release)
		}
		w.mu.Unlock()
		select {
		case <-w.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	w.log.record(job.Args, start, time.Now())
	return nil
}

// TestOrderedCompletionsShareTransactions: the heads of 40 keys end at the
// same moment in 40 workers. The middleware writes one completion
// transaction at a time, so the completions that wait share transactions
// (rows completed by one transaction share its xmin), and every key's
// second job still starts only after its first ended, and every job is
// completed.
func TestOrderedCompletionsShareTransactions(t *testing.T) {
	t.Parallel()
	testBurstOfCompletions(t, false)
}

// TestOrderedCompletionsBeforeMigration012: against a schema without
// outbox_ordering_complete (before migration 012) the middleware completes
// each job of a group with River's own statement, with the same result.
func TestOrderedCompletionsBeforeMigration012(t *testing.T) {
	t.Parallel()
	testBurstOfCompletions(t, true)
}

func testBurstOfCompletions(t *testing.T, without012 bool) {
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 120*time.Second)
	if without012 {
		if _, err := s.Pool.Exec(ctx, `DROP FUNCTION outbox_ordering_complete(bigint[])`); err != nil {
			t.Fatal(err)
		}
	}
	routes, err := route.New([]route.Rule{{Prefix: "order.", Jobs: []route.Job{{Queue: "orders", Kind: "order_step", Args: route.ArgsPayload}}}})
	if err != nil {
		t.Fatal(err)
	}
	const keys = 40
	log := &stepLog{runs: map[string][]stepRun{}}
	w := &burstWorker{heads: keys, release: make(chan struct{}), log: log}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	cfg := outboxriver.QueuesConfig(workers, []outboxriver.Queue{{Name: "orders", MaxWorkers: keys}}, outboxriver.WorkerLatency{})
	startClient(t, s.Pool, cfg)

	var events []outbox.Event
	for seq := range 2 {
		for k := range keys {
			key := fmt.Sprintf("k%02d", k)
			events = append(events, outbox.Event{Type: "order.step.done", OrderingKey: key, Payload: []byte(fmt.Sprintf(`{"key":%q,"seq":%d}`, key, seq))})
		}
	}
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := outbox.PublishMany(ctx, tx, events)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	startDispatcher(t, s.Pool, routes)

	pgtest.WaitFor(t, 90*time.Second, "every job completed", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == 2*keys
	})
	log.mu.Lock()
	for key, runs := range log.runs {
		if len(runs) != 2 {
			t.Errorf("key %s: %d runs, want 2", key, len(runs))
			continue
		}
		first, second := runs[0], runs[1]
		if first.seq != 0 || second.seq != 1 || second.start.Before(first.end) {
			t.Errorf("key %s: seq %d ran [%s, %s], then seq %d started %s", key, first.seq, first.start, first.end, second.seq, second.start)
		}
	}
	log.mu.Unlock()
	txs := pgtest.Count(t, s.Pool, `SELECT count(DISTINCT xmin::text) FROM river_job WHERE (args->>'seq')::int = 0`)
	if txs >= keys {
		t.Fatalf("the %d heads were completed by %d transactions, want fewer", keys, txs)
	}
	t.Logf("%d heads completed by %d transactions", keys, txs)
	pgtest.WaitFor(t, 30*time.Second, "no ordering key left", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key`) == 0
	})
}
