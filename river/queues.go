package outboxriver

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
)

// DefaultMaxWorkers is a queue's MaxWorkers when none is given.
const DefaultMaxWorkers = 10

// Queue is one River queue that a worker group works.
type Queue struct {
	// Name is the River queue name (the route's queue).
	Name string
	// MaxWorkers is the most jobs of this queue the client runs at once.
	// 0 means DefaultMaxWorkers. River allows 1 to 10000.
	MaxWorkers int
	// FetchCooldown overrides the client's for this queue; 0 keeps the
	// client's (WorkerLatency).
	FetchCooldown time.Duration
	// FetchPollInterval overrides the client's for this queue; 0 keeps the
	// client's.
	FetchPollInterval time.Duration
}

// QueuesConfig returns a River client config that works queues with
// workers, using the outbox's latency defaults (WorkerLatency) for the
// client and each Queue's overrides, TraceMiddleware (the work of a job
// continues its producer's trace) and NewOrderedCompletionMiddleware (the
// next job of an ordering key starts as soon as the one before it ends). Callers may set further fields (Logger,
// ErrorHandler, ID, ...) before river.NewClient, and append River's
// OpenTelemetry middleware to Middleware (after TraceMiddleware).
func QueuesConfig(workers *river.Workers, queues []Queue, lat WorkerLatency) *river.Config {
	lat = lat.withDefaults()
	qs := make(map[string]river.QueueConfig, len(queues))
	for _, q := range queues {
		n := q.MaxWorkers
		if n == 0 {
			n = DefaultMaxWorkers
		}
		qc := river.QueueConfig{MaxWorkers: n, FetchCooldown: q.FetchCooldown, FetchPollInterval: q.FetchPollInterval}
		// River refuses a poll interval below the cooldown; a queue that
		// only lowers its poll interval, or only raises its cooldown, is
		// kept consistent here.
		cooldown := q.FetchCooldown
		if cooldown == 0 {
			cooldown = lat.FetchCooldown
		}
		poll := q.FetchPollInterval
		if poll == 0 {
			poll = lat.FetchPollInterval
		}
		if poll < cooldown {
			qc.FetchPollInterval = cooldown
		}
		qs[q.Name] = qc
	}
	return &river.Config{
		FetchCooldown:     lat.FetchCooldown,
		FetchPollInterval: lat.FetchPollInterval,
		Queues:            qs,
		Workers:           workers,
		Middleware:        []rivertype.Middleware{NewTraceMiddleware(), NewOrderedCompletionMiddleware()},
	}
}

// GroupClientID returns a River client ID that names the group, the host
// and the process, "<group>_<host>_<pid>", at most 100 characters (River's
// limit). River records it in each job's attempted_by, so a job shows
// which group and process ran it (`outboxctl explain`).
func GroupClientID(group string) string {
	host, _ := os.Hostname()
	if host == "" {
		host = "unknown_host"
	}
	host = strings.NewReplacer(".", "_", "-", "_").Replace(host)
	id := fmt.Sprintf("%s_%s_%d", group, host, os.Getpid())
	if len(id) > 100 {
		id = fmt.Sprintf("%s_%d", group[:min(len(group), 60)], os.Getpid())
	}
	return id
}
