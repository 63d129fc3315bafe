package listener_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/listener"
)

// A listener whose session is on a read-only node (a fenced old primary
// still answers LISTEN and NOTIFY, so the heartbeat alone would keep it
// there) must drop the session and reconnect, so that target_session_attrs
// can take it to the new primary. Here every session of the listener is
// read-only, so it must keep reconnecting.
func TestListenerLeavesReadOnlyNode(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true, MaxConns: 2})
	ctx := pgtest.Context(t, time.Minute)
	cc, err := pgx.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	cc.RuntimeParams["default_transaction_read_only"] = "on"
	states := make(chan bool, 64)
	l, err := listener.New(listener.Config{
		ConnConfig:     cc,
		Pool:           s.Pool,
		Payload:        s.Name,
		PingInterval:   100 * time.Millisecond,
		ReconnectDelay: 50 * time.Millisecond,
		Logger:         slog.New(stateLog{states}),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Stop(ctx) }()
	want := []bool{true, false, true, false} // connect, leave, connect again, leave again
	for i, w := range want {
		select {
		case got := <-states:
			if got != w {
				t.Fatalf("state change %d: connected=%v, want %v", i, got, w)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("state change %d (connected=%v) did not come: the listener stays on a read-only node", i, w)
		}
	}
}

// stateLog reads the listener's connection state from its log: true for
// every "connected", false for every "disconnected" (the listener logs
// each state change once).
type stateLog struct{ states chan<- bool }

func (stateLog) Enabled(context.Context, slog.Level) bool { return true }
func (h stateLog) WithAttrs([]slog.Attr) slog.Handler     { return h }
func (h stateLog) WithGroup(string) slog.Handler          { return h }

func (h stateLog) Handle(_ context.Context, r slog.Record) error {
	var up bool
	switch {
	case r.Message == "outbox listener connected":
		up = true
	case strings.HasPrefix(r.Message, "outbox listener disconnected"):
		up = false
	default:
		return nil
	}
	select {
	case h.states <- up:
	default:
	}
	return nil
}
