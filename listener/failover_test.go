package listener_test

import (
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
		OnStateChange: func(up bool) {
			select {
			case states <- up:
			default:
			}
		},
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
