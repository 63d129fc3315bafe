package claim

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// TestDirectInsertMatchesRiver inserts the same jobs twice, through River's
// InsertManyTx and through the handoff's own statement (handoffSQL with
// jobColumns), and compares every column River writes: the rows the
// handoff makes must be the rows River makes. A River upgrade that changes
// a default or the table fails here.
func TestDirectInsertMatchesRiver(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)

	rule := route.Rule{Prefix: "shop.", Jobs: []route.Job{
		{Queue: "outbox_plain"},
		{Queue: "outbox_kinded", Kind: "shop_kinded", Priority: 2, MaxAttempts: 3, Tags: []string{"a_b", "c-d-e"}},
		{Queue: "outbox_payload", Kind: "shop_payload", Args: route.ArgsPayload},
	}}
	if _, err := route.New([]route.Rule{rule}); err != nil {
		t.Fatal(err)
	}
	tenant, dk, okey := "acme", "dk-1", "order-7"
	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "shop.order.paid", Payload: json.RawMessage(`{"n": 1, "s": "x"}`)},
		outbox.Event{Type: "shop.order.paid", TenantID: tenant, DispatchKey: dk, OrderingKey: okey, Payload: json.RawMessage(`{"deep": {"a": [1, 2, 3]}}`)},
	)
	var params []river.InsertManyParams
	var cols jobColumns
	for i, id := range ids {
		args := outboxriver.EventArgs{EventID: id, EventType: "shop.order.paid", Payload: json.RawMessage(`{"n": 1}`), CreatedAt: time.Now().Round(time.Microsecond),
			TraceContext: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
		if i == 1 {
			args.TenantID, args.DispatchKey, args.OrderingKey, args.OrderingPosition = &tenant, &dk, &okey, 7
		}
		for k, p := range outboxriver.JobParams(rule, args) {
			params = append(params, p)
			if err := cols.add(id, k, p); err != nil {
				t.Fatal(err)
			}
		}
	}

	rc, err := outboxriver.NewInsertClient(s.Pool, outboxriver.InsertClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	// Every column but the id and the two times, whatever columns River's
	// table has.
	const columns = `to_jsonb(j) - 'id' - 'created_at' - 'scheduled_at'`
	// River's driver takes created_at and scheduled_at from the inserting
	// process's clock, the handoff from the database's (handoffSQL): only
	// the handoff's are compared, with the transaction's start.
	read := func(tx pgx.Tx, jobIDs []int64) []string {
		t.Helper()
		return queryStrings(t, ctx, tx, `SELECT (`+columns+`)::text FROM river_job j WHERE id = ANY($1) ORDER BY id`, jobIDs)
	}

	// River's rows, rolled back after reading: the ordering trigger queues
	// the keyed event's jobs either way.
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	inserted, err := rc.InsertManyTx(ctx, tx, params)
	if err != nil {
		t.Fatal(err)
	}
	riverIDs := make([]int64, len(inserted))
	for i, r := range inserted {
		riverIDs[i] = r.Job.ID
	}
	want := read(tx, riverIDs)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	// The handoff's rows, and the events they mark done.
	tx, err = s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var jobs, done, recorded, announced int64
	if err := tx.QueryRow(ctx, handoffSQL, cols.sqlArgs()...).Scan(&jobs, &done, &recorded, &announced); err != nil {
		t.Fatal(err)
	}
	if jobs != int64(len(params)) || done != int64(len(ids)) || recorded != int64(len(params)) || announced != 3 {
		t.Fatalf("handoff statement: %d jobs, %d events done, %d job ids recorded, %d queues announced; want %d, %d, %d, 3",
			jobs, done, recorded, announced, len(params), len(ids), len(params))
	}
	var ownIDs []int64
	for _, id := range ids {
		var status string
		var jobIDs []int64
		if err := tx.QueryRow(ctx, `SELECT status::text, river_job_ids FROM outbox_event WHERE id = $1`, id).Scan(&status, &jobIDs); err != nil {
			t.Fatal(err)
		}
		if status != "done" || len(jobIDs) != len(rule.Jobs) {
			t.Fatalf("event %d: status %s, river_job_ids %v; want done and %d jobs", id, status, jobIDs, len(rule.Jobs))
		}
		for k, jobID := range jobIDs {
			var queue string
			if err := tx.QueryRow(ctx, `SELECT queue FROM river_job WHERE id = $1`, jobID).Scan(&queue); err != nil {
				t.Fatal(err)
			}
			if queue != rule.Jobs[k].Queue {
				t.Fatalf("event %d: river_job_ids[%d] is a job of queue %s, want %s (route order)", id, k, queue, rule.Jobs[k].Queue)
			}
		}
		ownIDs = append(ownIDs, jobIDs...)
	}
	got := read(tx, ownIDs)
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("the handoff's rows differ from River's:\n got %s\nwant %s", strings.Join(got, "\n     "), strings.Join(want, "\n     "))
	}
	if n := strings.Count(strings.Join(got, ""), `"unique_key": null`); n != len(got) {
		t.Fatalf("%d of %d rows without a unique key", n, len(got))
	}
	var n int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE id = ANY($1) AND scheduled_at = created_at AND created_at = now()`, ownIDs).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != len(ownIDs) {
		t.Fatalf("%d of %d jobs created and scheduled at the transaction's start", n, len(ownIDs))
	}
}

// TestJobColumnsRefuseWhatRiverWouldDoDifferently: the handoff writes
// River's rows itself, so a job it cannot write as River would (unique,
// scheduled, pending, bad priority or tag) fails the batch with its reason.
func TestJobColumnsRefuseWhatRiverWouldDoDifferently(t *testing.T) {
	t.Parallel()
	args := outboxriver.EventArgs{EventID: 1, EventType: "a.b.c", Payload: json.RawMessage(`{}`)}
	for _, tc := range []struct {
		name string
		opts river.InsertOpts
		want string
	}{
		{"unique", river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}, "unique jobs are not supported"},
		{"scheduled", river.InsertOpts{ScheduledAt: time.Now().Add(time.Hour)}, "scheduled"},
		{"pending", river.InsertOpts{Pending: true}, "pending"},
		{"priority", river.InsertOpts{Priority: 5}, "priority 5 is out of range"},
		{"tag", river.InsertOpts{Tags: []string{"no,comma"}}, `tag "no,comma" is not valid`},
		{"short tag", river.InsertOpts{Tags: []string{"ab"}}, `tag "ab" is not valid`},
		{"max attempts", river.InsertOpts{MaxAttempts: 40000}, "max_attempts 40000 is out of range"},
		{"queue", river.InsertOpts{Queue: "no.dots"}, `queue name "no.dots" is not valid`},
		{"unique by no state", river.InsertOpts{UniqueOpts: river.UniqueOpts{ByState: []rivertype.JobState{}}}, "unique jobs are not supported"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var c jobColumns
			opts := tc.opts
			err := c.add(1, 0, river.InsertManyParams{Args: args, InsertOpts: &opts})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("add: %v, want an error containing %q", err, tc.want)
			}
			if len(c.eventID) != 0 {
				t.Fatal("a refused job was added")
			}
		})
	}
	var own jobColumns
	if err := own.add(1, 0, river.InsertManyParams{Args: argsWithOpts{}}); err == nil || !strings.Contains(err.Error(), "args with their own insert options") {
		t.Fatalf("args with insert options: %v", err)
	}
	var c jobColumns
	if err := c.add(1, 0, river.InsertManyParams{Args: args, InsertOpts: &river.InsertOpts{Tags: []string{"a_b", "x-y-z"}}}); err != nil {
		t.Fatalf("valid tags refused: %v", err)
	}
	if c.tags[0] != "a_b,x-y-z" || c.queue[0] != river.QueueDefault || c.priority[0] != 1 || c.maxAttempts[0] != river.MaxAttemptsDefault {
		t.Fatalf("defaults: %+v", c)
	}
}

// TestKeyedFanOutKeepsRouteOrder: an ordered event's jobs are inserted in
// the ordering locks' order (insertOrder: by queue here), yet
// river_job_ids lists them in the rule's order, as for any event.
func TestKeyedFanOutKeepsRouteOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	routes, err := route.New([]route.Rule{{Prefix: "shop.", Queues: []string{"outbox_z", "outbox_a"}}})
	if err != nil {
		t.Fatal(err)
	}
	h := &Handoff{Pool: s.Pool, Routes: routes, MaxRetries: 6}
	id := pgtest.Publish(t, s.Pool, outbox.Event{Type: "shop.order.paid", OrderingKey: "k"})[0]
	res, err := h.Batch(ctx, 10)
	if err != nil || res.Done != 1 || res.Jobs != 2 {
		t.Fatalf("batch: %+v, %v", res, err)
	}
	var queues []string
	var aFirst bool
	if err := s.Pool.QueryRow(ctx, `
		SELECT array_agg(j.queue ORDER BY x.ord), (array_agg(j.id ORDER BY x.ord))[1] > (array_agg(j.id ORDER BY x.ord))[2]
		FROM outbox_event e, unnest(e.river_job_ids) WITH ORDINALITY AS x(job_id, ord) JOIN river_job j ON j.id = x.job_id
		WHERE e.id = $1`, id).Scan(&queues, &aFirst); err != nil {
		t.Fatal(err)
	}
	if strings.Join(queues, ",") != "outbox_z,outbox_a" {
		t.Fatalf("river_job_ids lists the jobs of queues %v, want the rule's order outbox_z,outbox_a", queues)
	}
	if !aFirst {
		t.Fatal("outbox_z's job was inserted first: the test no longer exercises the lock order")
	}
}

// argsWithOpts carries its own insert options, which the handoff refuses.
type argsWithOpts struct{}

func (argsWithOpts) Kind() string                 { return "with_opts" }
func (argsWithOpts) InsertOpts() river.InsertOpts { return river.InsertOpts{Priority: 2} }
