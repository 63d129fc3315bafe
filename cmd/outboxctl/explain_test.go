package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

type retrySoon struct{}

func (retrySoon) NextRetry(*rivertype.JobRow) time.Time { return time.Now().Add(50 * time.Millisecond) }

// TestExplainShowsJobsReceiptsAndRoutes hands one fan-out event to River,
// works it with real River workers (one receiver fails once, then records a
// receipt), and checks that explain shows all of it.
func TestExplainShowsJobsReceiptsAndRoutes(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 120*time.Second)
	routesFile := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(routesFile, []byte("routes:\n  - prefix: \"plugin.hook.\"\n    queues: [outbox_plugin-hook, outbox_audit]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	routes, err := route.Load(routesFile)
	if err != nil {
		t.Fatal(err)
	}

	var id int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('plugin.hook.workflow.executed', '{"run": 7}', 'acme', 'run:7')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if res := ordertest.HandOff(t, s.Pool, routes); res.Jobs != 2 {
		t.Fatalf("handoff: %+v, want 2 jobs", res)
	}

	var failed atomic.Bool
	hs := outboxriver.NewHandlers()
	hs.HandleFunc("plugin.hook.", func(ctx context.Context, ev outboxriver.Event) error {
		if ev.Queue == "outbox_audit" && failed.CompareAndSwap(false, true) {
			return errors.New("audit store unavailable")
		}
		return pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			_, err := outboxriver.WithIdempotency(ctx, tx, outboxriver.Receiver{Name: "hook-" + ev.Queue}, ev, func(context.Context, pgx.Tx) error { return nil })
			return err
		})
	})
	workers := river.NewWorkers()
	river.AddWorker(workers, outboxriver.NewWorker(hs, outboxriver.WorkerOptions{}))
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg := outboxriver.QueuesConfig(workers, []outboxriver.Queue{{Name: "outbox_plugin-hook"}, {Name: "outbox_audit"}}, outboxriver.WorkerLatency{})
	cfg.Logger, cfg.RetryPolicy = quiet, retrySoon{}
	client, err := river.NewClient(riverpgxv5.New(s.Pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = client.Stop(sctx)
	})
	pgtest.WaitFor(t, 60*time.Second, "both receipts of the event", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_receipt WHERE event_id = $1`, id) == 2
	})

	code, stdout, stderr := ctl(t, s.URL, "explain", fmt.Sprint(id), "--routes", routesFile)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var jobIDs []int64
	if err := s.Pool.QueryRow(ctx, `SELECT river_job_ids FROM outbox_event WHERE id = $1`, id).Scan(&jobIDs); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		fmt.Sprintf("event %d  plugin.hook.workflow.executed  status done", id),
		"tenant        acme", "dispatch key  run:7", `{"run": 7}`,
		`prefix "plugin.hook." → outbox_plugin-hook, outbox_audit`,
		"River jobs (2):",
		fmt.Sprintf("job %d  queue outbox_plugin-hook  state completed  attempt 1/", jobIDs[0]),
		fmt.Sprintf("job %d  queue outbox_audit  state completed  attempt 2/", jobIDs[1]),
		"error, attempt 1 at", "audit store unavailable",
		"receipts (2):",
		fmt.Sprintf("hook-outbox_audit  done by job %d (attempt 2)", jobIDs[1]),
		fmt.Sprintf("hook-outbox_plugin-hook  done by job %d (attempt 1)", jobIDs[0]),
	} {
		if !strings.Contains(stdout, want) {
			t.Errorf("explain output lacks %q:\n%s", want, stdout)
		}
	}

	// --json, with the id after the flag.
	code, stdout, stderr = ctl(t, s.URL, "explain", "--json", fmt.Sprint(id))
	if code != 0 {
		t.Fatalf("--json: exit %d: %s", code, stderr)
	}
	var res admin.Explanation
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatalf("--json output is not JSON: %v\n%s", err, stdout)
	}
	if res.Event.ID != id || res.Event.Status != "done" || len(res.Jobs) != 2 || len(res.Receipts) != 2 {
		t.Fatalf("--json: %+v", res)
	}
	if res.Routes != nil {
		t.Errorf("routes without --routes or OUTBOX_ROUTES_FILE: %+v", res.Routes)
	}
	for i, j := range res.Jobs {
		if j.ID != jobIDs[i] || !j.Found || j.State != "completed" || j.FinalizedAt == nil {
			t.Errorf("job %d: %+v", i, j)
		}
	}
	if len(res.Jobs[1].Errors) != 1 || res.Jobs[1].Errors[0].Attempt != 1 || !strings.Contains(res.Jobs[1].Errors[0].Error, "audit store unavailable") {
		t.Errorf("audit job errors: %+v", res.Jobs[1].Errors)
	}

	// A job River has deleted is reported as gone, not as an error.
	if _, err := s.Pool.Exec(ctx, `DELETE FROM river_job WHERE id = $1`, jobIDs[0]); err != nil {
		t.Fatal(err)
	}
	code, stdout, _ = ctl(t, s.URL, "explain", fmt.Sprint(id))
	if code != 0 || !strings.Contains(stdout, fmt.Sprintf("job %d  not in river_job", jobIDs[0])) {
		t.Errorf("deleted job: exit %d\n%s", code, stdout)
	}
}

func TestExplainUnknownAndBadIDs(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	code, _, stderr := ctl(t, s.URL, "explain", "424242")
	if code != 1 || !strings.Contains(stderr, "event 424242 not found") {
		t.Errorf("unknown id: exit %d, stderr %q", code, stderr)
	}
	code, stdout, _ := ctl(t, s.URL, "explain", "424242", "--json")
	if code != 1 || !strings.Contains(stdout, `"error": "event 424242 not found`) {
		t.Errorf("unknown id --json: exit %d, stdout %q", code, stdout)
	}
	// A pending event: no jobs yet, and it says why.
	var id int64
	if err := s.Pool.QueryRow(context.Background(), `SELECT outbox_publish('mail.receipt.requested', '{}')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	code, stdout, _ = ctl(t, s.URL, "explain", fmt.Sprint(id))
	if code != 0 || !strings.Contains(stdout, "River jobs: none (the event is pending, not handed off)") || !strings.Contains(stdout, "receipts: none") {
		t.Errorf("pending event: exit %d\n%s", code, stdout)
	}
	for _, args := range [][]string{{"explain"}, {"explain", "abc"}, {"explain", "0"}, {"explain", "1", "2"}, {"explain", "1", "--routes", "/no/such/file"}} {
		if code, _, stderr := ctl(t, s.URL, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2 (stderr %q)", args, code, stderr)
		}
	}
}
