package dispatcher_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestLightStreamCostsOnePassPerWake: events that each find the dispatcher
// idle are handed off by one claim transaction per wake. The dispatcher
// keeps the wake lock through the handoff and goes back to sleep with it
// (state armed), instead of releasing it, lingering, passing once more,
// taking the lock again and re-checking: three claim transactions per
// event before.
func TestLightStreamCostsOnePassPerWake(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	batches := make(chan claim.Result, 16)
	d := start(t, s.Pool, dispatcher.Config{
		PollInterval: time.Hour,
		OnBatch:      func(r claim.Result) { batches <- r },
	})
	pgtest.WaitFor(t, 10*time.Second, "listener to connect", d.ListenerConnected)
	idle := idleWithWakeLock(t, s)
	pgtest.WaitFor(t, 20*time.Second, "the dispatcher idle, holding the wake lock", idle)
	// The re-check after taking the lock may still be running: wait until
	// the pass count holds still.
	settled := func() int64 {
		prev := d.Stats().Passes
		for {
			time.Sleep(300 * time.Millisecond)
			cur := d.Stats().Passes
			if cur == prev {
				return cur
			}
			prev = cur
		}
	}
	before, wakes := settled(), d.Stats().Wakes

	const n = 6
	for i := range n {
		ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(fmt.Sprintf(`{"i":%d}`, i))})
		select {
		case r := <-batches:
			if r.Done != 1 {
				t.Fatalf("batch handed off %d events, want 1", r.Done)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("event %d not handed off within 20s with an hour's poll interval", ids[0])
		}
		if !idle() {
			// The lock was never given up: it is held at once, not after
			// a linger and a new acquisition.
			t.Fatalf("event %d: the wake lock is not held right after its handoff", ids[0])
		}
	}
	after := settled()
	st := d.Stats()
	if got := st.Wakes - wakes; got != n {
		t.Fatalf("%d wakes for %d events published one at a time, want %d (stats %+v)", got, n, n, st)
	}
	if got := after - before; got != n {
		t.Fatalf("%d claim transactions for %d events that each found the dispatcher idle, want one per event (stats %+v)", got, n, st)
	}
	assertLedger(t, s.Pool, testRoutes(t))
}
