package dispatcher_test

import (
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestHotKeyBacklogIsNotClaimedOverAndOver: a backlog of one ordering key
// drained with several batches in flight. Only one batch at a time can
// hand the key's events off (each waits for the one before it), so the
// others find their events held back. They must stop and let the batch in
// flight go on with those events, not claim the rest of the backlog and
// give it back: before, every batch of every drain claimed the remaining
// backlog, tens of claims of each event. Every event is handed off, its
// jobs in position order.
func TestHotKeyBacklogIsNotClaimedOverAndOver(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 20})
	ctx := pgtest.Context(t, 120*time.Second)
	const n, batch = 3000, 100
	events := make([]outbox.Event, n)
	for i := range events {
		events[i] = outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(`{}`), OrderingKey: "hot"}
	}
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := outbox.PublishMany(ctx, tx, events)
		return err
	}); err != nil {
		t.Fatal(err)
	}

	var (
		mu              sync.Mutex
		claimed, handed int
	)
	start(t, s.Pool, dispatcher.Config{
		PollInterval: time.Hour, Concurrency: 8, BatchSize: batch,
		OnBatch: func(r claim.Result) {
			mu.Lock()
			claimed += r.Claimed
			handed += r.Done
			mu.Unlock()
		},
	})
	pgtest.WaitFor(t, 90*time.Second, "every event handed off", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'done'`) == n
	})
	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d events handed off, %d claims (%.1f per event)", handed, claimed, float64(claimed)/float64(n))
	if handed != n {
		t.Fatalf("batches report %d events handed off, want %d", handed, n)
	}
	// Each batch in flight beside the one that hands off claims at most a
	// batch of held-back events before it stops; 3 claims per event is
	// far above what a drain needs and far below the old behaviour.
	if claimed > 3*n {
		t.Fatalf("%d claims of %d events: the backlog was claimed and given back over and over", claimed, n)
	}
	if v := pgtest.Count(t, s.Pool, `
		SELECT count(*) FROM (
		    SELECT (j.metadata->>'outbox_ordering_position')::bigint AS pos,
		           lag((j.metadata->>'outbox_ordering_position')::bigint) OVER (ORDER BY j.id) AS prev
		    FROM river_job j) x
		WHERE x.pos <= x.prev`); v != 0 {
		t.Fatalf("%d River jobs inserted out of position order", v)
	}
}
