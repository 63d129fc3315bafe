// Package alert is the one small interface through which the outbox raises
// alerts: an unroutable event, a dead-lettered event, a dispatcher loop that
// keeps failing, a listener that stays disconnected, a parked ordering key.
//
// Log is the implementation used when no other is configured. Alerts carry
// ids, types, the tenant, the ordering key and the error, never the
// payload.
package alert

import (
	"context"
	"log/slog"
)

// Reason classifies an alert.
type Reason string

// The reasons the outbox raises.
const (
	// Unroutable: no route matches the event's type; the event is failed.
	Unroutable Reason = "unroutable"
	// DeadLetter: the event failed more than OUTBOX_MAX_RETRIES times.
	DeadLetter Reason = "dead_letter"
	// DispatcherFailing: consecutive dispatch passes keep failing.
	DispatcherFailing Reason = "dispatcher_failing"
	// ListenerDisconnected: the LISTEN connection has been down for a while.
	ListenerDisconnected Reason = "listener_disconnected"
	// NoHandler: a River worker got an outbox job whose event type no
	// registered handler matches; the job fails and River retries it.
	NoHandler Reason = "no_handler"
	// SynchronousCommitOff: at start-up, synchronous_commit is off or local
	// for the session or a database or role default, while the handoff
	// commits asynchronously and relies on River workers committing
	// synchronously (docs/architecture.md, "Commit durability").
	SynchronousCommitOff Reason = "synchronous_commit_off"
	// RoutesOutOfSync: the routes synced into the database (outboxctl routes
	// sync, strict routing) differ from outboxd's routes file.
	RoutesOutOfSync Reason = "routes_out_of_sync"
	// ParkedKey: the head job of an ordering key was discarded, cancelled
	// or deleted, so the key is parked: its later jobs wait until an
	// operator retries or skips the head (outboxctl keys, outboxctl
	// unpark). Raised once per newly parked key (tenant, key, queue).
	ParkedKey Reason = "parked_key"
)

// Alert is one alert.
type Alert struct {
	Reason    Reason
	Message   string
	EventID   int64
	EventType string
	TenantID  string
	Retries   int
	Err       string
	// OrderingKey, Queue and JobID say which key is parked, in which River
	// queue, and its head job (ParkedKey); EventID is the head's event.
	OrderingKey string
	Queue       string
	JobID       int64
}

// Alerter raises alerts. Implementations must be safe for concurrent use
// and must not block for long (the dispatcher calls them after commits).
type Alerter interface {
	Alert(ctx context.Context, a Alert)
}

// Log is an Alerter that writes alerts to a structured logger at error level.
type Log struct {
	Logger *slog.Logger
}

// Alert implements Alerter.
func (l Log) Alert(ctx context.Context, a Alert) {
	logger := l.Logger
	if logger == nil {
		logger = slog.Default()
	}
	attrs := []slog.Attr{slog.String("reason", string(a.Reason))}
	if a.EventID != 0 {
		attrs = append(attrs, slog.Int64("event_id", a.EventID))
	}
	if a.EventType != "" {
		attrs = append(attrs, slog.String("event_type", a.EventType))
	}
	if a.TenantID != "" {
		attrs = append(attrs, slog.String("tenant_id", a.TenantID))
	}
	if a.OrderingKey != "" {
		attrs = append(attrs, slog.String("ordering_key", a.OrderingKey))
	}
	if a.Queue != "" {
		attrs = append(attrs, slog.String("queue", a.Queue))
	}
	if a.JobID != 0 {
		attrs = append(attrs, slog.Int64("job_id", a.JobID))
	}
	if a.Retries != 0 {
		attrs = append(attrs, slog.Int("retries", a.Retries))
	}
	if a.Err != "" {
		attrs = append(attrs, slog.String("error", a.Err))
	}
	logger.LogAttrs(ctx, slog.LevelError, "outbox alert: "+a.Message, attrs...)
}

// Func adapts a function to Alerter.
type Func func(ctx context.Context, a Alert)

// Alert implements Alerter.
func (f Func) Alert(ctx context.Context, a Alert) { f(ctx, a) }
