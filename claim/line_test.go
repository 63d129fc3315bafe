package claim

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

// TestHandoffWritesTheKeysLine hands the same ordered batches off three
// ways: as outbox_dispatcher with migration 025 (the statement writes the
// line rows of a key's later jobs itself, handoffLineSQL), as
// outbox_dispatcher without INSERT on the line, and as the owner on a
// schema that does not record 025 (both through River's insert and the
// enqueue trigger for every job, as before 025). A BEFORE INSERT trigger of
// the test's own on river_job counts the jobs that went through River's
// insert: one per key and queue of a batch, and the unkeyed job, with the
// line written by the statement; every job without. The line rows must be
// the same in all three, and the keys' jobs must then be released and run
// one at a time in position order.
func TestHandoffWritesTheKeysLine(t *testing.T) {
	t.Parallel()
	routes, err := route.New([]route.Rule{
		{Prefix: "shop.", Queues: []string{"outbox_shop"}},
		{Prefix: "fan.", Queues: []string{"outbox_a", "outbox_b"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	// The first batch: key k (4 events), key l (2), key k of tenant t2 (2),
	// key f fanned out to two queues (2), one event without a key. The
	// second: 2 more events of k, whose head is then the first batch's.
	first := []outbox.Event{
		{Type: "shop.order.paid", OrderingKey: "k"},
		{Type: "shop.order.paid", OrderingKey: "l"},
		{Type: "shop.order.paid", OrderingKey: "k"},
		{Type: "shop.order.paid", OrderingKey: "k", TenantID: "t2"},
		{Type: "fan.order.paid", OrderingKey: "f"},
		{Type: "shop.order.paid"},
		{Type: "shop.order.paid", OrderingKey: "k"},
		{Type: "shop.order.paid", OrderingKey: "l"},
		{Type: "fan.order.paid", OrderingKey: "f"},
		{Type: "shop.order.paid", OrderingKey: "k", TenantID: "t2"},
		{Type: "shop.order.paid", OrderingKey: "k"},
	}
	second := []outbox.Event{
		{Type: "shop.order.paid", OrderingKey: "k"},
		{Type: "shop.order.paid", OrderingKey: "k"},
	}
	const jobs = 13 // 11 events, the two of key f with a job in each of two queues

	cases := []struct {
		name string
		// setup changes the schema as the owner; pool picks the
		// handoff's pool.
		setup string
		role  bool
		// throughRiver is how many jobs go through River's insert in
		// the first and second batch.
		throughRiver [2]int
	}{
		// First batch: the heads of k, l, t2/k, f@a, f@b and the unkeyed
		// job; second: the first job of k, which waits behind k's head.
		{name: "line written by the statement", role: true, throughRiver: [2]int{6, 1}},
		{name: "no INSERT on the line", role: true, throughRiver: [2]int{jobs, 2},
			setup: `REVOKE INSERT ON outbox_ordering_wait FROM outbox_dispatcher`},
		{name: "before migration 025", throughRiver: [2]int{jobs, 2},
			setup: `DELETE FROM outbox_schema_migration WHERE version >= 25`},
	}
	lines := make([]string, len(cases))
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := pgtest.NewSchema(t, nil)
			ctx := pgtest.Context(t, 60*time.Second)
			if _, err := s.Pool.Exec(ctx, `
				CREATE TABLE seen (job_id bigint);
				CREATE FUNCTION seen_job() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
				SET search_path = `+s.Name+` AS $$
				BEGIN
				    INSERT INTO seen VALUES (NEW.id);
				    RETURN NEW;
				END $$;
				-- Named to run before outbox_ordering_enqueue (triggers run
				-- in name order), so that it sees the jobs the line takes.
				CREATE TRIGGER a_seen BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION seen_job()`); err != nil {
				t.Fatal(err)
			}
			if c.setup != "" {
				if _, err := s.Pool.Exec(ctx, c.setup); err != nil {
					t.Fatal(err)
				}
			}
			pool := s.Pool
			if c.role {
				pool = pgtest.RolePool(t, s, "outbox_dispatcher")
			}
			// goOnly: the Go handoff, which a walk's batches use (the
			// one-statement claim keeps the trigger for every job).
			h := &Handoff{Pool: pool, Routes: routes, MaxRetries: 6, goOnly: true}

			for b, events := range [][]outbox.Event{first, second} {
				pgtest.Publish(t, s.Pool, events...)
				res, err := h.Batch(ctx, 100)
				want := jobs
				if b == 1 {
					want = len(events)
				}
				if err != nil || res.Done != len(events) || res.Jobs != want {
					t.Fatalf("batch %d: %+v, %v; want %d events done, %d jobs", b+1, res, err, len(events), want)
				}
				if got := pgtest.Count(t, s.Pool, `SELECT count(*) FROM seen`); got != sum(c.throughRiver[:b+1]) {
					t.Fatalf("after batch %d, %d jobs went through River's insert, want %d", b+1, got, sum(c.throughRiver[:b+1]))
				}
			}

			// Waiting jobs: k 5 (3 of the first batch, 2 of the second),
			// l 1, t2/k 1, f 1 in each queue; each with its event's id,
			// the job id recorded in the event, its position, and the
			// columns of the head it waits behind.
			if got := pgtest.Count(t, s.Pool, `
				SELECT count(*) FROM outbox_ordering_wait w
				JOIN outbox_event e ON e.id = w.event_id
				JOIN outbox_ordering_key k ON (k.tenant_id, k.ordering_key, k.queue) = (w.tenant_id, w.ordering_key, w.queue)
				JOIN river_job r ON r.id = k.head_job_id
				WHERE w.job_id = ANY (e.river_job_ids) AND w.job_id <> r.id AND w.position = e.ordering_position
				  AND w.tenant_id = coalesce(e.tenant_id, '') AND w.ordering_key = e.ordering_key
				  AND (w.metadata->>'outbox_event_id')::bigint = e.id AND w.metadata->>'outbox_ordering_key' = e.ordering_key
				  AND (w.args->>'event_id')::bigint = e.id AND w.kind = r.kind AND w.max_attempts = r.max_attempts
				  AND w.priority = r.priority AND w.tags = r.tags AND w.created_at IS NOT NULL`); got != 9 {
				t.Errorf("%d line rows match their events and keys' heads, want 9", got)
			}
			if err := s.Pool.QueryRow(ctx, `
				SELECT jsonb_agg(to_jsonb(w) - 'since' - 'created_at' || jsonb_build_object('args', w.args - 'created_at')
				                 ORDER BY w.tenant_id, w.ordering_key, w.queue, w.position)::text
				FROM outbox_ordering_wait w`).Scan(&lines[i]); err != nil {
				t.Fatal(err)
			}

			runInOrder(t, ctx, s.Pool, jobs+len(second))
		})
	}
	for i := 1; i < len(cases); i++ {
		if lines[i] != lines[0] {
			t.Errorf("the line differs %s and %s:\n%s\n%s", cases[0].name, cases[i].name, lines[0], lines[i])
		}
	}
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}

// runInOrder completes River's available jobs one at a time, as a worker
// would, until want jobs are completed. Each completion releases the next
// job of its key (the release trigger); at every step a key has at most
// one job in River that is not completed, and each key's jobs complete in
// position order. It ends with the line and the keys empty.
func runInOrder(t *testing.T, ctx context.Context, pool *pgxpool.Pool, want int) {
	t.Helper()
	last := map[string]int64{}
	for done := 0; done < want; done++ {
		if n := pgtest.Count(t, pool, `
			SELECT count(*) FROM (
			    SELECT 1 FROM river_job WHERE state <> 'completed' AND metadata ? 'outbox_ordering_key'
			    GROUP BY metadata->>'outbox_tenant_id', metadata->>'outbox_ordering_key', queue HAVING count(*) > 1) x`); n != 0 {
			t.Fatalf("%d keys have two jobs in River at once", n)
		}
		var (
			id       int64
			scope    string
			position *int64
		)
		err := pool.QueryRow(ctx, `
			UPDATE river_job SET state = 'completed', finalized_at = now(), attempt = 1, attempted_at = now()
			WHERE id = (SELECT id FROM river_job WHERE state = 'available' ORDER BY id LIMIT 1)
			RETURNING id, coalesce(metadata->>'outbox_tenant_id', '') || '/' || coalesce(metadata->>'outbox_ordering_key', '') || '@' || queue,
			          (metadata->>'outbox_ordering_position')::bigint`).Scan(&id, &scope, &position)
		if err != nil {
			t.Fatalf("complete job %d of %d: %v", done+1, want, err)
		}
		if position != nil {
			if *position <= last[scope] {
				t.Fatalf("job %d of %s at position %d ran after position %d", id, scope, *position, last[scope])
			}
			last[scope] = *position
		}
	}
	for what, q := range map[string]string{
		"jobs not completed": `SELECT count(*) FROM river_job WHERE state <> 'completed'`,
		"jobs in line":       `SELECT count(*) FROM outbox_ordering_wait`,
		"keys":               `SELECT count(*) FROM outbox_ordering_key`,
	} {
		if n := pgtest.Count(t, pool, q); n != 0 {
			t.Errorf("%d %s left, want 0", n, what)
		}
	}
	if len(last) != 5 {
		t.Errorf("%d keys ran, want 5 (k, l, t2/k, f in two queues): %v", len(last), fmt.Sprint(last))
	}
}
