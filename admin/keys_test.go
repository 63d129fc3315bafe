package admin_test

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

// handOff hands every due event off to River with the real claim (routes:
// order. to outbox_order), as the dispatcher does, so that the ordering
// triggers make the first job of a key its head and hold the rest pending
// in the key's line (not in river_job until their turn, migration 024).
func handOff(t *testing.T, s *pgtest.Schema) claim.Result {
	t.Helper()
	return ordertest.HandOff(t, s.Pool, nil)
}

// keyed publishes n events of one key, in one transaction.
func keyed(t *testing.T, s *pgtest.Schema, tenant, key string, n int) []int64 {
	t.Helper()
	return pgtest.Publish(t, s.Pool, ordertest.Events(tenant, key, n)...)
}

// jobOf is the River job of an event.
func jobOf(t *testing.T, s *pgtest.Schema, eventID int64) int64 {
	t.Helper()
	var id int64
	if err := s.Pool.QueryRow(context.Background(), `SELECT river_job_ids[1] FROM outbox_event WHERE id = $1 AND river_job_ids IS NOT NULL`, eventID).Scan(&id); err != nil {
		t.Fatalf("job of event %d: %v", eventID, err)
	}
	return id
}

// discard finalizes a job as River does when it runs out of attempts,
// which fires the ordering trigger that parks its key.
func discard(t *testing.T, s *pgtest.Schema, jobID int64) {
	t.Helper()
	_, err := s.Pool.Exec(context.Background(), `
		UPDATE river_job SET state = 'discarded', finalized_at = now(), attempt = 3, max_attempts = 3, attempted_at = now(),
		       errors = ARRAY[jsonb_build_object('attempt', 3, 'at', now(), 'error', 'smtp: 550 mailbox gone')]
		WHERE id = $1`, jobID)
	if err != nil {
		t.Fatal(err)
	}
}

// jobState is the state of a job, in River or waiting in its key's line
// (pending there: pgtest.Jobs). A job found in both, or in neither, fails
// the test.
func jobState(t *testing.T, s *pgtest.Schema, jobID int64) string {
	t.Helper()
	var st string
	var n int
	if err := s.Pool.QueryRow(context.Background(), `SELECT min(state), count(*) FROM `+pgtest.Jobs+` WHERE id = $1`, jobID).Scan(&st, &n); err != nil || n != 1 {
		t.Fatalf("state of job %d: %v (%d rows)", jobID, err, n)
	}
	return st
}

