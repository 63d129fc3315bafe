package dispatcher_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// heldKey publishes, in one transaction, head as the first event of key
// "k", then n more events of "k" due at once, and returns their ids (the
// head's first).
func heldKey(t *testing.T, s *pgtest.Schema, head outbox.Event, n int) []int64 {
	t.Helper()
	head.OrderingKey = "k"
	events := []outbox.Event{head}
	for range n {
		events = append(events, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(`{}`), OrderingKey: "k"})
	}
	return publishAll(t, s, events)
}

// claimCounter counts the events the dispatcher's batches claimed.
func claimCounter() (*atomic.Int64, func(claim.Result)) {
	var n atomic.Int64
	return &n, func(r claim.Result) { n.Add(int64(r.Claimed)) }
}

// TestHeldBehindADelayedEventLeavesTheClaim: a key's backlog due at once
// behind its first event, which is delayed, is claimed once and then left
// alone until that event is due (its due time moved to the head's,
// migration 021); before, every poll claimed the whole backlog again
// (10,000 held events: about 16,000 claims a second). The key's events are
// handed off in order once the test makes the head due.
func TestHeldBehindADelayedEventLeavesTheClaim(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 20})
	const n = 300
	// Due well within the hold's minute (so the held events take the
	// head's due time) and far beyond the ten polls below, however slow
	// the machine: the test makes the head due itself.
	due := time.Now().Add(45 * time.Second)
	ids := heldKey(t, s, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(`{"head":true}`), NotBefore: due}, n)
	unrelated := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(`{}`)})[0]
	claimed, onBatch := claimCounter()
	d := start(t, s.Pool, dispatcher.Config{PollInterval: 100 * time.Millisecond, BatchSize: 100, OnBatch: onBatch})
	pgtest.WaitFor(t, 30*time.Second, "the unrelated event handed off", func() bool { return status(t, s.Pool, unrelated) == "done" })
	pgtest.WaitFor(t, 30*time.Second, "the key's events held until the head's due time", func() bool {
		return pgtest.Count(t, s.Pool, `
			SELECT count(*) FROM outbox_event e, outbox_event h
			WHERE h.id = $1 AND e.ordering_key = 'k' AND e.id <> h.id
			  AND e.status = 'pending' AND e.held_from IS NOT NULL AND e.scheduled_at = h.scheduled_at`, ids[0]) == n
	})
	// The batch that held the last events reports (OnBatch) after its
	// commit: count from a poll tick on, which comes after the drain.
	waitPolls(t, d, 1)
	before := claimed.Load()
	waitPolls(t, d, 10)
	if again := claimed.Load() - before; again != 0 {
		t.Fatalf("%d events claimed again in ten polls while the key waits for its delayed head", again)
	}
	// The head made due early: the unhold trigger puts the held events
	// back to their own due time and wakes the dispatcher.
	if _, err := s.Pool.Exec(context.Background(), `UPDATE outbox_event SET scheduled_at = now() WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, 60*time.Second, "every event handed off once the head is due", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'done'`) == n+2
	})
	if k := jobsOutOfKeyOrder(t, s.Pool); k != 0 {
		t.Fatalf("%d jobs of the key inserted after a job of a later position", k)
	}
	if first := firstKeyedJobEvent(t, s.Pool); first != ids[0] {
		t.Fatalf("the key's first job is of event %d, want the head %d", first, ids[0])
	}
}

// TestHeldBehindADeadLetterComeBackWhenItIsCancelled: behind a
// dead-lettered first event (unroutable: failed at once), the key's events
// are claimed once and moved a minute on, not claimed at every poll; an
// operator's cancel of the dead letter puts them back at once, with their
// own due time, and they are handed off long before the minute is over.
func TestHeldBehindADeadLetterComeBackWhenItIsCancelled(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 20})
	const n = 150
	ids := heldKey(t, s, outbox.Event{Type: "nowhere.user.welcome", Payload: json.RawMessage(`{}`)}, n)
	claimed, onBatch := claimCounter()
	d := start(t, s.Pool, dispatcher.Config{PollInterval: 100 * time.Millisecond, BatchSize: 100, OnBatch: onBatch})
	pgtest.WaitFor(t, 30*time.Second, "the head dead-lettered and the key's events held a minute", func() bool {
		return status(t, s.Pool, ids[0]) == "failed" && pgtest.Count(t, s.Pool, `
			SELECT count(*) FROM outbox_event
			WHERE ordering_key = 'k' AND status = 'pending' AND held_from IS NOT NULL
			  AND scheduled_at > now() + interval '30 seconds'`) == n
	})
	// The batch that held the last events reports (OnBatch) after its
	// commit: count from a poll tick on, which comes after the drain.
	waitPolls(t, d, 1)
	before := claimed.Load()
	waitPolls(t, d, 10)
	if again := claimed.Load() - before; again != 0 {
		t.Fatalf("%d events claimed again in ten polls while the key waits for a dead letter", again)
	}
	res, err := admin.New(s.Pool).Cancel(pgtest.Context(t, 30*time.Second), admin.Selection{IDs: ids[:1]}, admin.CancelOpts{Actor: "test"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Affected != 1 {
		t.Fatalf("cancel changed %d events, want 1", res.Affected)
	}
	if k := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE ordering_key = 'k' AND held_from IS NOT NULL`); k != 0 {
		t.Fatalf("%d events still held after the dead letter was cancelled", k)
	}
	pgtest.WaitFor(t, 30*time.Second, "the key's events handed off after the cancel", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE ordering_key = 'k' AND status = 'done'`) == n
	})
}

// TestHeldEventKeepsItsOwnDueTime: an event held behind its key's first
// event, delayed by an hour, is moved a minute on at most (holdFor), and
// gets its own due time back when that event's delay is cut (an earlier
// due time puts the held events back).
func TestHeldEventKeepsItsOwnDueTime(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	ids := heldKey(t, s, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(`{}`), NotBefore: time.Now().Add(time.Hour)}, 1)
	var own time.Time
	if err := s.Pool.QueryRow(ctx, `SELECT scheduled_at FROM outbox_event WHERE id = $1`, ids[1]).Scan(&own); err != nil {
		t.Fatal(err)
	}
	d := start(t, s.Pool, dispatcher.Config{PollInterval: 100 * time.Millisecond})
	pgtest.WaitFor(t, 30*time.Second, "the second event held, a minute on at most", func() bool {
		return pgtest.Count(t, s.Pool, `
			SELECT count(*) FROM outbox_event
			WHERE id = $1 AND held_from IS NOT NULL
			  AND scheduled_at > now() + interval '20 seconds' AND scheduled_at <= now() + interval '61 seconds'`, ids[1]) == 1
	})
	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	// An operator moves the head's due time forward by hand.
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET scheduled_at = now() + interval '10 minutes' WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	var got time.Time
	var held *time.Time
	if err := s.Pool.QueryRow(ctx, `SELECT scheduled_at, held_from FROM outbox_event WHERE id = $1`, ids[1]).Scan(&got, &held); err != nil {
		t.Fatal(err)
	}
	if !got.Equal(own) || held != nil {
		t.Fatalf("the held event is due at %s (held from %v), want its own due time %s back", got, held, own)
	}
}
