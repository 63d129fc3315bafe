package admin_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/retention"
	"github.com/outboxhq/outbox/route"
)

// insert writes one event in the given state directly and returns its id.
func insert(t *testing.T, s *pgtest.Schema, typ, status, tenant string) int64 {
	t.Helper()
	var id int64
	err := s.Pool.QueryRow(context.Background(), `
		INSERT INTO outbox_event (event_type, payload, status, tenant_id, last_error, retries, processed_at, locked_until)
		VALUES ($1, '{"k":"v"}', $2::outbox_status, nullif($3, ''),
		        CASE WHEN $2 IN ('failed', 'cancelled') THEN 'smtp timeout' END,
		        CASE WHEN $2 = 'failed' THEN 7 ELSE 0 END,
		        CASE WHEN $2 = 'done' THEN now() END,
		        CASE WHEN $2 = 'processing' THEN now() + interval '1 minute' END)
		RETURNING id`, typ, status, tenant).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func statusOf(t *testing.T, s *pgtest.Schema, id int64) string {
	t.Helper()
	var st string
	if err := s.Pool.QueryRow(context.Background(), `SELECT status::text FROM outbox_event WHERE id = $1`, id).Scan(&st); err != nil {
		t.Fatal(err)
	}
	return st
}

func TestRequeueDryRunThenRun(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	mailA := insert(t, s, "mail.user.welcome", "failed", "t1")
	mailB := insert(t, s, "mail.user.reset", "failed", "t2")
	billing := insert(t, s, "billing.invoice.paid", "failed", "t1")
	pending := insert(t, s, "mail.user.welcome", "pending", "t1")

	sel := admin.Selection{TypePrefix: "mail."}
	dry, err := cl.Requeue(ctx, sel, admin.RequeueOpts{Actor: "alice", DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if !dry.DryRun || dry.Affected != 2 || !slices.Equal(dry.IDs, []int64{mailA, mailB}) || dry.From["failed"] != 2 || dry.AuditID != 0 {
		t.Fatalf("dry run %+v", dry)
	}
	// The defaults are filled in: the result says what ran.
	if dry.Selection.Limit != admin.DefaultLimit || !slices.Equal(dry.Selection.Statuses, []string{"failed"}) {
		t.Fatalf("selection as run %+v", dry.Selection)
	}
	if st := statusOf(t, s, mailA); st != "failed" {
		t.Fatalf("dry run changed event %d to %s", mailA, st)
	}

	res, err := cl.Requeue(ctx, sel, admin.RequeueOpts{Actor: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Affected != dry.Affected || !slices.Equal(res.IDs, dry.IDs) || res.AuditID == 0 || res.Actor != "alice" || res.Warning != "" {
		t.Fatalf("run %+v, dry run %+v", res, dry)
	}
	for id, want := range map[int64]string{mailA: "pending", mailB: "pending", billing: "failed", pending: "pending"} {
		if got := statusOf(t, s, id); got != want {
			t.Errorf("event %d: %s, want %s", id, got, want)
		}
	}

	// By id: every status is accounted for; an unknown id is "not_found".
	res, err = cl.Requeue(ctx, admin.Selection{IDs: []int64{billing, pending, 424242}}, admin.RequeueOpts{Actor: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Affected != 1 || res.Skipped["pending"] != 1 || res.Skipped["not_found"] != 1 {
		t.Fatalf("by id %+v", res)
	}
}

func TestRequeueReplayWarnsAndCancelSkipsDone(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	done := insert(t, s, "mail.user.welcome", "done", "")
	failed := insert(t, s, "mail.user.welcome", "failed", "")

	res, err := cl.Cancel(ctx, admin.Selection{IDs: []int64{done, failed}}, admin.CancelOpts{Actor: "bob"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Action != "cancel" || !slices.Equal(res.IDs, []int64{failed}) || res.Skipped["done"] != 1 || res.AuditID == 0 {
		t.Fatalf("cancel %+v", res)
	}

	// Done events need AllowReplay; with it the result warns.
	var serr *admin.SelectionError
	if _, err := cl.Requeue(ctx, admin.Selection{IDs: []int64{done}, Statuses: []string{"done"}}, admin.RequeueOpts{Actor: "bob"}); !errors.As(err, &serr) || serr.Flag != "status" {
		t.Fatalf("requeue done without AllowReplay: %v", err)
	}
	res, err = cl.Requeue(ctx, admin.Selection{IDs: []int64{done}}, admin.RequeueOpts{Actor: "bob", AllowReplay: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Affected != 1 || res.From["done"] != 1 || !strings.HasPrefix(res.Warning, "1 done event is replayed") {
		t.Fatalf("replay %+v", res)
	}
}

// TestSelectionRefusedBeforeTheDatabase: a refused selection is a
// *SelectionError naming the flag, returned without a query (the client has
// no pool at all).
func TestSelectionRefusedBeforeTheDatabase(t *testing.T) {
	t.Parallel()
	cl := admin.New(nil)
	ctx := context.Background()
	since := time.Now()
	until := since.Add(-time.Hour)
	for _, tc := range []struct {
		name string
		sel  admin.Selection
		opts admin.RequeueOpts
		flag string
	}{
		{"bulk without All", admin.Selection{}, admin.RequeueOpts{Actor: "a"}, ""},
		{"no actor", admin.Selection{IDs: []int64{1}}, admin.RequeueOpts{}, "actor"},
		{"NUL in actor", admin.Selection{IDs: []int64{1}}, admin.RequeueOpts{Actor: "a\x00"}, "actor"},
		{"pending", admin.Selection{All: true, Statuses: []string{"pending"}}, admin.RequeueOpts{Actor: "a"}, "status"},
		{"unknown status", admin.Selection{All: true, Statuses: []string{"lost"}}, admin.RequeueOpts{Actor: "a"}, "status"},
		{"limit", admin.Selection{All: true, Limit: admin.MaxLimit + 1}, admin.RequeueOpts{Actor: "a"}, "limit"},
		{"NUL in prefix", admin.Selection{TypePrefix: "a\x00"}, admin.RequeueOpts{Actor: "a"}, "type-prefix"},
		{"since after until", admin.Selection{Since: &since, Until: &until}, admin.RequeueOpts{Actor: "a"}, "since"},
	} {
		_, err := cl.Requeue(ctx, tc.sel, tc.opts)
		var serr *admin.SelectionError
		if !errors.As(err, &serr) || serr.Flag != tc.flag {
			t.Errorf("%s: %v (%#v), want a SelectionError for %q", tc.name, err, err, tc.flag)
		}
	}
	var serr *admin.SelectionError
	if _, err := cl.Cancel(ctx, admin.Selection{All: true, Statuses: []string{"done"}}, admin.CancelOpts{Actor: "a"}); !errors.As(err, &serr) || serr.Flag != "status" {
		t.Errorf("cancel done: %v", err)
	}
	if _, err := cl.AuditList(ctx, admin.AuditOpts{Limit: -1}); !errors.As(err, &serr) || serr.Flag != "limit" {
		t.Errorf("audit limit -1: %v", err)
	}
	if _, err := cl.RetentionRun(ctx, admin.RetentionOpts{MaxAge: time.Minute, Actor: "a"}); !errors.As(err, &serr) || serr.Flag != "hours" {
		t.Errorf("retention of a minute: %v", err)
	}
}

func TestStatsCountsQueuesAndAlerts(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	insert(t, s, "mail.user.welcome", "failed", "")
	insert(t, s, "mail.user.welcome", "failed", "")
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, scheduled_at) VALUES ('mail.user.welcome', '{}', now() - interval '5 minutes')`); err != nil {
		t.Fatal(err)
	}
	routes, err := route.New([]route.Rule{{Prefix: "mail.", Queues: []string{"outbox_mail"}}, {Prefix: "audit.", Queues: []string{"outbox_audit"}}})
	if err != nil {
		t.Fatal(err)
	}

	st, err := cl.Stats(ctx, admin.StatsOpts{})
	if err != nil {
		t.Fatal(err)
	}
	if st.Events["failed"] != 2 || st.Events["pending"] != 1 || st.Events["done"] != 0 || len(st.Events) != 5 {
		t.Fatalf("events %v", st.Events)
	}
	if st.PendingDueOver60s != 1 || st.OldestDuePendingAgeS < 290 || st.WorkedQueuesKnown || st.StalledAfterS != admin.DefaultStalledAfter.Seconds() {
		t.Fatalf("stats %+v", st)
	}
	// The zero Thresholds alert on any lag and any failed event.
	if names := alertNames(st); names != "[dispatcher_behind events_failed]" {
		t.Fatalf("alerts %s", names)
	}

	st, err = cl.Stats(ctx, admin.StatsOpts{Routes: routes, WorkedQueues: []string{"outbox_mail"}, WorkedQueuesSource: "test",
		Thresholds: admin.DefaultThresholds()})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Queues) != 2 || st.Queues[0].Queue != "outbox_audit" || *st.Queues[0].Worked || !*st.Queues[1].Worked || st.WorkedQueuesSource != "test" {
		t.Fatalf("queues %+v", st.Queues)
	}
	if len(st.UnworkedRoutes) != 1 || st.UnworkedRoutes[0] != (admin.UnworkedRoute{Prefix: "audit.", Queue: "outbox_audit"}) {
		t.Fatalf("unworked %+v", st.UnworkedRoutes)
	}
	if names := alertNames(st); names != "[events_failed routes_unworked]" {
		t.Fatalf("alerts %s", names)
	}

	// With routes and no worked queues, river_queue says (no worker ran
	// here: every route is unworked).
	st, err = cl.Stats(ctx, admin.StatsOpts{Routes: routes, Thresholds: admin.Thresholds{MaxBehind: -1, MaxStalled: -1, MaxFailed: -1, MaxDiscarded: -1}})
	if err != nil {
		t.Fatal(err)
	}
	if !st.WorkedQueuesKnown || st.WorkedQueuesSource != "river_queue (workers seen recently)" || len(st.UnworkedRoutes) != 2 {
		t.Fatalf("stats from river_queue %+v", st)
	}
	if names := alertNames(st); names != "[routes_unworked]" {
		t.Fatalf("alerts %s", names)
	}
}

func alertNames(st *admin.Stats) string {
	var names []string
	for _, a := range st.Alerts {
		names = append(names, a.Name)
	}
	return fmt.Sprint(names)
}

func TestExplainEventRoutesAndNotFound(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	id := insert(t, s, "mail.user.welcome", "failed", "acme")
	routes, err := route.New([]route.Rule{{Prefix: "mail.", Queues: []string{"outbox_mail"}}})
	if err != nil {
		t.Fatal(err)
	}

	ex, err := cl.Explain(ctx, id, admin.ExplainOpts{Routes: routes, RoutesFile: "routes.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	e := ex.Event
	if e.ID != id || e.Type != "mail.user.welcome" || e.Status != "failed" || e.TenantID == nil || *e.TenantID != "acme" ||
		e.LastError == nil || e.Retries != 7 || string(e.Payload) != `{"k": "v"}` || e.PayloadText != nil {
		t.Fatalf("event %+v", e)
	}
	if ex.Routes == nil || !ex.Routes.Matched || ex.Routes.Prefix != "mail." || ex.Routes.File != "routes.yaml" {
		t.Fatalf("routes %+v", ex.Routes)
	}
	if ex.Jobs == nil || len(ex.Jobs) != 0 || ex.Receipts == nil || len(ex.Receipts) != 0 {
		t.Fatalf("jobs %v receipts %v", ex.Jobs, ex.Receipts)
	}
	if ex, err = cl.Explain(ctx, id, admin.ExplainOpts{}); err != nil || ex.Routes != nil {
		t.Fatalf("without routes: %v %+v", err, ex)
	}

	_, err = cl.Explain(ctx, 424242, admin.ExplainOpts{})
	if !errors.Is(err, admin.ErrNotFound) || !strings.Contains(err.Error(), "event 424242 not found") {
		t.Fatalf("unknown id: %v", err)
	}
}

// TestAuditListKeepsStoredJSON: the audit rows come newest first with their
// filter as the database stores it, and AuditOpts select.
func TestAuditListKeepsStoredJSON(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	list, err := cl.AuditList(ctx, admin.AuditOpts{})
	if err != nil || list == nil || len(list) != 0 {
		t.Fatalf("empty audit: %v %v", list, err)
	}
	id := insert(t, s, "mail.user.welcome", "failed", "")
	first, err := cl.Requeue(ctx, admin.Selection{IDs: []int64{id}}, admin.RequeueOpts{Actor: "carol"})
	if err != nil {
		t.Fatal(err)
	}
	second, err := cl.Cancel(ctx, admin.Selection{IDs: []int64{id}}, admin.CancelOpts{Actor: "dave"})
	if err != nil {
		t.Fatal(err)
	}
	list, err = cl.AuditList(ctx, admin.AuditOpts{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 || list[0].ID != second.AuditID || list[1].ID != first.AuditID || list[0].Actor != "dave" || list[0].Action != "cancel" || list[0].Affected != 1 {
		t.Fatalf("audit %+v", list)
	}
	var stored string
	if err := s.Pool.QueryRow(ctx, `SELECT filter::text FROM outbox_audit WHERE id = $1`, first.AuditID).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if string(list[1].Filter) != stored || !json.Valid(list[1].Detail) {
		t.Fatalf("filter %s, stored %s; detail %s", list[1].Filter, stored, list[1].Detail)
	}
	list, err = cl.AuditList(ctx, admin.AuditOpts{Action: "requeue", Limit: 5})
	if err != nil || len(list) != 1 || list[0].ID != first.AuditID {
		t.Fatalf("requeue only: %+v %v", list, err)
	}
	future := time.Now().Add(time.Hour)
	if list, err = cl.AuditList(ctx, admin.AuditOpts{Since: &future}); err != nil || len(list) != 0 {
		t.Fatalf("since the future: %+v %v", list, err)
	}
	// By event: a change by filter lists the ids it changed.
	other := insert(t, s, "billing.invoice.paid", "failed", "")
	third, err := cl.Requeue(ctx, admin.Selection{TypePrefix: "billing."}, admin.RequeueOpts{Actor: "erin"})
	if err != nil {
		t.Fatal(err)
	}
	if list, err = cl.AuditList(ctx, admin.AuditOpts{EventID: other}); err != nil || len(list) != 1 || list[0].ID != third.AuditID {
		t.Fatalf("by event %d: %+v %v", other, list, err)
	}
	if list, err = cl.AuditList(ctx, admin.AuditOpts{EventID: id}); err != nil || len(list) != 2 {
		t.Fatalf("by event %d: %+v %v", id, list, err)
	}
}

func TestRetentionRunAuditsAndReportsLock(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO outbox_event (event_type, payload, status, processed_at)
		SELECT 'mail.user.welcome', '{}', 'done', now() - interval '40 days' FROM generate_series(1, 5)`); err != nil {
		t.Fatal(err)
	}
	opts := admin.RetentionOpts{MaxAge: 720 * time.Hour, BatchSize: 2, Actor: "erin", DryRun: true}
	dry, err := cl.RetentionRun(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	if dry.Deleted != 5 || !dry.DryRun || dry.AuditID != 0 || dry.Job != retention.JobName {
		t.Fatalf("dry run %+v", dry)
	}

	// While another process holds the job's lock, the run is refused.
	lock, err := retention.TryLock(ctx, s.Pool)
	if err != nil {
		t.Fatal(err)
	}
	opts.DryRun = false
	if _, err := cl.RetentionRun(ctx, opts); !errors.Is(err, retention.ErrLocked) || !strings.Contains(err.Error(), "try again") {
		t.Fatalf("run under a held lock: %v", err)
	}
	lock.Unlock(ctx)

	res, err := cl.RetentionRun(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted != 5 || res.Batches != 3 || res.AuditID == 0 {
		t.Fatalf("run %+v", res)
	}
	list, err := cl.AuditList(ctx, admin.AuditOpts{Action: "retention"})
	if err != nil || len(list) != 1 || list[0].ID != res.AuditID || list[0].Actor != "erin" || list[0].Affected != 5 {
		t.Fatalf("audit %+v %v", list, err)
	}
	var runBy string
	if err := s.Pool.QueryRow(ctx, `SELECT last_run_by FROM outbox_job_run WHERE name = $1`, retention.JobName).Scan(&runBy); err != nil || runBy != "admin erin" {
		t.Fatalf("last_run_by %q: %v", runBy, err)
	}
}

// TestSchemaMissing: before `outboxctl migrate`, every method returns
// ErrSchemaMissing, with the schema's name in the message.
func TestSchemaMissing(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true})
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	want := "the outbox schema is missing in " + s.Name + ": run `outboxctl migrate` first"
	calls := map[string]func() error{
		"Requeue": func() error {
			_, err := cl.Requeue(ctx, admin.Selection{IDs: []int64{1}}, admin.RequeueOpts{Actor: "a"})
			return err
		},
		"Cancel": func() error {
			_, err := cl.Cancel(ctx, admin.Selection{IDs: []int64{1}}, admin.CancelOpts{Actor: "a"})
			return err
		},
		"Publish": func() error {
			_, err := cl.Publish(ctx, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(`{}`)})
			return err
		},
		"Stats":   func() error { _, err := cl.Stats(ctx, admin.StatsOpts{}); return err },
		"Explain": func() error { _, err := cl.Explain(ctx, 1, admin.ExplainOpts{}); return err },
		"AuditList": func() error {
			_, err := cl.AuditList(ctx, admin.AuditOpts{})
			return err
		},
		"RetentionRun": func() error {
			_, err := cl.RetentionRun(ctx, admin.RetentionOpts{MaxAge: time.Hour, Actor: "a"})
			return err
		},
	}
	for name, call := range calls {
		err := call()
		if !errors.Is(err, admin.ErrSchemaMissing) || err.Error() != want {
			t.Errorf("%s: %v; want ErrSchemaMissing saying %q", name, err, want)
		}
	}
}

// TestPublishInItsOwnTransaction: Publish commits one event, returns the
// existing one for a duplicate key, and refuses invalid input.
func TestPublishInItsOwnTransaction(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	ev := outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(`{"user":1}`), TenantID: "acme", DispatchKey: "k1"}
	first, err := cl.Publish(ctx, ev)
	if err != nil || first.ID == 0 || first.Duplicate {
		t.Fatalf("publish: %+v %v", first, err)
	}
	if st := statusOf(t, s, first.ID); st != "pending" {
		t.Fatalf("published event is %s", st)
	}
	again, err := cl.Publish(ctx, ev)
	if err != nil || again.ID != first.ID || !again.Duplicate {
		t.Fatalf("duplicate: %+v %v", again, err)
	}
	if _, err := cl.Publish(ctx, outbox.Event{Type: "Bad.Type", Payload: json.RawMessage(`{}`)}); err == nil {
		t.Fatal("a bad type was published")
	}
}

// TestStatsTellsScheduledFromBacklog: events due tomorrow are counted as
// scheduled, not as the dispatcher's backlog, and raise no alert.
func TestStatsTellsScheduledFromBacklog(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO outbox_event (event_type, payload, scheduled_at)
		SELECT 'mail.user.remind', '{}', now() + interval '1 day' + make_interval(secs => g) FROM generate_series(1, 500) g;
		INSERT INTO outbox_event (event_type, payload, scheduled_at) VALUES ('mail.user.welcome', '{}', now() - interval '5 minutes')`); err != nil {
		t.Fatal(err)
	}
	st, err := admin.New(s.Pool).Stats(ctx, admin.StatsOpts{Thresholds: admin.DefaultThresholds()})
	if err != nil {
		t.Fatal(err)
	}
	if st.PendingDue != 1 || st.PendingScheduled != 500 || st.PendingDueOver60s != 1 || st.Events["pending"] != 501 {
		t.Fatalf("due %d scheduled %d over60 %d pending %d", st.PendingDue, st.PendingScheduled, st.PendingDueOver60s, st.Events["pending"])
	}
	if st.NextScheduledDueAt == nil || time.Until(*st.NextScheduledDueAt) < 23*time.Hour {
		t.Fatalf("next due %v", st.NextScheduledDueAt)
	}
	if names := alertNames(st); names != "[]" {
		t.Fatalf("alerts %s: 500 events scheduled for tomorrow are no backlog", names)
	}
}

// TestExplainTellsDeletedJobs: a job missing from river_job is judged by the
// evidence: a done receipt of the job (it ran), a handoff younger than
// River's retention (deleted by hand, work maybe lost), or an older one
// (most likely the cleaner).
func TestExplainTellsDeletedJobs(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	handOff := func(age string, jobs ...int64) int64 {
		id := insert(t, s, "mail.user.welcome", "done", "")
		if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET processed_at = now() - $2::interval, river_job_ids = $3 WHERE id = $1`, id, age, jobs); err != nil {
			t.Fatal(err)
		}
		return id
	}
	fresh := handOff("1 minute", 900001, 900002)
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_receipt (receiver, event_id, state, job_id, attempt, expires_at)
		VALUES ('mailer', $1, 'done', 900002, 1, now() + interval '1 day')`, fresh); err != nil {
		t.Fatal(err)
	}
	old := handOff("2 days", 900003)

	ex, err := cl.Explain(ctx, fresh, admin.ExplainOpts{})
	if err != nil {
		t.Fatal(err)
	}
	if len(ex.Jobs) != 2 || ex.Jobs[0].Found || ex.Jobs[0].Missing != admin.MissingBeforeRetention ||
		!strings.Contains(ex.Jobs[0].MissingNote, "deleted by hand") || ex.Jobs[1].Missing != admin.MissingAfterCompletion {
		t.Fatalf("fresh handoff: %+v", ex.Jobs)
	}
	if ex, err = cl.Explain(ctx, old, admin.ExplainOpts{}); err != nil {
		t.Fatal(err)
	}
	if len(ex.Jobs) != 1 || ex.Jobs[0].Missing != admin.MissingAfterRetention || !strings.Contains(ex.Jobs[0].MissingNote, "cleaner") {
		t.Fatalf("old handoff: %+v", ex.Jobs)
	}
	// A longer retention (the workers keep jobs 3 days) makes the old
	// handoff too young for the cleaner.
	if ex, err = cl.Explain(ctx, old, admin.ExplainOpts{JobRetention: 72 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	if ex.Jobs[0].Missing != admin.MissingBeforeRetention {
		t.Fatalf("old handoff, 72 h retention: %+v", ex.Jobs)
	}
}

// TestStatsCountsJobsOfRouteKinds: jobs a route gave a kind of its own
// (they carry the event in their metadata) count in their queue, beside
// envelope jobs; jobs nobody handed off through the outbox do not.
func TestStatsCountsJobsOfRouteKinds(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO river_job (kind, queue, args, metadata, state, max_attempts) VALUES
		  ('outbox_event',       'mail', '{"event_id": 1}', '{}',                         'available', 25),
		  ('send_invoice_email', 'mail', '{"invoice_id": 1}', '{"outbox_event_id": 2}',  'available', 25),
		  ('send_invoice_email', 'mail', '{"invoice_id": 2}', '{}',                         'available', 25)`); err != nil {
		t.Fatal(err)
	}
	st, err := admin.New(s.Pool).Stats(ctx, admin.StatsOpts{})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Queues) != 1 || st.Queues[0].Queue != "mail" || st.Queues[0].Available != 2 {
		t.Fatalf("queues %+v, want mail with 2 available (the envelope job and the route-kind job)", st.Queues)
	}
}

// TestRoutesSyncDryRunThenRun: a dry run reports the change and writes
// nothing; the real run writes the routes and an audit row; a bad actor is
// refused before the database.
func TestRoutesSyncDryRunThenRun(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	routes, err := route.New([]route.Rule{{Prefix: "mail.", Queues: []string{"outbox_mail"}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.RoutesSync(ctx, admin.RoutesSyncOpts{Routes: routes, Actor: ""}); !errors.As(err, new(*admin.SelectionError)) {
		t.Fatalf("empty actor: %v", err)
	}
	dry, err := cl.RoutesSync(ctx, admin.RoutesSyncOpts{Routes: routes, Source: "routes.yaml", Actor: "alice", DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if !dry.DryRun || len(dry.Added) != 1 || dry.AuditID != nil || pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_route`) != 0 {
		t.Fatalf("dry run %+v", dry)
	}
	on := true
	res, err := cl.RoutesSync(ctx, admin.RoutesSyncOpts{Routes: routes, Source: "routes.yaml", Actor: "alice", Strict: &on})
	if err != nil {
		t.Fatal(err)
	}
	if res.AuditID == nil || !res.StrictAfter || pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_route`) != 1 ||
		pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit WHERE action = 'routes-sync' AND actor = 'alice'`) != 1 {
		t.Fatalf("sync %+v", res)
	}
}
