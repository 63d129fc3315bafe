package claim_test

import (
	"context"
	"testing"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// BenchmarkBatchOfOne measures one handoff of a single event (the latency
// path at low rates): claim, River insert, mark done, commit. Publishing is
// excluded from the timing.
func BenchmarkBatchOfOne(b *testing.B) {
	s := pgtest.NewSchema(b, nil)
	h := newHandoff(&testing.T{}, s.Pool, 6, nil)
	ctx := context.Background()
	for b.Loop() {
		b.StopTimer()
		if _, err := s.Pool.Exec(ctx, `SELECT outbox_publish('mail.a.b', '{}')`); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		res, err := h.Batch(ctx, 100)
		if err != nil || res.Done != 1 {
			b.Fatalf("%+v %v", res, err)
		}
	}
}

// BenchmarkEmptyPass measures the re-check an idle dispatcher runs.
func BenchmarkEmptyPass(b *testing.B) {
	s := pgtest.NewSchema(b, nil)
	h := newHandoff(&testing.T{}, s.Pool, 6, nil)
	ctx := context.Background()
	for b.Loop() {
		if _, err := h.Batch(ctx, 100); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkBatchOf100 measures one full batch of 100 events (the drain
// path under backlog): claim, 100 River inserts, mark done, commit.
// Publishing is excluded from the timing; events/s = 100 / (ns/op * 1e-9).
func BenchmarkBatchOf100(b *testing.B) {
	benchmarkBatchOf100(b, `SELECT outbox_publish('mail.a.b', '{}') FROM generate_series(1, 100)`)
}

// BenchmarkKeyedBatchOf100 is BenchmarkBatchOf100 with an ordering key on
// every event: a new key for each of the first batch's events, and from the
// second batch on each key's next event, whose job waits behind the key's
// head (the many-keys drain of the bench's ordering scenario).
func BenchmarkKeyedBatchOf100(b *testing.B) {
	benchmarkBatchOf100(b, `SELECT outbox_publish('mail.a.b', '{}', ordering_key => 'k' || g) FROM generate_series(1, 100) g`)
}

// benchmarkBatchOf100 times one Batch after each run of publish, which
// must publish 100 events.
func benchmarkBatchOf100(b *testing.B, publish string) {
	s := pgtest.NewSchema(b, nil)
	h := newHandoff(&testing.T{}, s.Pool, 6, nil)
	ctx := context.Background()
	for b.Loop() {
		b.StopTimer()
		if _, err := s.Pool.Exec(ctx, publish); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		res, err := h.Batch(ctx, 100)
		if err != nil || res.Done != 100 {
			b.Fatalf("%+v %v", res, err)
		}
	}
}