// inLine tells whether a job waits in its key's line, not in river_job.
func inLine(t *testing.T, s *pgtest.Schema, jobID int64) bool {
	t.Helper()
	return pgtest.Count(t, s.Pool, `SELECT count(*) FROM `+pgtest.Jobs+` WHERE id = $1 AND in_line`, jobID) == 1 &&
		pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1`, jobID) == 0
}

// TestKeysListsWhatHoldsEachKey: a parked key (its head discarded), a key
// whose head job was deleted, and a key held in the outbox by a failed event
// are listed oldest first with their heads and what waits behind them; a
// healthy key is not; every filter narrows the list.
func TestKeysListsWhatHoldsEachKey(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)

	// Held in the outbox: the key's first event is dead-lettered before its
	// later ones are published; the claim keeps them pending behind it.
	held := keyed(t, s, "", "held", 1)
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', retries = 7, last_error = 'no route matches' WHERE id = $1`, held[0]); err != nil {
		t.Fatal(err)
	}
	heldLater := keyed(t, s, "", "held", 2)
	// A head deleted by hand before it finished (the delete trigger of 011
	// parks its key as deleted), and a healthy key.
	gone := keyed(t, s, "", "gone", 2)
	keyed(t, s, "acme", "fine", 2) // healthy: its head runs, it is not listed
	if res := handOff(t, s); res.Done != 4 {
		t.Fatalf("handoff %+v, want the 4 events of gone and fine done", res)
	}
	if _, err := s.Pool.Exec(ctx, `DELETE FROM river_job WHERE id = $1`, jobOf(t, s, gone[0])); err != nil {
		t.Fatal(err)
	}
	// Parked, last: its head is discarded.
	parked := keyed(t, s, "acme", "order-42", 3)
	if res := handOff(t, s); res.Done != 3 {
		t.Fatalf("handoff %+v", res)
	}
	parkedHead := jobOf(t, s, parked[0])
	discard(t, s, parkedHead)

	list, err := cl.Keys(ctx, admin.KeysFilter{})
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, k := range list.Keys {
		kinds = append(kinds, k.Kind+":"+k.OrderingKey)
	}
	if got := strings.Join(kinds, " "); got != "held_in_outbox:held parked:gone parked:order-42" || list.More || list.Filter.Limit != admin.DefaultKeysLimit {
		t.Fatalf("keys %s (more %v, filter %+v), want held, gone, order-42 oldest first", got, list.More, list.Filter)
	}
	h, g, p := list.Keys[0], list.Keys[1], list.Keys[2]
	if h.Head.EventID == nil || *h.Head.EventID != held[0] || h.Head.JobID != nil || h.Head.State != "failed" || h.Head.Attempt != 7 ||
		h.Head.LastError == nil || *h.Head.LastError != "no route matches" || h.Waiting != 2 || h.Queue != "" || h.TenantID != nil ||
		h.OldestWaitingSince == nil {
		t.Fatalf("held key %+v (head %+v), want event %d failed with events %v behind it", h, h.Head, held[0], heldLater)
	}
	if g.Head.JobFound || g.Head.JobID == nil || *g.Head.EventID != gone[0] || g.Waiting != 1 || g.Queue != "outbox_order" || g.ParkedState != "deleted" {
		t.Fatalf("deleted-head key %+v (head %+v)", g, g.Head)
	}
	if p.TenantID == nil || *p.TenantID != "acme" || p.ParkedState != "discarded" || !p.Head.JobFound || *p.Head.JobID != parkedHead ||
		*p.Head.EventID != parked[0] || p.Head.State != "discarded" || p.Head.Attempt != 3 || p.Head.MaxAttempts != 3 ||
		p.Head.LastError == nil || *p.Head.LastError != "smtp: 550 mailbox gone" || p.Waiting != 2 || p.OldestWaitingSince == nil ||
		math.Abs(p.OldestWaitingAgeS-list.AsOf.Sub(*p.OldestWaitingSince).Seconds()) > 0.001 || p.Since.After(list.AsOf) {
		t.Fatalf("parked key %+v (head %+v)", p, p.Head)
	}

	for _, c := range []struct {
		f    admin.KeysFilter
		want string
	}{
		{admin.KeysFilter{ParkedOnly: true}, "gone order-42"},
		{admin.KeysFilter{Tenant: "acme"}, "order-42"},
		{admin.KeysFilter{Key: "held"}, "held"},
		{admin.KeysFilter{Queue: "outbox_order"}, "gone order-42"},
		{admin.KeysFilter{Queue: "outbox_other"}, ""},
		{admin.KeysFilter{Limit: 2}, "held gone"},
	} {
		got, err := cl.Keys(ctx, c.f)
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for _, k := range got.Keys {
			keys = append(keys, k.OrderingKey)
		}
		if strings.Join(keys, " ") != c.want || got.More != (c.f.Limit == 2) {
			t.Errorf("Keys(%+v) = %v (more %v), want %q", c.f, keys, got.More, c.want)
		}
	}
	var se *admin.SelectionError
	if _, err := cl.Keys(ctx, admin.KeysFilter{Limit: admin.MaxKeysLimit + 1}); !errors.As(err, &se) || se.Flag != "limit" {
		t.Fatalf("limit too large: %v", err)
	}

	sum, err := cl.KeySummary(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Parked != 2 || sum.HeadMissing != 0 || sum.OldestParkedAt == nil {
		t.Fatalf("summary %+v", sum)
	}
}

