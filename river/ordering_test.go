package outboxriver_test

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// stepArgs is the payload of an ordered test event, worked by a plain
// river.Worker that knows nothing about the outbox.
type stepArgs struct {
	Key string `json:"key"`
	Seq int    `json:"seq"`
}

func (stepArgs) Kind() string { return "order_step" }

// stepLog records, per key, when each job of the key started and ended.
type stepLog struct {
	mu   sync.Mutex
	runs map[string][]stepRun
	n    int
}

type stepRun struct {
	seq        int
	start, end time.Time
}

type stepWorker struct {
	river.WorkerDefaults[stepArgs]
	log *stepLog
}

func (w *stepWorker) Work(ctx context.Context, job *river.Job[stepArgs]) error {
	start := time.Now()
	time.Sleep(2 * time.Millisecond)
	w.log.record(job.Args, start, time.Now())
	return nil
}

// record adds a run of the job with args a.
func (l *stepLog) record(a stepArgs, start, end time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.runs[a.Key] = append(l.runs[a.Key], stepRun{seq: a.Seq, start: start, end: end})
	l.n++
}

// TestOrderedJobsRunOneAtATimeInOrder: events of five keys, published
// interleaved (some one per transaction, some several in one), go through
// the real dispatcher to a plain River worker in two clients (two
// "processes") with ten workers each. Per key the jobs start in publish
// order, and none starts before the one before it ended.
func TestOrderedJobsRunOneAtATimeInOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 120*time.Second)
	routes, err := route.New([]route.Rule{{Prefix: "order.", Jobs: []route.Job{{Queue: "orders", Kind: "order_step", Args: route.ArgsPayload}}}})
	if err != nil {
		t.Fatal(err)
	}
	log := &stepLog{runs: map[string][]stepRun{}}
	for i := range 2 {
		workers := river.NewWorkers()
		river.AddWorker(workers, &stepWorker{log: log})
		cfg := outboxriver.QueuesConfig(workers, []outboxriver.Queue{{Name: "orders", MaxWorkers: 10}}, outboxriver.WorkerLatency{})
		cfg.Logger = quiet
		cfg.ID = fmt.Sprintf("client%d", i)
		client, err := river.NewClient(riverpgxv5.New(s.Pool), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := client.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = client.Stop(sctx)
		})
	}
	startDispatcher(t, s.Pool, routes)

	const keys, per = 5, 20
	total := 0
	for seq := 0; seq < per; seq += 2 {
		for k := range keys {
			key := fmt.Sprintf("k%d", k)
			var events []outbox.Event
			for j := seq; j < seq+2; j++ {
				events = append(events, outbox.Event{Type: "order.step.done", OrderingKey: key, Payload: []byte(fmt.Sprintf(`{"key":%q,"seq":%d}`, key, j))})
			}
			if k%2 == 0 {
				events = events[:1] // one per transaction for even keys
				pgtest.Publish(t, s.Pool, events...)
				events = []outbox.Event{{Type: "order.step.done", OrderingKey: key, Payload: []byte(fmt.Sprintf(`{"key":%q,"seq":%d}`, key, seq+1))}}
			}
			if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
				_, err := outbox.PublishMany(ctx, tx, events)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			total += 2
		}
	}
	pgtest.WaitFor(t, 90*time.Second, "every ordered job worked", func() bool {
		log.mu.Lock()
		defer log.mu.Unlock()
		return log.n >= total
	})
	log.mu.Lock()
	defer log.mu.Unlock()
	if log.n != total {
		t.Fatalf("worked %d jobs, want %d", log.n, total)
	}
	for key, runs := range log.runs {
		sort.Slice(runs, func(i, j int) bool { return runs[i].start.Before(runs[j].start) })
		for i, r := range runs {
			if r.seq != i {
				t.Errorf("key %s: run %d worked seq %d (want %d)", key, i, r.seq, i)
			}
			if i > 0 && r.start.Before(runs[i-1].end) {
				t.Errorf("key %s: seq %d started %s before seq %d ended", key, r.seq, runs[i-1].end.Sub(r.start), runs[i-1].seq)
			}
		}
	}
	// The last job's completion commits after its Work returned: the key's
	// row goes then.
	pgtest.WaitFor(t, 30*time.Second, "no ordering key left after the drain", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key`) == 0
	})
}
