package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// octl runs outboxctl in-process against the schema and returns the exit
// status, stdout and stderr.
func octl(t *testing.T, s *pgtest.Schema, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(args, s.URL, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// ctlJSON runs a command with --json, wants exit 0 and decodes stdout.
func ctlJSON[T any](t *testing.T, s *pgtest.Schema, args ...string) T {
	t.Helper()
	code, out, errOut := octl(t, s, append(args, "--json")...)
	if code != 0 {
		t.Fatalf("outboxctl %v: exit %d\nstdout: %s\nstderr: %s", args, code, out, errOut)
	}
	var v T
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("outboxctl %v: bad JSON %q: %v", args, out, err)
	}
	return v
}

type evSpec struct {
	typ, status, tenant, lastError string
	age                            time.Duration
}

// insert writes one event with the given state directly (the CLI must cope
// with any state a dispatcher can leave). It returns the id.
func insert(t *testing.T, pool *pgxpool.Pool, e evSpec) int64 {
	t.Helper()
	var tenant, lastErr *string
	if e.tenant != "" {
		tenant = &e.tenant
	}
	if e.lastError != "" {
		lastErr = &e.lastError
	}
	var id int64
	err := pool.QueryRow(context.Background(), `
		INSERT INTO outbox_event (event_type, payload, status, tenant_id, last_error, retries, created_at, scheduled_at, processed_at, locked_until)
		VALUES ($1, '{"secret":"x"}', $2::outbox_status, $3, $4,
		        CASE WHEN $2 = 'failed' THEN 7 ELSE 0 END,
		        now() - make_interval(secs => $5), now() - make_interval(secs => $5) + interval '1 hour',
		        CASE WHEN $2 = 'done' THEN now() END,
		        CASE WHEN $2 = 'processing' THEN now() + interval '1 minute' END)
		RETURNING id`, e.typ, e.status, tenant, lastErr, e.age.Seconds()).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

type eventRow struct {
	ID          int64
	Status      string
	Retries     int
	Due         bool   // scheduled_at <= now()
	LockedUntil string // "" when NULL
	ProcessedAt string
	LastError   string
}

func snapshot(t *testing.T, pool *pgxpool.Pool) map[int64]eventRow {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
		SELECT id, status::text, retries, scheduled_at <= now(),
		       coalesce(locked_until::text, ''), coalesce(processed_at::text, ''), coalesce(last_error, '') FROM outbox_event`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64]eventRow{}
	for rows.Next() {
		var r eventRow
		if err := rows.Scan(&r.ID, &r.Status, &r.Retries, &r.Due, &r.LockedUntil, &r.ProcessedAt, &r.LastError); err != nil {
			t.Fatal(err)
		}
		out[r.ID] = r
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func auditCount(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_audit`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

type selectOut struct {
	Action    string         `json:"action"`
	DryRun    bool           `json:"dry_run"`
	Affected  int            `json:"affected"`
	IDs       []int64        `json:"ids"`
	Skipped   map[string]int `json:"skipped"`
	Remaining int            `json:"remaining"`
	AuditID   int64          `json:"audit_id"`
	Warning   string         `json:"warning"`
}

// fixture is a spread of events for the filter tests.
type fixture struct {
	ids map[string]int64
}

func seedFixture(t *testing.T, pool *pgxpool.Pool) fixture {
	t.Helper()
	specs := map[string]evSpec{
		"mail-a":       {typ: "mail.user.welcome", status: "failed", tenant: "t1", lastError: "smtp timeout", age: 2 * time.Hour},
		"mail-b":       {typ: "mail.user.reset", status: "failed", tenant: "t2", lastError: "no route matches", age: 30 * time.Minute},
		"mail-old":     {typ: "mail.user.welcome", status: "failed", tenant: "t1", lastError: "smtp timeout", age: 72 * time.Hour},
		"mailer":       {typ: "mailer.user.sent", status: "failed", tenant: "t1", lastError: "smtp timeout", age: time.Hour},
		"billing":      {typ: "billing.invoice.paid", status: "failed", tenant: "t1", lastError: "500 from receiver", age: time.Hour},
		"mail-cancel":  {typ: "mail.user.welcome", status: "cancelled", tenant: "t1", lastError: "smtp timeout", age: time.Hour},
		"mail-pending": {typ: "mail.user.welcome", status: "pending", tenant: "t1", age: time.Hour},
		"mail-proc":    {typ: "mail.user.welcome", status: "processing", tenant: "t1", age: time.Hour},
		"mail-done":    {typ: "mail.user.welcome", status: "done", tenant: "t1", age: time.Hour},
		"pct":          {typ: "mail.user.welcome", status: "failed", tenant: "t%", lastError: "50% off_", age: time.Hour},
	}
	f := fixture{ids: map[string]int64{}}
	names := make([]string, 0, len(specs))
	for n := range specs {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		f.ids[n] = insert(t, pool, specs[n])
	}
	return f
}

func (f fixture) idsOf(names ...string) []int64 {
	out := make([]int64, len(names))
	for i, n := range names {
		out[i] = f.ids[n]
	}
	slices.Sort(out)
	return out
}

func TestRequeueEachFilterDryRunMatchesRealRun(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		args func(f fixture) []string
		want []string // fixture names requeued
	}{
		{"type prefix matches whole segments only", func(fixture) []string { return []string{"--type-prefix", "mail."} },
			[]string{"mail-a", "mail-b", "mail-old", "pct"}},
		{"tenant is exact (no LIKE wildcards)", func(fixture) []string { return []string{"--tenant", "t%"} }, []string{"pct"}},
		{"since", func(fixture) []string { return []string{"--since", "90m"} }, []string{"mail-b", "mailer", "billing", "pct"}},
		{"until", func(fixture) []string { return []string{"--until", "3h"} }, []string{"mail-old"}},
		{"error contains is literal", func(fixture) []string { return []string{"--error-contains", "% off_"} }, []string{"pct"}},
		{"error contains", func(fixture) []string { return []string{"--error-contains", "smtp", "--type-prefix", "mail."} },
			[]string{"mail-a", "mail-old"}},
		{"ids default to failed and cancelled", func(f fixture) []string {
			return []string{"--id", fmt.Sprint(f.ids["mail-a"]), "--id", fmt.Sprintf("%d,%d", f.ids["mail-cancel"], f.ids["billing"])}
		}, []string{"mail-a", "mail-cancel", "billing"}},
		{"status cancelled", func(fixture) []string { return []string{"--status", "cancelled", "--all"} }, []string{"mail-cancel"}},
		{"all failed", func(fixture) []string { return []string{"--status", "failed", "--all"} },
			[]string{"mail-a", "mail-b", "mail-old", "mailer", "billing", "pct"}},
		{"limit takes the lowest ids", func(f fixture) []string { return []string{"--all", "--limit", "2"} }, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
			f := seedFixture(t, s.Pool)
			want := f.idsOf(tc.want...)
			if tc.want == nil { // the limit case: the two lowest failed ids
				all := f.idsOf("mail-a", "mail-b", "mail-old", "mailer", "billing", "pct")
				want = all[:2]
			}
			args := append([]string{"requeue"}, tc.args(f)...)
			before := snapshot(t, s.Pool)

			dry := ctlJSON[selectOut](t, s, append(args, "--dry-run", "--actor", "alice")...)
			if !dry.DryRun || !slices.Equal(dry.IDs, want) || dry.Affected != len(want) {
				t.Fatalf("dry run = %+v, want ids %v", dry, want)
			}
			if after := snapshot(t, s.Pool); fmt.Sprint(after) != fmt.Sprint(before) {
				t.Fatal("the dry run changed events")
			}
			if n := auditCount(t, s.Pool); n != 0 {
				t.Fatalf("the dry run wrote %d audit rows", n)
			}

			real := ctlJSON[selectOut](t, s, append(args, "--actor", "alice")...)
			if real.Affected != dry.Affected || !slices.Equal(real.IDs, dry.IDs) {
				t.Fatalf("real run %+v differs from dry run %+v", real, dry)
			}
			after := snapshot(t, s.Pool)
			for id, b := range before {
				a := after[id]
				if !slices.Contains(want, id) {
					if fmt.Sprint(a) != fmt.Sprint(b) {
						t.Errorf("event %d not selected but changed: %+v -> %+v", id, b, a)
					}
					continue
				}
				if a.Status != "pending" || a.Retries != 0 || !a.Due || a.LockedUntil != "" || a.ProcessedAt != "" {
					t.Errorf("requeued event %d = %+v, want pending, retries 0, due now, unlocked, not processed", id, a)
				}
				if a.LastError != b.LastError || a.LastError == "" {
					t.Errorf("requeued event %d lost its last_error: %v -> %v", id, b.LastError, a.LastError)
				}
			}

			var actor, action string
			var affected int
			var filterJSON []byte
			err := s.Pool.QueryRow(context.Background(), `SELECT actor, action, affected, filter::text FROM outbox_audit WHERE id = $1`, real.AuditID).
				Scan(&actor, &action, &affected, &filterJSON)
			if err != nil || actor != "alice" || action != "requeue" || affected != len(want) {
				t.Fatalf("audit row = %q %q %d, %v", actor, action, affected, err)
			}
			if !json.Valid(filterJSON) || !strings.Contains(string(filterJSON), `"limit"`) {
				t.Fatalf("audit filter %s", filterJSON)
			}
		})
	}
}

func TestRequeueGuardrailsRefuseWithExit2(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	seedFixture(t, s.Pool)
	before := snapshot(t, s.Pool)
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"requeue"}, "pass --all"},
		{[]string{"requeue", "--status", "failed"}, "refusing to requeue every failed event without a filter"},
		{[]string{"requeue", "--status", "pending", "--all"}, "--status: requeue never touches pending events"},
		{[]string{"cancel", "--status", "cancelled", "--type-prefix", "mail."}, "--status: cancel never touches cancelled events"},
		{[]string{"requeue", "--status", "done", "--type-prefix", "mail."}, "--allow-replay"},
		{[]string{"requeue", "--status", "dead", "--all"}, `--status: "dead" is not a status`},
		{[]string{"requeue", "--all", "--limit", "0"}, "--limit: 0 is out of range"},
		{[]string{"requeue", "--all", "--limit", "1000001"}, "--limit: 1000001 is out of range"},
		{[]string{"requeue", "--since", "yesterday"}, "--since: \"yesterday\" is not a time"},
		{[]string{"requeue", "--since", "1h", "--until", "2h"}, "--since"},
		{[]string{"requeue", "--id", "abc"}, "--id: \"abc\" is not an event id"},
		{[]string{"requeue", "--all", "stray"}, "unexpected argument"},
		{[]string{"requeue", "--all", "--actor", ""}, "--actor"},
		{[]string{"cancel", "--all", "--status", "done"}, "--status: cancel never touches done events"},
		{[]string{"cancel", "--type-prefix", "mail.", "--allow-replay"}, "flag provided but not defined: -allow-replay"},
		{[]string{"cancel"}, "refusing to cancel every pending/failed event"},
	}
	for _, tc := range cases {
		code, out, errOut := octl(t, s, tc.args...)
		if code != 2 {
			t.Errorf("%v: exit %d, want 2 (stdout %q, stderr %q)", tc.args, code, out, errOut)
			continue
		}
		if !strings.Contains(errOut, tc.want) {
			t.Errorf("%v: stderr %q does not contain %q", tc.args, errOut, tc.want)
		}
	}
	if after := snapshot(t, s.Pool); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Fatal("a refused command changed events")
	}
	if n := auditCount(t, s.Pool); n != 0 {
		t.Fatalf("refused commands wrote %d audit rows", n)
	}
}

