package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// parkKey parks key with n-1 jobs waiting behind its discarded head
// (ordertest.ParkKey); the head's error ends in a terminal escape, which
// the listing must not pass through.
func parkKey(t *testing.T, s *pgtest.Schema, tenant, key string, n int) (events, jobs []int64) {
	t.Helper()
	return ordertest.ParkKey(t, s.Pool, tenant, key, n, "webhook 500\x1b[2J")
}

// jobStateOf is the state of a job, in River or waiting in its key's line
// (pending there, not in river_job until its turn: pgtest.Jobs). A job
// found in both, or in neither, fails the test.
func jobStateOf(t *testing.T, s *pgtest.Schema, id int64) string {
	t.Helper()
	var st string
	var n int
	if err := s.Pool.QueryRow(context.Background(), `SELECT min(state), count(*) FROM `+pgtest.Jobs+` WHERE id = $1`, id).Scan(&st, &n); err != nil || n != 1 {
		t.Fatalf("state of job %d: %v (%d rows)", id, err, n)
	}
	return st
}

// jobInLine tells whether a job waits in its key's line, not in river_job.
func jobInLine(t *testing.T, s *pgtest.Schema, id int64) bool {
	t.Helper()
	return pgtest.Count(t, s.Pool, `SELECT count(*) FROM `+pgtest.Jobs+` WHERE id = $1 AND in_line`, id) == 1 &&
		pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1`, id) == 0
}

// TestKeysAndUnparkCommands: keys lists a parked key (text and JSON);
// unpark's dry run changes and records nothing, the real run skips the
// head and records an audit row; a key that is not parked, or is held in
// the outbox, fails with exit 1 and says what to do; bad usage exits 2
// before connecting.
func TestKeysAndUnparkCommands(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)

	code, out, _ := octl(t, s, "keys")
	if code != 0 || !strings.Contains(out, "no ordering key waits") {
		t.Fatalf("keys on an empty outbox: exit %d, %q", code, out)
	}
	events, jobs := parkKey(t, s, "acme", "order-42", 3)

	list := ctlJSON[admin.KeyList](t, s, "keys")
	if len(list.Keys) != 1 || list.Keys[0].Kind != admin.KeyParked || list.Keys[0].OrderingKey != "order-42" ||
		*list.Keys[0].Head.JobID != jobs[0] || list.Keys[0].Waiting != 2 {
		t.Fatalf("keys --json = %+v", list)
	}
	code, out, errOut := octl(t, s, "keys", "--tenant", "acme", "--parked")
	if code != 0 || !strings.Contains(out, "parked (discarded)") || !strings.Contains(out, fmt.Sprintf("job %d (event %d) discarded 1/1", jobs[0], events[0])) ||
		!strings.Contains(out, `webhook 500\x1b[2J`) {
		t.Fatalf("keys: exit %d\n%s%s", code, out, errOut)
	}
	assertNoRawControls(t, "keys", out)
	if list := ctlJSON[admin.KeyList](t, s, "keys", "--tenant", "globex"); len(list.Keys) != 0 {
		t.Fatalf("keys --tenant globex = %+v", list.Keys)
	}

	bad := "postgres://nobody@127.0.0.1:1/none"
	for _, args := range [][]string{
		{"unpark", "--retry"},
		{"unpark", "--key", "k"},
		{"unpark", "--key", "k", "--retry", "--skip"},
		{"unpark", "--key", strings.Repeat("k", 257), "--retry"},
		{"unpark", "--key", "k", "--retry", "--actor", ""},
		{"unpark", "--key", "k", "--retry", "extra"},
		{"keys", "--limit", "0"},
		{"keys", "--limit", "10001"},
	} {
		if code, _, errOut := ctl(t, bad, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, errOut)
		}
	}

	var dry admin.UnparkResult
	code, out, errOut = octl(t, s, "unpark", "--key", "order-42", "--tenant", "acme", "--skip", "--dry-run", "--json")
	if code != 0 || json.Unmarshal([]byte(out), &dry) != nil || len(dry.Keys) != 1 || dry.AuditID != 0 || !dry.Request.DryRun {
		t.Fatalf("unpark --dry-run: exit %d\n%s%s", code, out, errOut)
	}
	if st, line := jobStateOf(t, s, jobs[1]), jobInLine(t, s, jobs[1]); st != "pending" || !line || auditCount(t, s.Pool) != 0 {
		t.Fatalf("the dry run changed something: next job %s (in the line: %t), %d audit rows", st, line, auditCount(t, s.Pool))
	}
	code, out, errOut = octl(t, s, "unpark", "--key", "order-42", "--tenant", "acme", "--skip", "--actor", "alice", "--reason", "customer deleted")
	if code != 0 || !strings.Contains(out, "the parked head skipped in 1 queue") || !strings.Contains(out, "recorded as audit #") || !strings.Contains(out, "by alice") {
		t.Fatalf("unpark: exit %d\n%s%s", code, out, errOut)
	}
	// The skip released the next job: River's row, with the id it had in
	// the line.
	if st, line := jobStateOf(t, s, jobs[1]), jobInLine(t, s, jobs[1]); st != "available" || line || auditCount(t, s.Pool) != 1 {
		t.Fatalf("after unpark: next job %s (in the line: %t), %d audit rows; want available in River, 1", st, line, auditCount(t, s.Pool))
	}
	code, _, errOut = octl(t, s, "unpark", "--key", "order-42", "--tenant", "acme", "--retry")
	if code != 1 || !strings.Contains(errOut, "is not parked") || !strings.Contains(errOut, "is available") {
		t.Fatalf("unpark of a key that is not parked: exit %d, %q", code, errOut)
	}

	// Held in the outbox: unpark names the failed event to requeue.
	held := pgtest.Publish(t, s.Pool, outbox.Event{Type: "order.item.changed", Payload: json.RawMessage(`{}`), OrderingKey: "held"})
	if _, err := s.Pool.Exec(context.Background(), `UPDATE outbox_event SET status = 'failed', last_error = 'no route' WHERE id = $1`, held[0]); err != nil {
		t.Fatal(err)
	}
	behind := pgtest.Publish(t, s.Pool, outbox.Event{Type: "order.item.changed", Payload: json.RawMessage(`{}`), OrderingKey: "held"})
	code, _, errOut = octl(t, s, "unpark", "--key", "held", "--skip")
	if code != 1 || !strings.Contains(errOut, fmt.Sprintf("outboxctl requeue --id %d", held[0])) {
		t.Fatalf("unpark of a key held in the outbox: exit %d, %q", code, errOut)
	}
	code, out, _ = octl(t, s, "keys", "--key", "held")
	if code != 0 || !strings.Contains(out, "held_in_outbox") || !strings.Contains(out, "(outbox)") || !strings.Contains(out, fmt.Sprintf("event %d failed", held[0])) {
		t.Fatalf("keys --key held: exit %d\n%s", code, out)
	}
	// The event behind it, moved as a dispatcher moves it (migration 021):
	// stats counts it as scheduled and held.
	if _, err := s.Pool.Exec(context.Background(), `UPDATE outbox_event SET held_from = scheduled_at, scheduled_at = now() + interval '1 minute' WHERE id = $1`, behind[0]); err != nil {
		t.Fatal(err)
	}
	code, out, _ = octl(t, s, "stats")
	if code != 0 || !strings.Contains(out, "pending: 0 due, 1 scheduled (1 of them held for their ordering key)") {
		t.Fatalf("stats with a held event: exit %d\n%s", code, out)
	}
}

// TestKeysEscapeControlCharacters: a key with terminal escapes and bidi
// controls is printed escaped by keys, unpark and explain, and exactly by
// --json.
func TestKeysEscapeControlCharacters(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	const key = "k\x1b[31m\u202eevil"
	events, _ := parkKey(t, s, "", key, 2)
	for _, args := range [][]string{
		{"keys"},
		{"unpark", "--key", key, "--retry", "--dry-run"},
		{"explain", fmt.Sprint(events[1])},
	} {
		code, out, errOut := octl(t, s, args...)
		if code != 0 || !strings.Contains(out, `k\x1b[31m\u202eevil`) {
			t.Errorf("%v: exit %d, the escaped key is missing:\n%s%s", args[0], code, out, errOut)
		}
		assertNoRawControls(t, args[0], out)
	}
	if list := ctlJSON[admin.KeyList](t, s, "keys"); len(list.Keys) != 1 || list.Keys[0].OrderingKey != key {
		t.Fatalf("keys --json = %+v", list.Keys)
	}
}

// TestExplainShowsTheKeysOrder: explain prints the key and position, the
// head a waiting job waits behind, that the job waits in its key's line
// (not in River yet) and that the key is parked; --json carries the same.
func TestExplainShowsTheKeysOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	events, jobs := parkKey(t, s, "acme", "order-9", 3)
	code, out, errOut := octl(t, s, "explain", fmt.Sprint(events[2]))
	if code != 0 {
		t.Fatalf("explain: exit %d: %s", code, errOut)
	}
	for _, want := range []string{
		"ordering key  order-9  position ",
		"outbox: handed off",
		fmt.Sprintf("job %d  queue outbox_order  state pending  attempt 0/", jobs[2]),
		"      waits in its key's line, not in River yet: River inserts it with this id when its turn comes\n",
		fmt.Sprintf("job %d pending: waits behind head job %d (event %d), which is discarded, with 1 other job(s) of the key ahead of it "+
			"(in the key's line, not in River yet: River inserts it when its turn comes); the key is parked", jobs[2], jobs[0], events[0]),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("explain lacks %q:\n%s", want, out)
		}
	}
	code, out, _ = octl(t, s, "explain", fmt.Sprint(events[0]))
	if code != 0 || !strings.Contains(out, "this job is the head of its key: the key's 2 later job(s) wait") || strings.Contains(out, "not in River yet") {
		t.Errorf("explain of the head:\n%s", out)
	}
	ex := ctlJSON[admin.Explanation](t, s, "explain", fmt.Sprint(events[2]))
	if ex.Ordering == nil || ex.Ordering.Key != "order-9" || len(ex.Ordering.Queues) != 1 || !ex.Ordering.Queues[0].Parked || *ex.Ordering.Queues[0].HeadJobID != jobs[0] ||
		!ex.Ordering.Queues[0].InLine || ex.Ordering.Queues[0].JobState != "pending" {
		t.Fatalf("explain --json ordering = %+v", ex.Ordering)
	}
	if len(ex.Jobs) != 1 || ex.Jobs[0].ID != jobs[2] || !ex.Jobs[0].InLine || ex.Jobs[0].State != "pending" {
		t.Fatalf("explain --json jobs = %+v, want job %d pending in the key's line", ex.Jobs, jobs[2])
	}
	code, out, _ = octl(t, s, "explain", fmt.Sprint(events[2]), "--json")
	if code != 0 || strings.Count(out, `"in_line": true`) != 2 {
		t.Fatalf("explain --json lacks in_line true:\n%s", out)
	}

	// In the outbox: the later event waits for the failed one.
	held := pgtest.Publish(t, s.Pool, outbox.Event{Type: "order.item.changed", Payload: json.RawMessage(`{}`), OrderingKey: "held"})
	if _, err := s.Pool.Exec(context.Background(), `UPDATE outbox_event SET status = 'failed' WHERE id = $1`, held[0]); err != nil {
		t.Fatal(err)
	}
	later := pgtest.Publish(t, s.Pool, outbox.Event{Type: "order.item.changed", Payload: json.RawMessage(`{}`), OrderingKey: "held"})
	code, out, _ = octl(t, s, "explain", fmt.Sprint(later[0]))
	if code != 0 || !strings.Contains(out, fmt.Sprintf("outbox: waits for event %d (failed), the nearest of 1 earlier event", held[0])) ||
		!strings.Contains(out, fmt.Sprintf("outboxctl requeue --id %d", held[0])) {
		t.Errorf("explain of an event held in the outbox:\n%s", out)
	}
	// A dispatcher that found it held moved its due time a minute on, as
	// holdSQL does behind a dead letter (migration 021): explain shows its
	// own due time beside the moved one.
	if _, err := s.Pool.Exec(context.Background(), `UPDATE outbox_event SET held_from = scheduled_at, scheduled_at = now() + interval '1 minute' WHERE id = $1`, later[0]); err != nil {
		t.Fatal(err)
	}
	code, out, _ = octl(t, s, "explain", fmt.Sprint(later[0]))
	if code != 0 || !strings.Contains(out, "held from     ") || !strings.Contains(out, "moved to wait for an earlier event of its key") {
		t.Errorf("explain of a held event whose due time was moved:\n%s", out)
	}
}

// TestPublishOrderingKeyFlag: publish --ordering-key stores the key; a key
// longer than the limit is bad usage.
func TestPublishOrderingKeyFlag(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	res := ctlJSON[struct {
		ID int64 `json:"id"`
	}](t, s, "publish", "--type", "order.item.changed", "--ordering-key", "order-1", "--tenant", "acme")
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = $1 AND ordering_key = 'order-1' AND ordering_position IS NOT NULL`, res.ID); n != 1 {
		t.Fatalf("event %d does not carry the ordering key", res.ID)
	}
	if code, _, errOut := octl(t, s, "publish", "--type", "order.item.changed", "--ordering-key", strings.Repeat("k", 257)); code != 2 || !strings.Contains(errOut, "OrderingKey") {
		t.Fatalf("a long ordering key: exit %d, %q", code, errOut)
	}
}
