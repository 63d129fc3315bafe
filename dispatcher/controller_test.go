package dispatcher

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestController runs the concurrency controller through sequences of
// drain-rate samples (events per window) and worker exits ("x").
func TestController(t *testing.T) {
	t.Parallel()
	type step struct {
		rate    int64 // the sample; ignored for an exit
		exit    bool
		want    decision
		workers int // after the step
	}
	s := func(rate int64, want decision, workers int) step {
		return step{rate: rate, want: want, workers: workers}
	}
	x := func(workers int) step { return step{exit: true, want: hold, workers: workers} }
	cases := []struct {
		name  string
		max   int
		start int
		steps []step
	}{
		{"ceiling 1: one worker, never more", 1, 1, []step{s(100, hold, 1), s(200, hold, 1)}},
		{"ceiling 2: starts at the ceiling", 2, 2, []step{s(100, hold, 2), s(500, hold, 2)}},
		{"adds while the rate rises 5 %, retires the first that does not", 10, 2, []step{
			s(100, add, 3),    // first sample: try a third worker
			s(150, add, 4),    // +50 %: keep it, try a fourth
			s(158, add, 5),    // +5.3 %: keep it, try a fifth
			s(160, retire, 4), // +1.3 %: the fifth brought nothing
			s(1000, hold, 4),  // settled: whatever the rate
		}},
		{"exactly +5 % counts as a gain", 10, 2, []step{s(100, add, 3), s(105, add, 4), s(104, retire, 3)}},
		{"a falling rate retires at once", 10, 2, []step{s(100, add, 3), s(80, retire, 2), s(500, hold, 2)}},
		{"stops adding at the ceiling", 4, 2, []step{s(100, add, 3), s(200, add, 4), s(400, hold, 4), s(800, hold, 4)}},
		{"a worker that runs out of work settles it", 10, 2, []step{s(100, add, 3), x(3), s(1000, hold, 3)}},
		{"an exit before the first sample settles it", 10, 2, []step{x(2), s(100, hold, 2)}},
		{"+4.7 % is no gain", 10, 2, []step{s(150, add, 3), s(157, retire, 2)}},
		{"windows in which no batch finished are no evidence against: keep adding", 3, 2, []step{s(0, add, 3), s(0, hold, 3)}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctl := newController(c.max)
			if ctl.workers != c.start {
				t.Fatalf("starts with %d workers, want %d", ctl.workers, c.start)
			}
			for i, st := range c.steps {
				got := hold
				if st.exit {
					ctl.exited()
				} else {
					got = ctl.sample(st.rate)
				}
				if got != st.want || ctl.workers != st.workers {
					t.Fatalf("step %d (rate %d, exit %v): %s with %d workers, want %s with %d", i, st.rate, st.exit, got, ctl.workers, st.want, st.workers)
				}
				if ctl.workers < 1 || ctl.workers > c.max {
					t.Fatalf("step %d: %d workers, outside 1..%d", i, ctl.workers, c.max)
				}
			}
		})
	}
}

// TestNextDueReadsTheClaimIndex: the next due time is read from the first
// entry of the claim index, however many events are scheduled.
func TestNextDueReadsTheClaimIndex(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	for _, q := range []string{
		`INSERT INTO outbox_event (event_type, payload, scheduled_at)
		 SELECT 'mail.user.reminded', '{}', now() + make_interval(secs => 100 + g) FROM generate_series(1, 20000) g`,
		`ANALYZE outbox_event`,
	} {
		if _, err := s.Pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	rows, err := s.Pool.Query(ctx, `EXPLAIN `+nextDueSQL)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	plan := strings.Join(lines, "\n")
	if !strings.Contains(plan, "Limit") || !strings.Contains(plan, "Index Only Scan using outbox_event_claim_idx") {
		t.Fatalf("nextDueSQL does not stop at the first entry of the claim index:\n%s", plan)
	}
	// Without the events due for long: a range of the same index.
	rows, err = s.Pool.Query(ctx, `EXPLAIN `+strings.Replace(nextDueSinceSQL, "$1", "1", 1))
	if err != nil {
		t.Fatal(err)
	}
	lines, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	plan = strings.Join(lines, "\n")
	if !strings.Contains(plan, "Limit") || !strings.Contains(plan, "Index Only Scan using outbox_event_claim_idx") {
		t.Fatalf("nextDueSinceSQL does not stop at the first entry of the claim index:\n%s", plan)
	}
	d := &Dispatcher{pool: s.Pool, logger: slog.New(slog.DiscardHandler)}
	for _, since := range []time.Duration{0, heldGrace} {
		wait, ok := d.nextDue(ctx, since)
		if !ok || wait < 90*time.Second || wait > 102*time.Second {
			t.Fatalf("nextDue(%s) = %s, %v; want about 101 s", since, wait, ok)
		}
	}
	// An event due ten seconds ago (held back behind its key, say) makes
	// the next due time now, unless left out.
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, scheduled_at) VALUES ('mail.user.reminded', '{}', now() - interval '10 seconds')`); err != nil {
		t.Fatal(err)
	}
	if wait, ok := d.nextDue(ctx, 0); !ok || wait != dueFloor {
		t.Fatalf("nextDue(0) with an event due 10 s ago = %s, %v; want %s", wait, ok, dueFloor)
	}
	if wait, ok := d.nextDue(ctx, heldGrace); !ok || wait < 90*time.Second {
		t.Fatalf("nextDue(%s) with an event due 10 s ago = %s, %v; want about 101 s", heldGrace, wait, ok)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'done'`); err != nil {
		t.Fatal(err)
	}
	if wait, ok := d.nextDue(ctx, 0); ok {
		t.Fatalf("nextDue with nothing pending = %s, true; want false", wait)
	}
}
