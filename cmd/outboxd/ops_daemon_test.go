package main_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestDaemonServesMetricsAndRunsRetention starts outboxd with
// OUTBOX_HTTP_ADDR: /metrics shows the dispatch, /readyz is ready, the
// retention job purged the old done rows at start-up, and the GIN cleaner
// merged the pending lists that 2,000 River jobs filled.
func TestDaemonServesMetricsAndRunsRetention(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, status, processed_at)
		SELECT 'mail.user.welcome', '{}', 'done', now() - interval '60 days' FROM generate_series(1, 30)`); err != nil {
		t.Fatal(err)
	}
	// River jobs whose GIN entries wait in the pending lists (autovacuum,
	// which would merge them too, is off for the table).
	if _, err := s.Pool.Exec(ctx, `ALTER TABLE river_job SET (autovacuum_enabled = false);
		INSERT INTO river_job (args, kind, max_attempts, queue, state, finalized_at)
		SELECT jsonb_object_agg('k' || k, 'v' || g || '-' || k), 'gin_test', 1, 'gin_test', 'completed', now()
		FROM generate_series(1, 2000) g, generate_series(1, 20) k GROUP BY g`); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	routes, _ := filepath.Abs("../../docs/examples/routes.yaml")
	cmd, out := daemon(t, "OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_ROUTES_FILE="+routes, "DATABASE_URL="+s.URL,
		"OUTBOX_HTTP_ADDR="+addr, "OUTBOX_DONE_RETENTION_BATCH_SIZE=7", "OUTBOX_DISPATCH_INTERVAL_MS=200",
		"OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS=50")
	waitLog(t, out, "serving /metrics")
	if _, err := s.Pool.Exec(ctx, `SELECT outbox_publish('billing.invoice.paid', '{}') FROM generate_series(1, 3)`); err != nil {
		t.Fatal(err)
	}
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	var body string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last /metrics:\n%s", body)
		}
	})
	pgtest.WaitFor(t, 30*time.Second, "/metrics to show 3 dispatched, 30 purged and GIN pages merged", func() bool {
		_, body = get("/metrics")
		return strings.Contains(body, `outbox_events_dispatched_total{route="billing."} 3`) &&
			strings.Contains(body, "outbox_retention_deleted_total 30") &&
			strings.Contains(body, "\noutbox_river_gin_clean_pages_total ") &&
			!strings.Contains(body, "\noutbox_river_gin_clean_pages_total 0\n")
	})
	if code, body := get("/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz = %d %q", code, body)
	}
	var left int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE processed_at < now() - interval '1 day'`).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d old done rows left: %v", left, err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 30*time.Second); code != 0 {
		t.Fatalf("exit %d:\n%s", code, out.String())
	}
}

// TestWorkerOnlyDaemonRunsRetention: an outboxd that only works queues
// (OUTBOX_DISPATCHER_ENABLED=false) runs the retention job as well, as the
// docs say of OUTBOX_RETENTION_ENABLED (it used to run only where the
// dispatcher did, so a worker-only deployment never purged).
func TestWorkerOnlyDaemonRunsRetention(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, status, processed_at)
		SELECT 'mail.user.welcome', '{}', 'done', now() - interval '60 days' FROM generate_series(1, 12)`); err != nil {
		t.Fatal(err)
	}
	cmd, out := daemon(t, "DATABASE_URL="+s.URL, "OUTBOX_WORKER_QUEUES=outbox_mail", "OUTBOX_WORKER_HANDLER=log", "OUTBOX_DONE_RETENTION_BATCH_SIZE=5", "OUTBOX_LOG_FORMAT=json")
	waitLog(t, out, `"msg":"River workers started"`)
	pgtest.WaitFor(t, 30*time.Second, "the worker-only outboxd's retention run recorded in outbox_job_run", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_job_run WHERE name = 'outbox-done-retention'
			AND last_finished_at IS NOT NULL AND last_affected = 12 AND last_run_by LIKE 'outboxd %'`) == 1
	})
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event`); n != 0 {
		t.Fatalf("%d old done rows left after the run", n)
	}
	if strings.Contains(out.String(), `"msg":"outbox dispatcher started"`) {
		t.Fatal("the dispatcher ran: the test must show a worker-only process")
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 30*time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
}
