package config

import (
	"errors"
	"fmt"
	"strings"

	outboxriver "github.com/outboxhq/outbox/river"
)

// Workers are outboxd's River worker settings (docs/configuration.md,
// docs/receivers.md). They are embedded in Config.
//
// A process works the queues of OUTBOX_WORKER_QUEUES, or those of the group
// OUTBOX_WORKER_GROUP picks from OUTBOX_WORKER_GROUPS. Declaring every group
// in OUTBOX_WORKER_GROUPS (the same value for all processes) lets
// `outboxctl stats` report routed queues that no group works.
type Workers struct {
	// WorkerQueues: "outbox_mail:20,outbox_webhook" (ParseQueues).
	WorkerQueues string `envconfig:"OUTBOX_WORKER_QUEUES"`
	// WorkerGroups: "general=outbox_workflow;mail=outbox_mail:20,outbox_webhook"
	// (ParseGroups).
	WorkerGroups string `envconfig:"OUTBOX_WORKER_GROUPS"`
	// WorkerGroup names this process's group in WorkerGroups.
	WorkerGroup string `envconfig:"OUTBOX_WORKER_GROUP"`
	// WorkerHandler is outboxd's built-in handler for the jobs it works:
	// "log" logs each event and completes its job. Required when the
	// process works queues: outboxd cannot run your Go receivers (embed
	// package outboxriver in your service for that).
	WorkerHandler string `envconfig:"OUTBOX_WORKER_HANDLER"`

	groups []Group
	group  Group
}

// BuiltinHandlerLog is the only built-in handler.
const BuiltinHandlerLog = "log"

// WorkerGroupsDeclared returns the groups of OUTBOX_WORKER_GROUPS, or the
// single group of OUTBOX_WORKER_QUEUES, after Validate.
func (w *Workers) WorkerGroupsDeclared() []Group { return w.groups }

// Worked returns this process's worker group, and false when it works no
// queue. Valid after Validate.
func (w *Workers) Worked() (Group, bool) {
	return w.group, len(w.group.Queues) > 0
}

// WorkerLatency returns the client-wide fetch settings of the workers
// (OUTBOX_RIVER_FETCH_COOLDOWN_MS, OUTBOX_RIVER_FETCH_POLL_INTERVAL_MS);
// queues may override them.
func (c *Config) WorkerLatency() outboxriver.WorkerLatency {
	return outboxriver.WorkerLatency{
		FetchCooldown:     ms(c.RiverFetchCooldownMS),
		FetchPollInterval: ms(c.RiverFetchPollIntervalMS),
	}
}

// validateWorkers parses the worker variables; each error names one.
func (c *Config) validateWorkers() []error {
	w := &c.Workers
	w.groups, w.group = nil, Group{}
	var errs []error
	switch {
	case w.WorkerQueues != "" && w.WorkerGroup != "":
		errs = append(errs, errors.New("configuration: set OUTBOX_WORKER_QUEUES or OUTBOX_WORKER_GROUP (with OUTBOX_WORKER_GROUPS), not both"))
	case w.WorkerQueues != "":
		qs, err := ParseQueues(w.WorkerQueues)
		if err != nil {
			errs = append(errs, fmt.Errorf("configuration: OUTBOX_WORKER_QUEUES: %w", err))
			break
		}
		w.group = Group{Name: "workers", Queues: qs}
		w.groups = []Group{w.group}
		if w.WorkerGroups != "" {
			errs = append(errs, errors.New("configuration: OUTBOX_WORKER_QUEUES and OUTBOX_WORKER_GROUPS are both set: declare the groups in OUTBOX_WORKER_GROUPS and pick this process's with OUTBOX_WORKER_GROUP"))
		}
	case w.WorkerGroups != "" || w.WorkerGroup != "":
		if w.WorkerGroups == "" {
			errs = append(errs, fmt.Errorf("configuration: OUTBOX_WORKER_GROUP=%q needs OUTBOX_WORKER_GROUPS, e.g. general=outbox_workflow;mail=outbox_mail,outbox_webhook", w.WorkerGroup))
			break
		}
		groups, err := ParseGroups(w.WorkerGroups)
		if err != nil {
			errs = append(errs, fmt.Errorf("configuration: OUTBOX_WORKER_GROUPS: %w", err))
			break
		}
		w.groups = groups
		if w.WorkerGroup != "" {
			g, ok := FindGroup(groups, w.WorkerGroup)
			if !ok {
				names := make([]string, len(groups))
				for i, g := range groups {
					names[i] = g.Name
				}
				errs = append(errs, fmt.Errorf("configuration: OUTBOX_WORKER_GROUP=%q is not a group of OUTBOX_WORKER_GROUPS (%s)", w.WorkerGroup, strings.Join(names, ", ")))
				break
			}
			w.group = g
		}
	}
	switch w.WorkerHandler {
	case "", BuiltinHandlerLog:
	default:
		errs = append(errs, fmt.Errorf("configuration: OUTBOX_WORKER_HANDLER=%q is not a built-in handler: the only one is log; your own receivers run in your own binary (docs/receivers.md)", w.WorkerHandler))
	}
	if len(w.group.Queues) > 0 {
		if w.WorkerHandler == "" {
			errs = append(errs, fmt.Errorf("configuration: this process would work %s but OUTBOX_WORKER_HANDLER is not set: outboxd cannot run your Go receivers (embed package outboxriver in your service, see docs/receivers.md); set OUTBOX_WORKER_HANDLER=log to log and complete the jobs (demos, routing checks)",
				strings.Join(w.group.QueueNames(), ", ")))
		}
		if c.DatabaseURL == "" && !c.DispatcherEnabled {
			errs = append(errs, errors.New("configuration: DATABASE_URL is required to run River workers"))
		}
	}
	return errs
}
