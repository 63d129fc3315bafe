package claim

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/internal/schemacheck"
	outboxriver "github.com/outboxhq/outbox/river"
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
		// setup changes the schema as its owner; role runs the handoff
		// as outbox_dispatcher (else as the owner).
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
			// The first batch's line rows were created when its River rows
			// were, in its transaction (batch 2 inserted no River row).
			if got := pgtest.Count(t, s.Pool, `
				SELECT count(*) FROM outbox_ordering_wait
				WHERE event_id <= $1 AND created_at = (SELECT max(created_at) FROM river_job)`, len(first)); got != 7 {
				t.Errorf("%d of the first batch's line rows were created with its River rows, want 7", got)
			}
			if err := s.Pool.QueryRow(ctx, `
				SELECT jsonb_agg(to_jsonb(w) - 'since' - 'created_at' || jsonb_build_object('args', w.args - 'created_at')
				                 ORDER BY w.tenant_id, w.ordering_key, w.queue, w.position)::text
				FROM outbox_ordering_wait w`).Scan(&lines[i]); err != nil {
				t.Fatal(err)
			}

			runInOrder(t, ctx, s.Pool, jobs+len(second), 5)
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
// would, until want jobs of keys keys (and any unkeyed) are completed. Each completion releases the next
// job of its key (the release trigger); at every step a key has at most
// one job in River that is not completed, and each key's jobs complete in
// position order. It ends with the line and the keys empty.
func runInOrder(t *testing.T, ctx context.Context, pool *pgxpool.Pool, want, keys int) {
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
	if len(last) != keys {
		t.Errorf("%d keys ran, want %d: %v", len(last), keys, fmt.Sprint(last))
	}
}