func TestRequeueByIDSkipsPendingProcessingAndDone(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	f := seedFixture(t, s.Pool)
	idArgs := []string{"requeue"}
	for _, n := range []string{"mail-a", "mail-pending", "mail-proc", "mail-done"} {
		idArgs = append(idArgs, "--id", fmt.Sprint(f.ids[n]))
	}
	idArgs = append(idArgs, "--id", "999999")
	before := snapshot(t, s.Pool)

	res := ctlJSON[selectOut](t, s, idArgs...)
	if !slices.Equal(res.IDs, f.idsOf("mail-a")) {
		t.Fatalf("requeued %v, want only the failed event", res.IDs)
	}
	want := map[string]int{"pending": 1, "processing": 1, "done": 1, "not_found": 1}
	if fmt.Sprint(res.Skipped) != fmt.Sprint(want) {
		t.Fatalf("skipped %v, want %v", res.Skipped, want)
	}
	after := snapshot(t, s.Pool)
	for _, n := range []string{"mail-pending", "mail-proc", "mail-done"} {
		if id := f.ids[n]; fmt.Sprint(after[id]) != fmt.Sprint(before[id]) {
			t.Errorf("%s changed: %+v -> %+v", n, before[id], after[id])
		}
	}

	// The text form says the same.
	code, out, _ := octl(t, s, idArgs[:3]...)
	if code != 0 || !strings.Contains(out, "0 events requeued") {
		t.Fatalf("text output (exit %d): %q", code, out)
	}
	code, out, _ = octl(t, s, "requeue", "--id", fmt.Sprint(f.ids["mail-pending"]), "--dry-run")
	if code != 0 || !strings.Contains(out, "skipped: 1 pending") || !strings.Contains(out, "dry run: nothing changed") {
		t.Fatalf("text output (exit %d): %q", code, out)
	}
}

