package main_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/internal/proctest"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "outboxd-test")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "outboxd")
	if out, err := exec.Command("go", "build", "-race", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build outboxd: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func daemon(t *testing.T, env ...string) (*exec.Cmd, *proctest.SyncBuffer) {
	t.Helper()
	cmd := exec.Command(binary)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	out := &proctest.SyncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	// Registered last, so it runs first: the log of a failed test, as far
	// as the daemon got.
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("outboxd (pid %d) output:\n%s", cmd.Process.Pid, out.String())
		}
	})
	return cmd, out
}

func waitExit(t *testing.T, cmd *exec.Cmd, d time.Duration) int {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err == nil {
			return 0
		}
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		t.Fatal(err)
	case <-time.After(d):
		t.Fatalf("outboxd did not exit within %s", d)
	}
	return -1
}

// waitLog waits for want in the daemon's output (daemon logs the output
// of a failed test).
func waitLog(t *testing.T, out *proctest.SyncBuffer, want string) {
	t.Helper()
	pgtest.WaitFor(t, 30*time.Second, fmt.Sprintf("outboxd to log %q", want), func() bool {
		return strings.Contains(out.String(), want)
	})
}

func TestBadConfigStopsAtStartup(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"OUTBOX_DISPATCH_BATCH_SIZE=0":     "OUTBOX_DISPATCH_BATCH_SIZE=0 is out of range",
		"OUTBOX_DISPATCH_INTERVAL_MS=soon": `OUTBOX_DISPATCH_INTERVAL_MS="soon" is not a valid int`,
		"OUTBOX_DISPATCHER_ENABLED=true":   "OUTBOX_ROUTES_FILE is required",
		"OUTBOX_DISPATCH_CONCURRENCY=-3":   "OUTBOX_DISPATCH_CONCURRENCY=-3",
	}
	for env, want := range cases {
		cmd, out := daemon(t, env, "DATABASE_URL=postgres://postgres:hunter2@127.0.0.1:1/x")
		if code := waitExit(t, cmd, 30*time.Second); code != 2 {
			t.Errorf("%s: exit %d, want 2", env, code)
		}
		if !strings.Contains(out.String(), want) {
			t.Errorf("%s: output %q lacks %q", env, out.String(), want)
		}
		if strings.Contains(out.String(), "hunter2") {
			t.Errorf("%s: password in output", env)
		}
	}
}

func TestBadRoutesFileStopsAtStartup(t *testing.T) {
	t.Parallel()
	routes := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(routes, []byte("routes:\n  - prefix: \"mail.\"\n    queue: outbox.mail\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd, out := daemon(t, "OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_ROUTES_FILE="+routes, "DATABASE_URL="+pgtest.URL())
	if code := waitExit(t, cmd, 30*time.Second); code != 2 {
		t.Fatalf("exit %d, want 2 (bad configuration, as for a bad environment variable)", code)
	}
	for _, want := range []string{"line 2", `try \"outbox_mail\"`} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}

// TestUnparsableDatabaseURLExits2: a connection string that does not parse
// is bad configuration (exit 2, at once), not a database to wait for.
func TestUnparsableDatabaseURLExits2(t *testing.T) {
	t.Parallel()
	routes, _ := filepath.Abs("../../docs/examples/routes.yaml")
	cmd, out := daemon(t, "OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_ROUTES_FILE="+routes,
		"DATABASE_URL=postgres://postgres:s3cret@127.0.0.1:notaport/x")
	if code := waitExit(t, cmd, 30*time.Second); code != 2 {
		t.Fatalf("exit %d, want 2:\n%s", code, out.String())
	}
	if !strings.Contains(out.String(), "DATABASE_URL is not a valid connection string") || strings.Contains(out.String(), "s3cret") {
		t.Fatalf("output:\n%s", out.String())
	}
}

// TestStartBeforeMigrateSaysSo: outboxd, worker-only or with the
// dispatcher, on a schema that `outboxctl migrate` has not prepared stops
// at once with exit 1 and says what to run.
func TestStartBeforeMigrateSaysSo(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true})
	routes, _ := filepath.Abs("../../docs/examples/routes.yaml")
	want := "the outbox schema is missing in " + s.Name + ": run `outboxctl migrate` first"
	for name, env := range map[string][]string{
		"worker-only": {"OUTBOX_WORKER_QUEUES=outbox_mail", "OUTBOX_WORKER_HANDLER=log"},
		"dispatcher":  {"OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_ROUTES_FILE=" + routes},
	} {
		cmd, out := daemon(t, append(env, "DATABASE_URL="+s.URL)...)
		if code := waitExit(t, cmd, 60*time.Second); code != 1 {
			t.Errorf("%s: exit %d, want 1:\n%s", name, code, out.String())
		}
		if !strings.Contains(out.String(), want) {
			t.Errorf("%s: output lacks %q:\n%s", name, want, out.String())
		}
	}
}

