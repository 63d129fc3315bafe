package outboxriver_test

import (
	"testing"
	"time"

	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

func TestQueuesConfigKeepsRiverValid(t *testing.T) {
	t.Parallel()
	workers := river.NewWorkers()
	river.AddWorker(workers, outboxriver.NewWorker(outboxriver.NewHandlers(), outboxriver.WorkerOptions{Logger: quiet}))
	cfg := outboxriver.QueuesConfig(workers, []outboxriver.Queue{
		{Name: "a"},
		{Name: "b", MaxWorkers: 3, FetchCooldown: 500 * time.Millisecond}, // above the client's 100 ms poll
		{Name: "c", FetchPollInterval: 2 * time.Second},
	}, outboxriver.WorkerLatency{})
	if cfg.Queues["a"].MaxWorkers != outboxriver.DefaultMaxWorkers || cfg.Queues["b"].MaxWorkers != 3 {
		t.Errorf("max workers: %+v", cfg.Queues)
	}
	if cfg.Queues["b"].FetchPollInterval != 500*time.Millisecond {
		t.Errorf("queue b's poll interval %s was not raised to its cooldown", cfg.Queues["b"].FetchPollInterval)
	}
	if cfg.FetchCooldown != outboxriver.DefaultFetchCooldown || cfg.FetchPollInterval != outboxriver.DefaultFetchPollInterval {
		t.Errorf("client latency %s/%s", cfg.FetchCooldown, cfg.FetchPollInterval)
	}
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true})
	if _, err := river.NewClient(riverDriver(s), cfg); err != nil {
		t.Errorf("River refuses the config: %v", err)
	}
}