func TestReplayDoneNeedsAllowReplayAndWarns(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	f := seedFixture(t, s.Pool)
	done := fmt.Sprint(f.ids["mail-done"])

	code, _, errOut := octl(t, s, "requeue", "--status", "done", "--id", done)
	if code != 2 || !strings.Contains(errOut, "--allow-replay") || !strings.Contains(errOut, "idempotent") {
		t.Fatalf("replay without --allow-replay: exit %d, %q", code, errOut)
	}

	code, out, errOut := octl(t, s, "requeue", "--id", done, "--allow-replay", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var res selectOut
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.IDs, f.idsOf("mail-done")) || !strings.Contains(res.Warning, "idempotent") {
		t.Fatalf("replay = %+v", res)
	}
	if !strings.Contains(errOut, "warning:") || !strings.Contains(errOut, "receivers must be idempotent") {
		t.Fatalf("no warning on stderr: %q", errOut)
	}
	if r := snapshot(t, s.Pool)[f.ids["mail-done"]]; r.Status != "pending" || r.ProcessedAt != "" {
		t.Fatalf("replayed event = %+v", r)
	}
}

func TestCancelSkipsLockedAndMatchesDryRun(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	f := seedFixture(t, s.Pool)
	locked := insert(t, s.Pool, evSpec{typ: "mail.user.welcome", status: "pending", age: time.Minute})

	// Hold the row lock a dispatcher holds while it hands an event off.
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM outbox_event WHERE id = $1 FOR UPDATE`, locked); err != nil {
		t.Fatal(err)
	}

	args := []string{"cancel", "--type-prefix", "mail.", "--tenant", "t1"}
	want := f.idsOf("mail-a", "mail-old", "mail-pending")
	dry := ctlJSON[selectOut](t, s, append(args, "--dry-run")...)
	real := ctlJSON[selectOut](t, s, args...)
	if !slices.Equal(dry.IDs, want) || !slices.Equal(real.IDs, want) {
		t.Fatalf("dry run %v, real run %v, want %v", dry.IDs, real.IDs, want)
	}
	// mail-proc and mail-done match the filter but are never cancelled.
	if real.Skipped["processing"] != 1 || real.Skipped["done"] != 1 {
		t.Fatalf("skipped %v", real.Skipped)
	}
	after := snapshot(t, s.Pool)
	for _, id := range want {
		if after[id].Status != "cancelled" {
			t.Errorf("event %d is %s, want cancelled", id, after[id].Status)
		}
	}

	// The locked pending event (no tenant) is skipped, not waited for.
	res := ctlJSON[selectOut](t, s, "cancel", "--id", fmt.Sprint(locked))
	if res.Affected != 0 || res.Skipped["locked"] != 1 || res.Remaining != 1 {
		t.Fatalf("cancel of a locked event = %+v, want skipped as locked", res)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	res = ctlJSON[selectOut](t, s, "cancel", "--id", fmt.Sprint(locked))
	if res.Affected != 1 {
		t.Fatalf("cancel after the lock was released = %+v", res)
	}
}

// TestRequeueAndCancelTakeStuckProcessing: a processing row whose
// locked_until is NULL is never claimed again, and one past its lease waits
// for a claim; requeue and cancel take both (item 6), while a row with a
// live lease (a dispatcher owns it) is reported as skipped.
func TestRequeueAndCancelTakeStuckProcessing(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	add := func(lease string) int64 {
		var id int64
		if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, status, locked_until)
			VALUES ('mail.user.welcome', '{}', 'processing', now() + $1::interval) RETURNING id`, lease).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	var nullLease int64
	if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, status) VALUES ('mail.user.welcome', '{}', 'processing') RETURNING id`).Scan(&nullLease); err != nil {
		t.Fatal(err)
	}
	past, live := add("-1 minute"), add("10 minutes")

	dry := ctlJSON[selectOut](t, s, "requeue", "--status", "processing", "--all", "--dry-run")
	real := ctlJSON[selectOut](t, s, "requeue", "--status", "processing", "--all")
	want := []int64{nullLease, past}
	if !slices.Equal(dry.IDs, want) || !slices.Equal(real.IDs, want) || real.Skipped["processing"] != 1 {
		t.Fatalf("requeue of stuck processing: dry %+v, real %+v, want ids %v and the live one skipped", dry, real, want)
	}
	rows := snapshot(t, s.Pool)
	for _, id := range want {
		if r := rows[id]; r.Status != "pending" || r.LockedUntil != "" {
			t.Errorf("requeued stuck event %d = %+v", id, r)
		}
	}
	if r := rows[live]; r.Status != "processing" {
		t.Errorf("the live processing event changed: %+v", r)
	}

	// Cancel by id: the default statuses with --id include processing.
	var stuck int64
	if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, status) VALUES ('mail.user.welcome', '{}', 'processing') RETURNING id`).Scan(&stuck); err != nil {
		t.Fatal(err)
	}
	res := ctlJSON[selectOut](t, s, "cancel", "--id", fmt.Sprint(stuck), "--id", fmt.Sprint(live))
	if !slices.Equal(res.IDs, []int64{stuck}) || res.Skipped["processing"] != 1 {
		t.Fatalf("cancel by id = %+v, want only the stuck event, the live one skipped", res)
	}
	if r := snapshot(t, s.Pool)[stuck]; r.Status != "cancelled" {
		t.Fatalf("cancelled stuck event = %+v", r)
	}
}

