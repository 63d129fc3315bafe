package outboxriver_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

// TestRiverInsertOfAnOrderedJobReturnsEveryJob: since migration 024 the
// handoff's waiting jobs wait in their key's line, not in river_job; a job
// with the ordering metadata inserted by River's own InsertManyTx (a relay
// of the user's that inserts outboxriver.JobParams) still waits as a
// pending River row, so River returns a row for every job it was given
// and the order holds.
func TestRiverInsertOfAnOrderedJobReturnsEveryJob(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	tbl := parseRoutes(t, "routes:\n  - prefix: \"shop.\"\n    queue: orders\n")
	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "shop.order.paid", OrderingKey: "order:1", Payload: json.RawMessage(`{"n": 1}`)},
		outbox.Event{Type: "shop.order.shipped", OrderingKey: "order:1", Payload: json.RawMessage(`{"n": 2}`)},
	)
	var params []river.InsertManyParams
	for _, id := range ids {
		ev := claimedEvent(t, s.Pool, id)
		key := "order:1"
		ev.OrderingKey = &key
		if err := s.Pool.QueryRow(ctx, `SELECT ordering_position FROM outbox_event WHERE id = $1`, id).Scan(&ev.OrderingPosition); err != nil {
			t.Fatal(err)
		}
		rule, ok := tbl.Match(ev.EventType)
		if !ok {
			t.Fatalf("no rule for %s", ev.EventType)
		}
		params = append(params, outboxriver.JobParams(rule, ev)...)
	}
	jobs := insertJobs(t, s.Pool, params)
	if len(jobs) != 2 {
		t.Fatalf("River's InsertManyTx returned %d jobs for 2", len(jobs))
	}
	states := map[int64]string{}
	rows, err := s.Pool.Query(context.Background(), `SELECT id, state::text FROM river_job WHERE id = ANY($1)`, jobs)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		var st string
		if err := rows.Scan(&id, &st); err != nil {
			t.Fatal(err)
		}
		states[id] = st
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if states[jobs[0]] != "available" || states[jobs[1]] != "pending" {
		t.Fatalf("river_job states %v, want job %d available (the head) and job %d pending behind it", states, jobs[0], jobs[1])
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait WHERE job_id = $1 AND kind IS NULL`, jobs[1]); n != 1 {
		t.Fatalf("%d line rows without columns for the pending job, want 1 (it waits as a River row)", n)
	}
}
