package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/internal/pgtest"
)

var ctlBinary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "outboxctl-test")
	if err != nil {
		panic(err)
	}
	ctlBinary = filepath.Join(dir, "outboxctl")
	if out, err := exec.Command("go", "build", "-o", ctlBinary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build outboxctl: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// ctlProcess runs the outboxctl binary with env and returns its exit
// status and output.
func ctlProcess(t *testing.T, env []string, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(ctlBinary, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, out.String(), errb.String()
	case errors.As(err, &ee):
		return ee.ExitCode(), out.String(), errb.String()
	}
	t.Fatal(err)
	return -1, "", ""
}

// TestStatsCheckAlertsOnFailedEventsByDefault: one dead-lettered event fails
// `stats --check` without any flag; --max-failed -1 opts out.
func TestStatsCheckAlertsOnFailedEventsByDefault(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	var id int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('mail.user.welcome', '{}')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', last_error = 'gave up' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := ctl(t, s.URL, "stats", "--check")
	if code != 1 || !strings.Contains(stderr, "events_failed") || !strings.Contains(stdout, "ALERT events_failed:") {
		t.Fatalf("stats --check with one failed event: exit %d\nstdout:\n%s\nstderr: %s", code, stdout, stderr)
	}
	if code, _, stderr := ctl(t, s.URL, "stats", "--check", "--max-failed", "-1"); code != 0 {
		t.Fatalf("stats --check --max-failed -1: exit %d: %s", code, stderr)
	}
}

// TestCommandsBeforeMigrateSayRunMigrate: on a schema without the outbox's
// tables every command says to run migrate, with exit status 1.
func TestCommandsBeforeMigrateSayRunMigrate(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true})
	want := "the outbox schema is missing in " + s.Name + ": run `outboxctl migrate` first"
	for _, args := range [][]string{
		{"publish", "--type", "mail.user.welcome"},
		{"stats"},
		{"stats", "--check", "--json"},
		{"explain", "1"},
		{"audit"},
		{"retention", "run"},
		{"requeue", "--id", "1"},
		{"cancel", "--id", "1"},
	} {
		code, _, stderr := ctl(t, s.URL, args...)
		if code != 1 || !strings.Contains(stderr, want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 1 and %q", args, code, stderr, want)
		}
	}
	// migrate itself is what the message asks for: it works.
	if code, _, stderr := ctl(t, s.URL, "migrate"); code != 0 {
		t.Fatalf("migrate: exit %d: %s", code, stderr)
	}
	if code, _, stderr := ctl(t, s.URL, "publish", "--type", "mail.user.welcome"); code != 0 {
		t.Fatalf("publish after migrate: exit %d: %s", code, stderr)
	}
}

// TestExitStatusConvention runs the outboxctl binary: 0 success, 1 runtime
// failure, 2 bad usage or configuration (a routes file, an environment
// variable, a missing or unparsable DATABASE_URL), as outboxd does.
func TestExitStatusConvention(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	badRoutes := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(badRoutes, []byte("routes:\n  - prefix: \"mail.\"\n    queue: outbox.mail\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	db := "DATABASE_URL=" + s.URL
	cases := []struct {
		name string
		env  []string
		args []string
		want int
	}{
		{"success", []string{db}, []string{"stats"}, 0},
		{"unknown event", []string{db}, []string{"explain", "424242"}, 1},
		{"database unreachable", []string{"DATABASE_URL=postgres://postgres@127.0.0.1:1/x?connect_timeout=1"}, []string{"stats"}, 1},
		{"bad flag", []string{db}, []string{"stats", "--nope"}, 2},
		{"no DATABASE_URL", nil, []string{"stats"}, 2},
		{"unparsable DATABASE_URL", []string{"DATABASE_URL=postgres://u:secret@host:notaport/db"}, []string{"stats"}, 2},
		{"bad routes file", []string{db, "OUTBOX_ROUTES_FILE=" + badRoutes}, []string{"stats"}, 2},
		{"bad --routes", []string{db}, []string{"explain", "1", "--routes", badRoutes}, 2},
		{"bad environment variable", []string{db, "OUTBOX_DONE_RETENTION_HOURS=soon"}, []string{"retention", "run", "--dry-run"}, 2},
	}
	for _, c := range cases {
		code, _, stderr := ctlProcess(t, c.env, c.args...)
		if code != c.want {
			t.Errorf("%s: exit %d, want %d (stderr %q)", c.name, code, c.want, stderr)
		}
		if strings.Contains(stderr, "secret") {
			t.Errorf("%s: password in stderr %q", c.name, stderr)
		}
	}
}
