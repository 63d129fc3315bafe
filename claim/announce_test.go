package claim_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// signalWorker sends each job's event id on a channel.
type signalWorker struct {
	river.WorkerDefaults[outboxriver.EventArgs]
	worked chan int64
}

func (w *signalWorker) Work(_ context.Context, job *river.Job[outboxriver.EventArgs]) error {
	w.worked <- job.Args.EventID
	return nil
}

// TestEveryBatchWakesTheWorkers hands off two batches back to back to
// workers that poll once an hour: the second batch's job is worked at once
// only because every batch announces its queues (handoffSQL), whatever
// River's rate limit on its own notification would have done.
func TestEveryBatchWakesTheWorkers(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	routes, err := route.New([]route.Rule{{Prefix: "mail.", Queues: []string{"outbox_mail"}}})
	if err != nil {
		t.Fatal(err)
	}
	h := &claim.Handoff{Pool: s.Pool, Routes: routes, MaxRetries: 6, Alerter: alert.Func(func(context.Context, alert.Alert) {})}

	w := &signalWorker{worked: make(chan int64, 10)}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	cfg := outboxriver.QueuesConfig(workers, []outboxriver.Queue{{Name: "outbox_mail"}}, outboxriver.WorkerLatency{FetchPollInterval: time.Hour})
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	wc, err := river.NewClient(riverpgxv5.New(s.Pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := wc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := wc.Stop(sctx); err != nil {
			t.Errorf("stop River client: %v", err)
		}
	})

	for i := range 2 {
		id := publish(t, s.Pool, "mail.user.created")[0]
		res, err := h.Batch(ctx, 100)
		if err != nil || res.Jobs != 1 {
			t.Fatalf("batch %d: %+v, %v", i, res, err)
		}
		// Far below the workers' hour-long poll.
		select {
		case got := <-w.worked:
			if got != id {
				t.Fatalf("batch %d: worked event %d, want %d", i, got, id)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("batch %d: event %d was not worked within 30 s: no notification reached the workers", i, id)
		}
	}
}