// TestLineWritesNeedWhatTheyRelyOn: the handoff writes line rows itself
// only on a schema with migration 025, for a role that may insert into the
// line, and while the enqueue trigger fires for its session (a line row
// written without the trigger would wait behind a head no key row names);
// and a handoff that finds the grant gone after it looked fails its batch
// once, turns the line writes off, and hands the batch's events off again
// through the trigger, without charging them an attempt.
func TestLineWritesNeedWhatTheyRelyOn(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	disp := pgtest.RolePool(t, s, "outbox_dispatcher")

	look := func(pool *pgxpool.Pool, setup string) bool {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if setup != "" {
			if _, err := tx.Exec(ctx, setup); err != nil {
				t.Fatal(err)
			}
		}
		ok, err := schemacheck.LineWrites(ctx, tx)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	owner := func(sql string) {
		t.Helper()
		if _, err := s.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	if !look(s.Pool, "") || !look(disp, "") {
		t.Fatal("no line writes on a schema with 025, as its owner or outbox_dispatcher")
	}
	if look(s.Pool, "SET LOCAL session_replication_role = replica") {
		t.Error("line writes in a replica session, where the enqueue trigger does not fire")
	}
	owner(`ALTER TABLE river_job DISABLE TRIGGER outbox_ordering_enqueue`)
	if look(s.Pool, "") {
		t.Error("line writes with the enqueue trigger disabled")
	}
	owner(`ALTER TABLE river_job ENABLE ALWAYS TRIGGER outbox_ordering_enqueue`)
	if !look(s.Pool, "SET LOCAL session_replication_role = replica") {
		t.Error("no line writes in a replica session with the enqueue trigger enabled always")
	}
	owner(`ALTER TABLE river_job ENABLE TRIGGER outbox_ordering_enqueue`)

	routes, err := route.New([]route.Rule{{Prefix: "shop.", Queues: []string{"outbox_shop"}}})
	if err != nil {
		t.Fatal(err)
	}
	h := &Handoff{Pool: disp, Routes: routes, MaxRetries: 6, goOnly: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	k := outbox.Event{Type: "shop.order.paid", OrderingKey: "k"}
	pgtest.Publish(t, s.Pool, k, k, k)
	if res, err := h.Batch(ctx, 100); err != nil || res.Done != 3 {
		t.Fatalf("first batch: %+v, %v", res, err)
	}
	if h.line.state.Load() != featureOn {
		t.Fatal("the first batch did not turn the line writes on")
	}
	owner(`REVOKE INSERT ON outbox_ordering_wait FROM outbox_dispatcher`)
	pgtest.Publish(t, s.Pool, k, k, k)
	// The batch fails with permission denied and is handed off again
	// event by event (the Go handoff's fallback), through the trigger.
	res, err := h.Batch(ctx, 100)
	if err != nil || res.Done != 3 || !res.Fallback {
		t.Fatalf("the batch after the REVOKE: %+v, %v; want its 3 events handed off by the fallback", res, err)
	}
	if h.line.state.Load() != featureOff {
		t.Fatal("a batch that lost the grant left the line writes on")
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE retries > 0`); n != 0 {
		t.Errorf("%d events were charged a failed attempt", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status <> 'done'`); n != 0 {
		t.Fatalf("%d events not done", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait WHERE kind IS NOT NULL`); n != 5 {
		t.Fatalf("%d jobs wait in the line with their columns, want 5", n)
	}
	runInOrder(t, ctx, s.Pool, 6, 1)
}

// TestReleaseWaitsForALineTheHandoffWrites: a handoff whose statement
// writes a key's line rows itself (handoffLineSQL) and has not committed
// while the key's head completes. The release finds no job in line (the
// handoff's rows are not committed), so it waits for the key's row, which
// the handoff's first job locked FOR KEY SHARE through the trigger; once
// the handoff commits it looks again and lets the handoff's first job go,
// and the other two wait behind it. Nothing is stranded.
func TestReleaseWaitsForALineTheHandoffWrites(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	rule := route.Rule{Prefix: "shop.", Queues: []string{"outbox_shop"}}
	routes, err := route.New([]route.Rule{rule})
	if err != nil {
		t.Fatal(err)
	}
	k := outbox.Event{Type: "shop.order.paid", OrderingKey: "k"}
	pgtest.Publish(t, s.Pool, k)
	h := &Handoff{Pool: s.Pool, Routes: routes, MaxRetries: 6, goOnly: true}
	if res, err := h.Batch(ctx, 10); err != nil || res.Done != 1 {
		t.Fatalf("the head's batch: %+v, %v", res, err)
	}
	var head int64
	if err := s.Pool.QueryRow(ctx, `SELECT head_job_id FROM outbox_ordering_key`).Scan(&head); err != nil {
		t.Fatal(err)
	}

	// Three more events of k, handed off by the statement in a
	// transaction left open.
	ids := pgtest.Publish(t, s.Pool, k, k, k)
	var cols jobColumns
	for _, id := range ids {
		var pos int64
		if err := s.Pool.QueryRow(ctx, `SELECT ordering_position FROM outbox_event WHERE id = $1`, id).Scan(&pos); err != nil {
			t.Fatal(err)
		}
		okey := "k"
		args := outboxriver.EventArgs{EventID: id, EventType: k.Type, Payload: json.RawMessage(`{}`), CreatedAt: time.Now(),
			OrderingKey: &okey, OrderingPosition: pos}
		for n, p := range outboxriver.JobParams(rule, args) {
			if err := cols.add(id, n, p); err != nil {
				t.Fatal(err)
			}
		}
	}
	handoff, handoffPID := pgtest.OpenTx(t, ctx, s.Pool)
	var counts [4]int64
	if err := handoff.QueryRow(ctx, handoffLineSQL, cols.sqlArgs()...).Scan(&counts[0], &counts[1], &counts[2], &counts[3]); err != nil {
		t.Fatal(err)
	}
	if counts[0] != 3 || counts[1] != 3 || counts[2] != 3 {
		t.Fatalf("the handoff wrote %d jobs, marked %d events done with %d job ids; want 3, 3, 3", counts[0], counts[1], counts[2])
	}

	// The head completes meanwhile.
	released := make(chan error, 1)
	go func() {
		_, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now(), attempt = 1, attempted_at = now() WHERE id = $1`, head)
		released <- err
	}()
	pgtest.WaitFor(t, 30*time.Second, "the release waits for the handoff", func() bool {
		return pgtest.WaitingFor(t, s.Pool, handoffPID)
	})
	select {
	case err := <-released:
		t.Fatalf("the release ended before the handoff committed: %v", err)
	default:
	}
	if err := handoff.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-released; err != nil {
		t.Fatal(err)
	}

	var next, pos int64
	if err := s.Pool.QueryRow(ctx, `
		SELECT k.head_job_id, (j.metadata->>'outbox_ordering_position')::bigint
		FROM outbox_ordering_key k JOIN river_job j ON j.id = k.head_job_id
		WHERE j.state = 'available' AND (j.metadata->>'outbox_event_id')::bigint = $1`, ids[0]).Scan(&next, &pos); err != nil {
		t.Fatalf("the handoff's first job is not the key's available head: %v", err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait WHERE event_id = ANY ($1) AND position > $2`, ids[1:], pos); n != 2 {
		t.Fatalf("%d of the handoff's other jobs wait behind its first, want 2", n)
	}
	runInOrder(t, ctx, s.Pool, 3, 1)
}