func TestDisabledDispatcherSaysSoAndExitsOnSIGTERM(t *testing.T) {
	t.Parallel()
	cmd, out := daemon(t, "DATABASE_URL="+pgtest.URL())
	waitLog(t, out, "dispatcher disabled")
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 30*time.Second); code != 0 {
		t.Fatalf("exit %d, want 0:\n%s", code, out.String())
	}
}

func TestDatabaseDownRetriesWithMessage(t *testing.T) {
	t.Parallel()
	routes, _ := filepath.Abs("../../docs/examples/routes.yaml")
	cmd, out := daemon(t, "OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_ROUTES_FILE="+routes,
		"DATABASE_URL=postgres://postgres:s3cret@127.0.0.1:1/postgres?connect_timeout=1")
	waitLog(t, out, "database unreachable; retrying")
	waitLog(t, out, "attempt=2")
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 30*time.Second); code != 0 {
		t.Fatalf("exit %d, want 0 on SIGTERM during retries", code)
	}
	if strings.Contains(out.String(), "s3cret") {
		t.Fatalf("password leaked:\n%s", out.String())
	}
}

func TestDispatchesAndStopsCleanly(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	routes, _ := filepath.Abs("../../docs/examples/routes.yaml")
	cmd, out := daemon(t, "OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_ROUTES_FILE="+routes, "DATABASE_URL="+s.URL,
		"OUTBOX_DISPATCH_INTERVAL_MS=60000", "OUTBOX_LOG_FORMAT=json")
	waitLog(t, out, "outbox listener connected")
	ctx := context.Background()
	var id int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('billing.invoice.paid', '{"invoice": 7}')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	var queue string
	// Half the poll interval: the wake, not the poll, hands it off.
	pgtest.WaitFor(t, 30*time.Second, "the event to be handed off on the wake (poll interval 60 s)", func() bool {
		var status string
		err := s.Pool.QueryRow(ctx, `SELECT e.status::text, coalesce(j.queue, '') FROM outbox_event e LEFT JOIN river_job j ON j.id = e.river_job_ids[1] WHERE e.id = $1`, id).Scan(&status, &queue)
		if err != nil {
			t.Fatal(err)
		}
		return status == "done"
	})
	if queue != "outbox_notification" {
		t.Fatalf("job in queue %q", queue)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 30*time.Second); code != 0 {
		t.Fatalf("exit %d:\n%s", code, out.String())
	}
	if !strings.Contains(out.String(), `"msg":"outboxd stopped"`) {
		t.Fatalf("no clean stop logged:\n%s", out.String())
	}
	// A dispatcher without workers reports dispatcher figures only.
	if !strings.Contains(out.String(), `"events":1,"jobs":1,"batches":`) || strings.Contains(out.String(), "jobs_worked") {
		t.Fatalf("shutdown figures:\n%s", out.String())
	}
}

// TestKill9DuringDrainLosesAndDuplicatesNothing drains 20,000 events with two
// dispatcher processes and SIGKILLs one of them mid-drain.
func TestKill9DuringDrainLosesAndDuplicatesNothing(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("slow")
	}
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	const n = 20000
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload) SELECT CASE WHEN g % 10 = 0 THEN 'audit.user.login' ELSE 'mail.user.welcome' END, jsonb_build_object('g', g) FROM generate_series(1, $1) g`, n); err != nil {
		t.Fatal(err)
	}
	routes, _ := filepath.Abs("../../docs/examples/routes.yaml")
	env := []string{"OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_ROUTES_FILE=" + routes, "DATABASE_URL=" + s.URL,
		"OUTBOX_DISPATCH_INTERVAL_MS=200", "OUTBOX_DISPATCH_CONCURRENCY=4"}
	victim, _ := daemon(t, env...)
	survivor, _ := daemon(t, env...)

	done := func() int {
		var d int
		if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE status = 'done'`).Scan(&d); err != nil {
			t.Fatal(err)
		}
		return d
	}
	pgtest.WaitFor(t, 60*time.Second, "the drain to start (a tenth of the events done)", func() bool { return done() >= n/10 })
	if err := victim.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, 120*time.Second, fmt.Sprintf("the survivor to finish the drain (%d events done)", n), func() bool { return done() >= n })
	var jobs, dups, orphans int
	if err := s.Pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM river_job),
		(SELECT count(*) FROM (SELECT 1 FROM river_job GROUP BY args->>'event_id', queue HAVING count(*) > 1) d),
		(SELECT count(*) FROM outbox_event e WHERE cardinality(e.river_job_ids) <> 1
		    OR NOT EXISTS (SELECT 1 FROM river_job j WHERE j.id = e.river_job_ids[1] AND (j.args->>'event_id')::bigint = e.id))`).Scan(&jobs, &dups, &orphans); err != nil {
		t.Fatal(err)
	}
	if jobs != n || dups != 0 || orphans != 0 {
		t.Fatalf("jobs=%d (want %d) duplicated pairs=%d events without their job=%d", jobs, n, dups, orphans)
	}
	_ = survivor.Process.Signal(syscall.SIGTERM)
	if code := waitExit(t, survivor, 30*time.Second); code != 0 {
		t.Fatalf("survivor exit %d", code)
	}
}
