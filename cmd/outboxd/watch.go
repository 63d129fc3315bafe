package main

import (
	"context"
	"fmt"
	"time"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/internal/service"
)

// listenerWatch runs watchListener as a service (internal/service).
type listenerWatch struct {
	d           listenerState
	al          alert.Alerter
	after, tick time.Duration
	life        service.Lifecycle
}

// Start starts the watch.
func (w *listenerWatch) Start(ctx context.Context) error {
	return w.life.Go(ctx, func(run, _ context.Context) { watchListener(run, w.d, w.al, w.after, w.tick) })
}

// Stop stops the watch and waits for it.
func (w *listenerWatch) Stop(ctx context.Context) error { return w.life.Stop(ctx) }

// listenerState is what watchListener needs of the dispatcher.
type listenerState interface {
	Running() bool
	ListenerConnected() bool
}

// watchListener raises alert.ListenerDisconnected once when the LISTEN
// connection has been down for longer than after while the dispatcher runs
// (events are still dispatched by the poll fallback, at poll latency), and
// logs nothing more until it has reconnected. It returns when ctx ends.
// tick is the sampling period.
func watchListener(ctx context.Context, d listenerState, al alert.Alerter, after, tick time.Duration) {
	t := time.NewTicker(tick)
	defer t.Stop()
	var downSince time.Time
	alerted := false
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if !d.Running() || d.ListenerConnected() {
				downSince, alerted = time.Time{}, false
				continue
			}
			if downSince.IsZero() {
				downSince = now
			}
			if !alerted && now.Sub(downSince) >= after {
				alerted = true
				al.Alert(ctx, alert.Alert{
					Reason:  alert.ListenerDisconnected,
					Message: fmt.Sprintf("the LISTEN connection has been down for %s; events are dispatched by polling only (check the database, or a PgBouncer in transaction mode: then set OUTBOX_LISTEN_ENABLED=false)", now.Sub(downSince).Round(time.Second)),
				})
			}
		}
	}
}
