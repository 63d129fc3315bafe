package outboxriver_test

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func testRoutes(t *testing.T) *route.Table {
	t.Helper()
	tbl, err := route.New([]route.Rule{
		{Prefix: "mail.", Queues: []string{"outbox_mail"}},
		{Prefix: "webhook.", Queues: []string{"outbox_webhook"}},
		{Prefix: "audit.", Queues: []string{"outbox_audit"}},
		{Prefix: "plugin.hook.", Queues: []string{"outbox_plugin-hook", "outbox_audit"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return tbl
}

// handoff runs the dispatcher's batch once: every due event becomes its
// River jobs, exactly as outboxd does it.
func handoff(t *testing.T, pool *pgxpool.Pool, routes *route.Table) claim.Result {
	t.Helper()
	h := &claim.Handoff{Pool: pool, Routes: routes, MaxRetries: 6, Alerter: alert.Func(func(context.Context, alert.Alert) {})}
	res, err := h.Batch(context.Background(), 1000)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// soonRetry retries a failed job 50 ms later, so that retry tests do not
// wait for River's default backoff (1 s and more).
type soonRetry struct{}

func (soonRetry) NextRetry(*rivertype.JobRow) time.Time { return time.Now().Add(50 * time.Millisecond) }

// startWorkers starts a River client working queues with an outbox Worker
// over handlers, and stops it when the test ends.
func startWorkers(t *testing.T, pool *pgxpool.Pool, handlers *outboxriver.Handlers, alerter alert.Alerter, queues ...string) *river.Client[pgx.Tx] {
	t.Helper()
	workers := river.NewWorkers()
	river.AddWorker(workers, outboxriver.NewWorker(handlers, outboxriver.WorkerOptions{Alerter: alerter, Logger: quiet}))
	qs := make([]outboxriver.Queue, len(queues))
	for i, q := range queues {
		qs[i] = outboxriver.Queue{Name: q, MaxWorkers: 4}
	}
	return startClient(t, pool, outboxriver.QueuesConfig(workers, qs, outboxriver.WorkerLatency{}))
}

// startClient starts a River client with cfg (quiet, retrying soon) and
// stops it when the test ends.
func startClient(t *testing.T, pool *pgxpool.Pool, cfg *river.Config) *river.Client[pgx.Tx] {
	t.Helper()
	cfg.Logger = quiet
	cfg.RetryPolicy = soonRetry{}
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := client.Stop(ctx); err != nil {
			t.Errorf("stop River client: %v", err)
		}
	})
	return client
}

// alerts collects alerts.
type alerts struct {
	mu  sync.Mutex
	got []alert.Alert
}

func (a *alerts) Alert(_ context.Context, al alert.Alert) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.got = append(a.got, al)
}

func (a *alerts) all() []alert.Alert {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]alert.Alert(nil), a.got...)
}

func riverDriver(s *pgtest.Schema) *riverpgxv5.Driver { return riverpgxv5.New(s.Pool) }
