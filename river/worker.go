package outboxriver

import (
	"time"

	"github.com/riverqueue/river"
)

// WorkerLatency are the fetch settings of a River client that works outbox
// queues. Zero values take the outbox's defaults (DefaultFetchCooldown,
// DefaultFetchPollInterval), not River's (100 ms and 1 s), which would add
// up to a second between the handoff and the worker.
type WorkerLatency struct {
	FetchCooldown     time.Duration
	FetchPollInterval time.Duration
}

func (l WorkerLatency) withDefaults() WorkerLatency {
	if l.FetchCooldown == 0 {
		l.FetchCooldown = DefaultFetchCooldown
	}
	if l.FetchPollInterval == 0 {
		l.FetchPollInterval = max(DefaultFetchPollInterval, l.FetchCooldown)
	}
	return l
}

// WorkerConfig returns a River client config that works the given queues
// (name → MaxWorkers) with workers, using the outbox's latency defaults.
// Callers may set further fields before river.NewClient. QueuesConfig does
// the same with per-queue fetch settings.
func WorkerConfig(workers *river.Workers, queues map[string]int, lat WorkerLatency) *river.Config {
	qs := make([]Queue, 0, len(queues))
	for name, n := range queues {
		qs = append(qs, Queue{Name: name, MaxWorkers: n})
	}
	return QueuesConfig(workers, qs, lat)
}