// TestUnparkDryRunRetryAndSkip: a dry run reports the parked key and
// changes and records nothing; retry makes the head job available again and
// unparks the key; skip releases the next job; each real run writes one
// audit row.
func TestUnparkDryRunRetryAndSkip(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	a := keyed(t, s, "acme", "retry-me", 2)
	b := keyed(t, s, "acme", "skip-me", 2)
	handOff(t, s)
	headA, nextA := jobOf(t, s, a[0]), jobOf(t, s, a[1])
	headB, nextB := jobOf(t, s, b[0]), jobOf(t, s, b[1])
	discard(t, s, headA)
	discard(t, s, headB)

	dry, err := cl.Unpark(ctx, admin.UnparkRequest{Actor: "alice", Key: "retry-me", Tenant: "acme", Action: admin.UnparkRetry, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(dry.Keys) != 1 || dry.Keys[0].HeadJobID != headA || *dry.Keys[0].HeadEventID != a[0] || dry.Keys[0].ParkedState != "discarded" ||
		dry.Keys[0].Waiting != 1 || dry.Keys[0].Queue != "outbox_order" || dry.AuditID != 0 || !dry.Request.DryRun {
		t.Fatalf("dry run %+v", dry)
	}
	if st := jobState(t, s, headA); st != "discarded" {
		t.Fatalf("dry run changed the head to %s", st)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit WHERE action = 'unpark'`); n != 0 {
		t.Fatalf("dry run wrote %d audit rows", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key WHERE parked_at IS NOT NULL`); n != 2 {
		t.Fatalf("%d parked keys after the dry run, want 2", n)
	}

	res, err := cl.Unpark(ctx, admin.UnparkRequest{Actor: "alice", Key: "retry-me", Tenant: "acme", Action: admin.UnparkRetry, Reason: "mailbox restored"})
	if err != nil {
		t.Fatal(err)
	}
	if res.AuditID == 0 || len(res.Keys) != 1 {
		t.Fatalf("retry %+v", res)
	}
	if st, nst := jobState(t, s, headA), jobState(t, s, nextA); st != "available" || nst != "pending" || !inLine(t, s, nextA) {
		t.Fatalf("after retry: head %s, next %s (in the line: %t); want available, pending in the key's line", st, nst, inLine(t, s, nextA))
	}
	var actor, action, reason string
	if err := s.Pool.QueryRow(ctx, `SELECT actor, action, detail->>'reason' FROM outbox_audit WHERE id = $1`, res.AuditID).Scan(&actor, &action, &reason); err != nil {
		t.Fatal(err)
	}
	if actor != "alice" || action != "unpark" || reason != "mailbox restored" {
		t.Fatalf("audit row: %s %s %q", actor, action, reason)
	}

	if !inLine(t, s, nextB) {
		t.Fatal("the job behind the head to skip does not wait in the key's line")
	}
	res, err = cl.Unpark(ctx, admin.UnparkRequest{Actor: "bob", Key: "skip-me", Tenant: "acme", Queue: "outbox_order", Action: admin.UnparkSkip})
	if err != nil {
		t.Fatal(err)
	}
	// The skip released the next job: River's row, with the id it had in
	// the line.
	if st, nst := jobState(t, s, headB), jobState(t, s, nextB); res.AuditID == 0 || st != "discarded" || nst != "available" || inLine(t, s, nextB) {
		t.Fatalf("after skip (%+v): head %s, next %s (in the line: %t); want discarded, available in River", res, st, nst, inLine(t, s, nextB))
	}
	list, err := cl.Keys(ctx, admin.KeysFilter{ParkedOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Keys) != 0 {
		t.Fatalf("parked keys left: %+v", list.Keys)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit WHERE action = 'unpark'`); n != 2 {
		t.Fatalf("%d audit rows, want 2", n)
	}
}

// TestUnparkRefusesAndExplains: bad requests name their field; a key that
// is not parked says what holds it (a failed event in the outbox: requeue or
// cancel it by id; a running head); a deleted head cannot be retried, dry
// run or not.
func TestUnparkRefusesAndExplains(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)

	var se *admin.SelectionError
	for _, c := range []struct {
		req  admin.UnparkRequest
		flag string
	}{
		{admin.UnparkRequest{Key: "k", Action: "retry"}, "actor"},
		{admin.UnparkRequest{Actor: "a", Action: "retry"}, "key"},
		{admin.UnparkRequest{Actor: "a", Key: strings.Repeat("k", 257), Action: "retry"}, "key"},
		{admin.UnparkRequest{Actor: "a", Key: "k", Action: "retry", Reason: strings.Repeat("r", admin.MaxReasonBytes+1)}, "reason"},
		{admin.UnparkRequest{Actor: "a", Key: "k", Action: "delete"}, ""},
	} {
		_, err := cl.Unpark(ctx, c.req)
		if !errors.As(err, &se) || se.Flag != c.flag {
			t.Errorf("Unpark(%+v) = %v, want a SelectionError on %q", c.req, err, c.flag)
		}
	}
	if _, err := cl.Unpark(ctx, admin.UnparkRequest{Actor: "a", Key: "k", Action: "delete"}); err == nil || !strings.Contains(err.Error(), `action must be retry`) || !strings.Contains(err.Error(), `"delete"`) {
		t.Fatalf("unknown action: %v", err)
	}

	held := keyed(t, s, "acme", "held", 1)
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed' WHERE id = $1`, held[0]); err != nil {
		t.Fatal(err)
	}
	keyed(t, s, "acme", "held", 1)
	running := keyed(t, s, "", "busy", 2)
	deleted := keyed(t, s, "", "deleted", 2)
	handOff(t, s)
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = $1`, jobOf(t, s, running[0])); err != nil {
		t.Fatal(err)
	}
	head := jobOf(t, s, deleted[0])
	discard(t, s, head)
	if _, err := s.Pool.Exec(ctx, `DELETE FROM river_job WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}

	_, err := cl.Unpark(ctx, admin.UnparkRequest{Actor: "a", Key: "held", Tenant: "acme", Action: admin.UnparkSkip})
	var np *admin.NotParkedError
	if !errors.Is(err, admin.ErrNotParked) || !errors.As(err, &np) || np.HeldByEvent != held[0] ||
		!strings.Contains(err.Error(), "requeue --id") || !strings.Contains(err.Error(), "held in the outbox") {
		t.Fatalf("held key: %v", err)
	}
	_, err = cl.Unpark(ctx, admin.UnparkRequest{Actor: "a", Key: "busy", Action: admin.UnparkRetry})
	if !errors.Is(err, admin.ErrNotParked) || !strings.Contains(err.Error(), "is running") {
		t.Fatalf("running key: %v", err)
	}
	_, err = cl.Unpark(ctx, admin.UnparkRequest{Actor: "a", Key: "busy", Tenant: "acme", Action: admin.UnparkRetry})
	if !errors.Is(err, admin.ErrNotParked) || !strings.Contains(err.Error(), "check --tenant") {
		t.Fatalf("wrong tenant: %v", err)
	}
	for _, dry := range []bool{true, false} {
		_, err = cl.Unpark(ctx, admin.UnparkRequest{Actor: "a", Key: "deleted", Action: admin.UnparkRetry, DryRun: dry})
		if !errors.As(err, &se) || se.Flag != "retry" || !strings.Contains(err.Error(), "cannot be retried") {
			t.Fatalf("retry of a deleted head (dry run %v): %v", dry, err)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit`); n != 0 {
		t.Fatalf("refused unparks wrote %d audit rows", n)
	}
	// Skipping the deleted head works.
	if _, err := cl.Unpark(ctx, admin.UnparkRequest{Actor: "a", Key: "deleted", Action: admin.UnparkSkip}); err != nil {
		t.Fatal(err)
	}
	if st := jobState(t, s, jobOf(t, s, deleted[1])); st != "available" {
		t.Fatalf("next job after skipping a deleted head: %s", st)
	}
}

// TestExplainShowsTheOrder: a keyed event shows its key and position; held
// in the outbox, the earlier failed event it waits for; in River, whether
// its job is the head, and the head it waits behind, parked or not.
func TestExplainShowsTheOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)

	evs := keyed(t, s, "acme", "order-7", 3)
	handOff(t, s)
	head := jobOf(t, s, evs[0])
	ex, err := cl.Explain(ctx, evs[0], admin.ExplainOpts{})
	if err != nil {
		t.Fatal(err)
	}
	o := ex.Ordering
	if o == nil || o.Key != "order-7" || ex.Event.OrderingKey == nil || *ex.Event.OrderingPosition != o.Position || len(o.Queues) != 1 ||
		!o.Queues[0].IsHead || o.Queues[0].Behind != 2 || o.WaitsFor != nil || !strings.Contains(o.Queues[0].Note, "is the head") {
		t.Fatalf("head event: %+v", o)
	}
	if o.Queues[0].InLine || len(ex.Jobs) != 1 || ex.Jobs[0].InLine || ex.Jobs[0].ID != head || ex.Jobs[0].State != "available" {
		t.Fatalf("head event: %+v (jobs %+v), want its job in River, not in the line", o.Queues[0], ex.Jobs)
	}
	ex, err = cl.Explain(ctx, evs[2], admin.ExplainOpts{})
	if err != nil {
		t.Fatal(err)
	}
	// It waits in the key's line, not in River yet: explain reads it from
	// the line, pending. (Read from river_job only, it was not found and
	// the event had no queue to explain.)
	if len(ex.Ordering.Queues) != 1 {
		t.Fatalf("third event: queues %+v (jobs %+v), want its job's queue", ex.Ordering.Queues, ex.Jobs)
	}
	q := ex.Ordering.Queues[0]
	if q.IsHead || q.JobState != "pending" || !q.InLine || q.HeadJobID == nil || *q.HeadJobID != head || *q.HeadEventID != evs[0] || q.Ahead != 1 ||
		q.Parked || q.HeadState != "available" || ex.Ordering.Position <= o.Position ||
		!strings.Contains(q.Note, "in the key's line, not in River yet") {
		t.Fatalf("third event: %+v", q)
	}
	if j := ex.Jobs; len(j) != 1 || !j[0].Found || !j[0].InLine || j[0].State != "pending" || j[0].ID != jobOf(t, s, evs[2]) || j[0].Queue != "outbox_order" {
		t.Fatalf("third event's jobs %+v, want its job pending in the key's line", j)
	}
	if b, err := json.Marshal(ex.Jobs[0]); err != nil || !strings.Contains(string(b), `"in_line":true`) {
		t.Fatalf("third event's job as JSON: %s (%v), want in_line true", b, err)
	}
	discard(t, s, head)
	ex, err = cl.Explain(ctx, evs[2], admin.ExplainOpts{})
	if err != nil {
		t.Fatal(err)
	}
	if len(ex.Ordering.Queues) != 1 {
		t.Fatalf("behind a parked head: queues %+v (jobs %+v), want its job's queue", ex.Ordering.Queues, ex.Jobs)
	}
	if q := ex.Ordering.Queues[0]; !q.Parked || q.ParkedState != "discarded" || q.ParkedAt == nil || !strings.Contains(q.Note, "parked") ||
		!q.InLine || !strings.Contains(q.Note, "in the key's line, not in River yet") {
		t.Fatalf("behind a parked head: %+v", q)
	}

	// In the outbox: the later event waits for the failed one.
	held := keyed(t, s, "", "held", 1)
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed' WHERE id = $1`, held[0]); err != nil {
		t.Fatal(err)
	}
	later := keyed(t, s, "", "held", 2)
	handOff(t, s)
	ex, err = cl.Explain(ctx, later[1], admin.ExplainOpts{})
	if err != nil {
		t.Fatal(err)
	}
	o = ex.Ordering
	if ex.Event.Status != "pending" || o.EarlierUnfinished != 2 || o.WaitsFor == nil || o.WaitsFor.ID != later[0] || o.WaitsFor.Status != "pending" ||
		o.FirstFailed == nil || o.FirstFailed.ID != held[0] || len(o.Queues) != 0 {
		t.Fatalf("held in the outbox: %+v (waits for %+v, first failed %+v)", o, o.WaitsFor, o.FirstFailed)
	}
	// The handoff found it held behind a dead letter and moved its due
	// time (migration 021): explain shows its own.
	if ex.Event.HeldFrom == nil || !ex.Event.ScheduledAt.After(*ex.Event.HeldFrom) {
		t.Fatalf("held in the outbox: due %s, held from %v, want its own due time before the moved one", ex.Event.ScheduledAt, ex.Event.HeldFrom)
	}
	if ex, err = cl.Explain(ctx, held[0], admin.ExplainOpts{}); err != nil || ex.Event.HeldFrom != nil {
		t.Fatalf("the failed event itself: held from %v (%v), want none", ex.Event.HeldFrom, err)
	}

	// An event without a key has no ordering.
	plain := pgtest.Publish(t, s.Pool, outbox.Event{Type: "order.item.changed", Payload: json.RawMessage(`{}`)})
	ex, err = cl.Explain(ctx, plain[0], admin.ExplainOpts{})
	if err != nil {
		t.Fatal(err)
	}
	if ex.Ordering != nil || ex.Event.OrderingKey != nil {
		t.Fatalf("unkeyed event has ordering %+v", ex.Ordering)
	}
}

// TestPublishCarriesTheOrderingKey: admin.Publish stores the event's
// ordering key and gives it a position.
func TestPublishCarriesTheOrderingKey(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	res, err := admin.New(s.Pool).Publish(ctx, outbox.Event{Type: "order.item.changed", Payload: json.RawMessage(`{}`), OrderingKey: "o-1"})
	if err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = $1 AND ordering_key = 'o-1' AND ordering_position IS NOT NULL`, res.ID); n != 1 {
		t.Fatal("the ordering key was not stored")
	}
}

// TestUnparkReleasesAKeyWhoseHeadWasDeleted: a head job deleted before it
// was finalized (River UI deletes an available, scheduled or retryable
// job) parks its key as deleted (the outbox_ordering_deleted trigger), so
// that the jobs behind it do not wait unseen for a job that no longer
// exists: Keys lists it with its head missing, and Unpark --skip releases
// the next job.
func TestUnparkReleasesAKeyWhoseHeadWasDeleted(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	evs := keyed(t, s, "", "gone", 2)
	handOff(t, s)
	head, next := jobOf(t, s, evs[0]), jobOf(t, s, evs[1])
	// River UI's delete of a retryable job.
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'retryable', attempt = 1, scheduled_at = now() + interval '1 hour' WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `DELETE FROM river_job WHERE id = $1`, head); err != nil {
		t.Fatal(err)
	}
	list, err := cl.Keys(ctx, admin.KeysFilter{Key: "gone"})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Keys) != 1 || list.Keys[0].Head.JobFound {
		t.Fatalf("keys %+v, want the key with its head gone", list.Keys)
	}
	if _, err := cl.Unpark(ctx, admin.UnparkRequest{Actor: "alice", Key: "gone", Action: admin.UnparkSkip}); err != nil {
		t.Fatalf("skip of a deleted head: %v", err)
	}
	if st := jobState(t, s, next); st != "available" {
		t.Fatalf("the job behind the deleted head is %s, want available", st)
	}
}

// TestKeysAndUnparkPerQueue: an event routed to two queues is ordered in
// each; a key parked in one queue is listed for that queue only, an unpark
// naming the other queue says where it is parked, and unparking the parked
// queue leaves the other alone.
func TestKeysAndUnparkPerQueue(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	routes, err := route.New([]route.Rule{{Prefix: "order.", Queues: []string{"outbox_order", "outbox_audit"}}})
	if err != nil {
		t.Fatal(err)
	}
	evs := keyed(t, s, "acme", "fan", 2)
	ordertest.HandOff(t, s.Pool, routes)
	var orderHead, auditHead int64
	if err := s.Pool.QueryRow(ctx, `SELECT (SELECT id FROM river_job WHERE id = ANY(e.river_job_ids) AND queue = 'outbox_order'),
		(SELECT id FROM river_job WHERE id = ANY(e.river_job_ids) AND queue = 'outbox_audit') FROM outbox_event e WHERE e.id = $1`, evs[0]).Scan(&orderHead, &auditHead); err != nil {
		t.Fatal(err)
	}
	discard(t, s, orderHead)

	list, err := cl.Keys(ctx, admin.KeysFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Keys) != 1 || list.Keys[0].Queue != "outbox_order" || *list.Keys[0].Head.JobID != orderHead {
		t.Fatalf("keys %+v, want the key parked in outbox_order only", list.Keys)
	}
	_, err = cl.Unpark(ctx, admin.UnparkRequest{Actor: "a", Key: "fan", Tenant: "acme", Queue: "outbox_audit", Action: admin.UnparkRetry})
	if !errors.Is(err, admin.ErrNotParked) || !strings.Contains(err.Error(), `parked in queue "outbox_order"`) {
		t.Fatalf("unpark in the other queue: %v", err)
	}
	res, err := cl.Unpark(ctx, admin.UnparkRequest{Actor: "a", Key: "fan", Tenant: "acme", Action: admin.UnparkRetry})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Keys) != 1 || res.Keys[0].Queue != "outbox_order" || jobState(t, s, orderHead) != "available" || jobState(t, s, auditHead) != "available" {
		t.Fatalf("unpark %+v: order head %s, audit head %s", res, jobState(t, s, orderHead), jobState(t, s, auditHead))
	}
}