// TestDryRunsDrawNoAuditIDs: dry runs write nothing to outbox_audit and use
// up no ids, so the first real run is audit #1 (item 12).
func TestDryRunsDrawNoAuditIDs(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	seedFixture(t, s.Pool)
	for range 3 {
		ctlJSON[selectOut](t, s, "requeue", "--all", "--dry-run")
		ctlJSON[selectOut](t, s, "cancel", "--all", "--dry-run")
	}
	code, out, errOut := octl(t, s, "requeue", "--all", "--actor", "alice")
	if code != 0 || !strings.Contains(out, "recorded as audit #1 by alice") {
		t.Fatalf("real requeue after dry runs (exit %d): %q %q", code, out, errOut)
	}
	if n := auditCount(t, s.Pool); n != 1 {
		t.Fatalf("%d audit rows, want 1", n)
	}
}

// TestRequeuedFailedEventIsDispatchedAgain fails an event for real (the
// receiver side rejects its River insert), fixes the cause, requeues it and
// waits for the running dispatcher to hand it off.
func TestRequeuedFailedEventIsDispatchedAgain(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)
	_, err := s.Pool.Exec(ctx, `
		CREATE FUNCTION reject_mail() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'receiver down for %', NEW.args->>'event_type'; END $$;
		CREATE TRIGGER reject_mail BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION reject_mail();`)
	if err != nil {
		t.Fatal(err)
	}
	routes, err := route.New([]route.Rule{{Prefix: "mail.", Queues: []string{"outbox_mail"}}})
	if err != nil {
		t.Fatal(err)
	}
	d, err := dispatcher.New(s.Pool, dispatcher.Config{Routes: routes, MaxRetries: -1, PollInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Stop(context.Background()) })

	code, out, errOut := octl(t, s, "publish", "--type", "mail.user.welcome", "--json")
	if code != 0 {
		t.Fatalf("publish: %s %s", out, errOut)
	}
	var pub struct{ ID int64 }
	if err := json.Unmarshal([]byte(out), &pub); err != nil {
		t.Fatal(err)
	}
	statusOf := func() (string, *string) {
		var st string
		var le *string
		if err := s.Pool.QueryRow(ctx, `SELECT status::text, last_error FROM outbox_event WHERE id = $1`, pub.ID).Scan(&st, &le); err != nil {
			t.Fatal(err)
		}
		return st, le
	}
	waitUntil(t, ctx, "the event to fail", func() bool { st, _ := statusOf(); return st == "failed" })

	stats := ctlJSON[struct {
		Events map[string]int `json:"events"`
	}](t, s, "stats")
	if stats.Events["failed"] != 1 {
		t.Fatalf("stats shows %v, want 1 failed", stats.Events)
	}

	// Fix the receiver, preview, requeue.
	if _, err := s.Pool.Exec(ctx, `DROP TRIGGER reject_mail ON river_job`); err != nil {
		t.Fatal(err)
	}
	dry := ctlJSON[selectOut](t, s, "requeue", "--status", "failed", "--type-prefix", "mail.", "--dry-run")
	if st, _ := statusOf(); dry.Affected != 1 || st != "failed" {
		t.Fatalf("dry run = %+v, status %s", dry, st)
	}
	real := ctlJSON[selectOut](t, s, "requeue", "--status", "failed", "--type-prefix", "mail.", "--actor", "oncall")
	if real.Affected != 1 {
		t.Fatalf("requeue = %+v", real)
	}
	waitUntil(t, ctx, "the requeued event to be handed off", func() bool { st, _ := statusOf(); return st == "done" })
	if _, le := statusOf(); le == nil || !strings.Contains(*le, "receiver down") {
		t.Fatalf("last_error after re-dispatch = %v, want the previous error kept", le)
	}
	var jobs int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE (args->>'event_id')::bigint = $1 AND queue = 'outbox_mail'`, pub.ID).Scan(&jobs); err != nil || jobs != 1 {
		t.Fatalf("%d River jobs for the event, %v; want 1", jobs, err)
	}

	audit := ctlJSON[[]struct {
		Action   string `json:"action"`
		Actor    string `json:"actor"`
		Affected int    `json:"affected"`
	}](t, s, "audit")
	if len(audit) != 1 || audit[0].Action != "requeue" || audit[0].Actor != "oncall" || audit[0].Affected != 1 {
		t.Fatalf("audit = %+v", audit)
	}
}

func waitUntil(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

type statsOut struct {
	Events               map[string]int64      `json:"events"`
	OldestDuePendingAgeS float64               `json:"oldest_due_pending_age_seconds"`
	PendingDueOver60s    int64                 `json:"pending_due_over_60s"`
	Queues               []admin.QueueStats    `json:"queues"`
	WorkedQueuesKnown    bool                  `json:"worked_queues_known"`
	UnworkedRoutes       []admin.UnworkedRoute `json:"unworked_routes"`
	Alerts               []admin.Alert         `json:"alerts"`
}

func TestStats(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	for range 3 {
		insert(t, s.Pool, evSpec{typ: "mail.user.welcome", status: "failed", lastError: "x", age: time.Hour})
	}
	// Due for 2 minutes (behind), due for 10 s, and not yet due.
	for _, due := range []string{"2 minutes", "2 minutes", "10 seconds", "-1 hour"} {
		if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, scheduled_at) VALUES ('mail.user.welcome', '{}', now() - $1::interval)`, due); err != nil {
			t.Fatal(err)
		}
	}
	rc, err := outboxriver.NewInsertClient(s.Pool, outboxriver.InsertClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var jobIDs []int64
	for _, q := range []string{"outbox_mail", "outbox_mail", "outbox_mail", "outbox_webhook"} {
		r, err := rc.Insert(ctx, outboxriver.EventArgs{EventID: 1, EventType: "mail.user.welcome"}, &river.InsertOpts{Queue: q})
		if err != nil {
			t.Fatal(err)
		}
		jobIDs = append(jobIDs, r.Job.ID)
	}
	// One mail job stalled (running for an hour), one discarded.
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() - interval '1 hour' WHERE id = $1`, jobIDs[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', attempt = 1, attempted_at = now(), finalized_at = now() WHERE id = $1`, jobIDs[1]); err != nil {
		t.Fatal(err)
	}
	routesFile := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(routesFile, []byte("routes:\n  - prefix: \"mail.\"\n    queue: outbox_mail\n  - prefix: \"webhook.\"\n    queue: outbox_webhook\n  - prefix: \"audit.\"\n    queue: outbox_audit\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	st := ctlJSON[statsOut](t, s, "stats", "--routes", routesFile, "--worked-queues", "outbox_mail,outbox_webhook")
	if st.Events["failed"] != 3 || st.Events["pending"] != 4 || st.Events["done"] != 0 {
		t.Fatalf("events %v", st.Events)
	}
	if st.PendingDueOver60s != 2 || st.OldestDuePendingAgeS < 110 || st.OldestDuePendingAgeS > 3600 {
		t.Fatalf("pending lag: %d behind, oldest %.0fs; want 2 behind, oldest ~120s", st.PendingDueOver60s, st.OldestDuePendingAgeS)
	}
	got := map[string]admin.QueueStats{}
	for _, q := range st.Queues {
		got[q.Queue] = q
	}
	mail := got["outbox_mail"]
	if mail.Available != 1 || mail.Running != 1 || mail.Stalled != 1 || mail.Discarded != 1 || got["outbox_webhook"].Available != 1 {
		t.Fatalf("queues %+v", st.Queues)
	}
	if a, ok := got["outbox_audit"]; !ok || a.Worked == nil || *a.Worked {
		t.Fatalf("route queue outbox_audit missing or marked worked: %+v", st.Queues)
	}
	if len(st.UnworkedRoutes) != 1 || st.UnworkedRoutes[0].Queue != "outbox_audit" {
		t.Fatalf("unworked routes %+v", st.UnworkedRoutes)
	}
	names := func(as []admin.Alert) []string {
		var out []string
		for _, a := range as {
			out = append(out, a.Name)
		}
		return out
	}
	if fmt.Sprint(names(st.Alerts)) != "[river_jobs_stalled events_failed routes_unworked]" {
		t.Fatalf("alerts %v", names(st.Alerts))
	}

	// Without --check alerts do not change the exit status; with it they do.
	code, _, _ := octl(t, s, "stats", "--routes", routesFile, "--worked-queues", "outbox_mail")
	if code != 0 {
		t.Fatalf("stats without --check: exit %d", code)
	}
	code, out, errOut := octl(t, s, "stats", "--check", "--json", "--max-behind", "1", "--stalled-after", "2h")
	if code != 1 || !strings.Contains(errOut, "dispatcher_behind") {
		t.Fatalf("stats --check with 2 behind > 1: exit %d, stderr %q", code, errOut)
	}
	var checked statsOut
	if err := json.Unmarshal([]byte(out), &checked); err != nil {
		t.Fatalf("--check --json must print exactly one JSON document: %v\n%s", err, out)
	}
	if fmt.Sprint(names(checked.Alerts)) != "[dispatcher_behind events_failed]" {
		t.Fatalf("alerts %v", names(checked.Alerts))
	}
	code, _, errOut = octl(t, s, "stats", "--check", "--stalled-after", "2h", "--max-failed", "3")
	if code != 0 {
		t.Fatalf("stats --check under every threshold: exit %d: %s", code, errOut)
	}
	code, _, errOut = octl(t, s, "stats", "--check", "--stalled-after", "2h", "--max-failed", "2")
	if code != 1 || !strings.Contains(errOut, "events_failed") {
		t.Fatalf("stats --check with 3 failed > 2: exit %d, %q", code, errOut)
	}
	code, _, errOut = octl(t, s, "stats", "--stalled-after", "0s")
	if code != 2 || !strings.Contains(errOut, "--stalled-after") {
		t.Fatalf("bad --stalled-after: exit %d %q", code, errOut)
	}
	code, _, errOut = octl(t, s, "stats", "--worked-queues", "outbox.mail")
	if code != 2 || !strings.Contains(errOut, "--worked-queues") {
		t.Fatalf("bad --worked-queues: exit %d %q", code, errOut)
	}
	code, out, _ = octl(t, s, "stats")
	if code != 0 || !strings.Contains(out, "failed 3") || !strings.Contains(out, "worked queues unknown") {
		t.Fatalf("text stats (exit %d):\n%s", code, out)
	}
}

func TestRetentionRunCommand(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	_, err := s.Pool.Exec(ctx, `
		INSERT INTO outbox_event (event_type, payload, status, processed_at)
		SELECT 'mail.user.welcome', '{}', 'done', now() - interval '40 days' FROM generate_series(1, 15);
		INSERT INTO outbox_event (event_type, payload, status, processed_at)
		SELECT 'mail.user.welcome', '{}', 'done', now() - interval '1 day' FROM generate_series(1, 4);
		INSERT INTO outbox_event (event_type, payload, status, created_at, last_error)
		SELECT 'mail.user.welcome', '{}', 'failed', now() - interval '90 days', 'x' FROM generate_series(1, 2);`)
	if err != nil {
		t.Fatal(err)
	}
	type out struct {
		Deleted int64 `json:"deleted"`
		Batches int   `json:"batches"`
		DryRun  bool  `json:"dry_run"`
		AuditID int64 `json:"audit_id"`
	}
	dry := ctlJSON[out](t, s, "retention", "run", "--dry-run", "--hours", "720")
	if dry.Deleted != 15 || !dry.DryRun {
		t.Fatalf("dry run %+v", dry)
	}
	real := ctlJSON[out](t, s, "retention", "run", "--hours", "720", "--batch-size", "4", "--actor", "bob")
	if real.Deleted != dry.Deleted || real.Batches != 4 || real.AuditID == 0 {
		t.Fatalf("run %+v, dry run said %d", real, dry.Deleted)
	}
	var left int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event`).Scan(&left); err != nil || left != 6 {
		t.Fatalf("%d rows left, want 6 (4 recent done, 2 failed): %v", left, err)
	}
	audit := ctlJSON[[]admin.AuditEntry](t, s, "audit", "--action", "retention")
	if len(audit) != 1 || audit[0].Actor != "bob" || audit[0].Affected != 15 {
		t.Fatalf("audit %+v", audit)
	}
	for _, bad := range [][]string{{"retention"}, {"retention", "purge"}, {"retention", "run", "--hours", "0"}} {
		if code, _, _ := octl(t, s, bad...); code != 2 {
			t.Errorf("%v: exit %d, want 2", bad, code)
		}
	}
	if code, _, errOut := octl(t, s, "audit", "--limit", "0"); code != 2 || !strings.Contains(errOut, "--limit") {
		t.Errorf("audit --limit 0: exit %d %q", code, errOut)
	}
}

// TestOpsJSONEverywhere checks every operator command prints valid JSON.
func TestOpsJSONEverywhere(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	for _, args := range [][]string{
		{"requeue", "--all", "--dry-run"}, {"cancel", "--all", "--dry-run"}, {"stats"},
		{"retention", "run", "--dry-run"}, {"audit"}, {"keys"},
	} {
		_ = ctlJSON[any](t, s, args...)
	}
}

// TestDatabaseURLFlag checks --database-url overrides DATABASE_URL.
func TestDatabaseURLFlag(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	var stdout, stderr bytes.Buffer
	code := run([]string{"stats", "--json", "--database-url", s.URL}, "postgres://nobody@127.0.0.1:1/none", &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
}

// TestOutputCountsAreSingularForOne: "1 event", never "1 events" (item 12),
// in requeue, cancel and retention output.
func TestOutputCountsAreSingularForOne(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	failed := insert(t, s.Pool, evSpec{typ: "mail.user.welcome", status: "failed", lastError: "x", age: time.Hour})
	done := insert(t, s.Pool, evSpec{typ: "mail.user.welcome", status: "done", age: time.Hour})
	if _, err := s.Pool.Exec(context.Background(), `UPDATE outbox_event SET processed_at = now() - interval '40 days' WHERE id = $1`, done); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"cancel", "--id", fmt.Sprint(failed), "--dry-run"}, "1 event would be cancelled (from 1 failed)\n"},
		{[]string{"requeue", "--id", fmt.Sprint(failed)}, "1 event requeued (from 1 failed)\n"},
		{[]string{"requeue", "--id", fmt.Sprint(done), "--allow-replay", "--dry-run"}, "1 event would be requeued (from 1 done)\n"},
		{[]string{"retention", "run", "--dry-run"}, "dry run: 1 done event processed before"},
		{[]string{"retention", "run"}, " in 1 batch; recorded as audit #"},
	} {
		code, out, errOut := octl(t, s, tc.args...)
		if code != 0 || !strings.Contains(out, tc.want) || strings.Contains(out+errOut, "1 events") || strings.Contains(out, "1 batches") {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want %q and no \"1 events\"", tc.args, code, out, errOut, tc.want)
		}
	}
}
