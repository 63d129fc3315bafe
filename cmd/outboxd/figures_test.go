package main_test

import (
	"encoding/json"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

// TestWorkerOnlyShutdownReportsJobsWorked: a worker-only outboxd reports
// at shutdown the jobs it worked, by outcome, and no dispatcher figures.
func TestWorkerOnlyShutdownReportsJobsWorked(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)
	cmd, out := daemon(t, "DATABASE_URL="+s.URL, "OUTBOX_WORKER_QUEUES=outbox_mail", "OUTBOX_WORKER_HANDLER=log")
	ins, err := outboxriver.NewInsertClient(s.Pool, outboxriver.InsertClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	const n = 25
	params := make([]river.InsertManyParams, n)
	for i := range params {
		params[i] = river.InsertManyParams{
			Args:       outboxriver.EventArgs{EventID: int64(i + 1), EventType: "mail.user.welcome", Payload: json.RawMessage(`{}`), CreatedAt: time.Now()},
			InsertOpts: &river.InsertOpts{Queue: "outbox_mail"},
		}
	}
	if _, err := ins.InsertMany(ctx, params); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, 60*time.Second, "the worker to complete every job", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == n
	})
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 30*time.Second); code != 0 {
		t.Fatalf("exit %d:\n%s", code, out.String())
	}
	log := out.String()
	var stopped string
	for line := range strings.SplitSeq(log, "\n") {
		if strings.Contains(line, `msg="outboxd stopped"`) {
			stopped = line
		}
	}
	for _, want := range []string{"jobs_worked=25", "jobs_completed=25", "jobs_failed=0"} {
		if !strings.Contains(stopped, want) {
			t.Errorf("shutdown line lacks %q: %q\n%s", want, stopped, log)
		}
	}
	for _, bad := range []string{"events=", "batches=", " jobs="} {
		if strings.Contains(stopped, bad) {
			t.Errorf("a worker-only process reports dispatcher figure %q: %q", bad, stopped)
		}
	}
}
