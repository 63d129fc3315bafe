package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestPublishRefusesBadOrderingKey: an ordering key past 256 bytes, with a
// NUL byte or not valid UTF-8 is refused by Publish and PublishMany with a
// *ValidationError naming the field OrderingKey (and the event's index),
// before anything is written; the transaction stays usable and commits the
// good events. A key of exactly 256 bytes is stored.
func TestPublishRefusesBadOrderingKey(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	bad := map[string]string{
		"257 bytes":     strings.Repeat("k", 257),
		"NUL byte":      "order\x0042",
		"invalid UTF-8": "order\xff42",
	}
	for name, key := range bad {
		err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			if _, err := outbox.Publish(ctx, tx, outbox.Event{Type: "order.item.added", OrderingKey: "good"}); err != nil {
				return err
			}
			_, err := outbox.Publish(ctx, tx, outbox.Event{Type: "order.item.added", OrderingKey: key})
			var ve *outbox.ValidationError
			if !errors.As(err, &ve) || ve.Field != "OrderingKey" || ve.Index != 0 || !errors.Is(err, outbox.ErrInvalidEvent) {
				t.Errorf("%s: Publish err = %v, want a ValidationError for OrderingKey", name, err)
			}
			_, err = outbox.PublishMany(ctx, tx, []outbox.Event{{Type: "order.item.added", OrderingKey: "good"}, {Type: "order.item.added", OrderingKey: key}})
			if !errors.As(err, &ve) || ve.Field != "OrderingKey" || ve.Index != 1 {
				t.Errorf("%s: PublishMany err = %v, want a ValidationError for OrderingKey of event 1", name, err)
			}
			// The transaction is still usable.
			_, err = outbox.Publish(ctx, tx, outbox.Event{Type: "order.item.added", OrderingKey: strings.Repeat("é", 128)})
			return err
		})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	var n, keyed, longest int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*), count(ordering_position), max(octet_length(ordering_key)) FROM outbox_event`).Scan(&n, &keyed, &longest); err != nil {
		t.Fatal(err)
	}
	if n != 2*len(bad) || keyed != n || longest != outbox.MaxOrderingKeyBytes {
		t.Fatalf("%d events stored (%d with a position, longest key %d bytes), want %d, all positioned, longest %d", n, keyed, longest, 2*len(bad), outbox.MaxOrderingKeyBytes)
	}
}

// positionOf returns the ordering position of event id (0 when it has none).
func positionOf(t *testing.T, pool *pgxpool.Pool, id int64) int64 {
	t.Helper()
	var pos *int64
	if err := pool.QueryRow(context.Background(), `SELECT ordering_position FROM outbox_event WHERE id = $1`, id).Scan(&pos); err != nil {
		t.Fatal(err)
	}
	if pos == nil {
		return 0
	}
	return *pos
}

// TestOrderingPositionsFollowPublishOrder: within one transaction, the
// positions of a key follow the order of the Publish and PublishMany calls
// and the order of the events inside a PublishMany, whatever other keys
// are published in between. Events without a key get no position.
func TestOrderingPositionsFollowPublishOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	var a, b, none []int64
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		for i := range 2 {
			r, err := outbox.Publish(ctx, tx, outbox.Event{Type: "order.item.added", OrderingKey: "a"})
			if err != nil {
				return err
			}
			a = append(a, r.ID)
			if i == 0 {
				r, err = outbox.Publish(ctx, tx, outbox.Event{Type: "order.item.added", OrderingKey: "b"})
				if err != nil {
					return err
				}
				b = append(b, r.ID)
			}
		}
		res, err := outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "order.item.added", OrderingKey: "b"},
			{Type: "order.item.added", OrderingKey: "a"},
			{Type: "order.item.added"},
			{Type: "order.item.added", OrderingKey: "a"},
			{Type: "order.item.added", OrderingKey: "b"},
		})
		if err != nil {
			return err
		}
		b = append(b, res[0].ID, res[4].ID)
		a = append(a, res[1].ID, res[3].ID)
		none = append(none, res[2].ID)
		r, err := outbox.Publish(ctx, tx, outbox.Event{Type: "order.item.added", OrderingKey: "a"})
		a = append(a, r.ID)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for key, ids := range map[string][]int64{"a": a, "b": b} {
		var prev int64
		for i, id := range ids {
			pos := positionOf(t, s.Pool, id)
			if pos <= prev {
				t.Errorf("key %s: publish %d (event %d) has position %d, not after %d", key, i, id, pos, prev)
			}
			prev = pos
		}
	}
	if pos := positionOf(t, s.Pool, none[0]); pos != 0 {
		t.Errorf("the event without a key has position %d", pos)
	}
}

// waitsForLock reports whether the backend pid waits for an advisory lock
// (the ordering key's lock of migration 011).
func waitsForLock(t *testing.T, pool *pgxpool.Pool, pid uint32) bool {
	t.Helper()
	return pgtest.Count(t, pool, `SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND NOT granted`, int32(pid)) > 0
}

// publishAsync publishes ev in tx on a goroutine owned by the test and
// returns a channel that receives the result once Publish returns.
func publishAsync(t *testing.T, ctx context.Context, tx pgx.Tx, ev outbox.Event) <-chan publishResult {
	t.Helper()
	done := make(chan publishResult, 1)
	go func() {
		r, err := outbox.Publish(ctx, tx, ev)
		done <- publishResult{r, err}
	}()
	return done
}

type publishResult struct {
	outbox.Published
	err error
}

// TestConcurrentProducersOfAKeySerializeInCommitOrder: while a transaction
// holds events of a key, a second transaction's Publish to the same key
// (same tenant) blocks on the key's lock until the first commits, and then
// gets a position after every event of the first, including one the first
// published while the second waited: positions follow commit order. Other
// keys, the same key of another tenant, and events without a key do not
// block meanwhile. A rolled-back transaction releases the key.
func TestConcurrentProducersOfAKeySerializeInCommitOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 6})
	ctx := pgtest.Context(t, 90*time.Second)

	begin := func() pgx.Tx {
		tx, err := s.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		return tx
	}
	ev := func(tenant, key string) outbox.Event {
		return outbox.Event{Type: "order.item.added", TenantID: tenant, OrderingKey: key}
	}

	first := begin()
	f1, err := outbox.Publish(ctx, first, ev("acme", "order-42"))
	if err != nil {
		t.Fatal(err)
	}
	second := begin()
	secondPID := second.Conn().PgConn().PID()
	blocked := publishAsync(t, ctx, second, ev("acme", "order-42"))
	pgtest.WaitFor(t, 30*time.Second, "the second producer to wait for the key's lock", func() bool {
		return waitsForLock(t, s.Pool, secondPID)
	})
	select {
	case r := <-blocked:
		t.Fatalf("the second Publish of the key returned (%+v, %v) while the first transaction was open", r.Published, r.err)
	default:
	}

	// Other keys, another tenant's same key and unkeyed events go on.
	others := begin()
	for _, e := range []outbox.Event{ev("acme", "order-43"), ev("globex", "order-42"), ev("", "order-42"), {Type: "order.item.added"}} {
		select {
		case r := <-publishAsync(t, ctx, others, e):
			if r.err != nil {
				t.Fatalf("publish %+v: %v", e, r.err)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("publish of tenant %q key %q blocked behind another key", e.TenantID, e.OrderingKey)
		}
	}
	if err := others.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	// The first transaction publishes again while the second waits, then
	// commits: the second gets the next position.
	f2, err := outbox.Publish(ctx, first, ev("acme", "order-42"))
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var s1 publishResult
	select {
	case s1 = <-blocked:
	case <-time.After(30 * time.Second):
		t.Fatal("the second Publish did not return within 30 s of the first commit")
	}
	if s1.err != nil {
		t.Fatal(s1.err)
	}
	if err := second.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	p1, p2, p3 := positionOf(t, s.Pool, f1.ID), positionOf(t, s.Pool, f2.ID), positionOf(t, s.Pool, s1.ID)
	if p1 >= p2 || p2 >= p3 {
		t.Errorf("positions: first tx %d, %d; second tx %d; want the second's after both of the first's", p1, p2, p3)
	}

	// A rollback releases the key.
	third := begin()
	if _, err := outbox.Publish(ctx, third, ev("acme", "order-42")); err != nil {
		t.Fatal(err)
	}
	fourth := begin()
	fourthPID := fourth.Conn().PgConn().PID()
	waiting := publishAsync(t, ctx, fourth, ev("acme", "order-42"))
	pgtest.WaitFor(t, 30*time.Second, "the fourth producer to wait for the key's lock", func() bool {
		return waitsForLock(t, s.Pool, fourthPID)
	})
	if err := third.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	var s4 publishResult
	select {
	case s4 = <-waiting:
	case <-time.After(30 * time.Second):
		t.Fatal("the key stayed locked after a rollback")
	}
	if s4.err != nil {
		t.Fatal(s4.err)
	}
	if err := fourth.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if p4 := positionOf(t, s.Pool, s4.ID); p4 <= p3 {
		t.Errorf("the event published after the rollback has position %d, not after %d", p4, p3)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE tenant_id = 'acme' AND ordering_key = 'order-42'`); n != 4 {
		t.Errorf("%d events of acme/order-42 stored, want 4 (the rolled-back one is gone)", n)
	}
}
