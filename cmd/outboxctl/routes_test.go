package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// routesCtl runs outboxctl routes ... in-process.
func routesCtl(t *testing.T, s *pgtest.Schema, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(append([]string{"routes"}, args...), s.URL, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func writeRoutes(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestRoutesSyncCommand: `outboxctl routes sync` with --dry-run reports
// the change and writes nothing; without, it replaces the synced routes,
// turns strict routing on, and records an audit row with the actor; a
// second file reports added, removed and changed prefixes. With strict on,
// Publish refuses a type the file does not route. Bad usage and a bad
// routes file exit 2.
func TestRoutesSyncCommand(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, 60*time.Second)
	first := writeRoutes(t, "routes:\n  - prefix: \"mail.\"\n    queue: outbox_mail\n  - prefix: \"audit.\"\n    queue: outbox_audit\n")

	code, out, errOut := routesCtl(t, s, "sync", "--routes", first, "--strict", "on", "--dry-run", "--json", "--actor", "alice")
	var res admin.RoutesSyncResult
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil || !res.DryRun || len(res.Added) != 2 || !res.StrictAfter || res.AuditID != nil {
		t.Fatalf("dry run: exit %d %s %s", code, out, errOut)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT (SELECT count(*) FROM outbox_route) + (SELECT count(*) FROM outbox_audit)`); n != 0 {
		t.Fatalf("dry run wrote %d rows", n)
	}

	code, out, errOut = routesCtl(t, s, "sync", "--routes", first, "--strict", "on", "--actor", "alice")
	if code != 0 || !strings.Contains(out, "synced 2 routes") || !strings.Contains(out, "strict routing: off -> on") || !strings.Contains(out, "audit id") {
		t.Fatalf("sync: exit %d\n%s\n%s", code, out, errOut)
	}
	var actor, action string
	if err := s.Pool.QueryRow(ctx, `SELECT actor, action FROM outbox_audit`).Scan(&actor, &action); err != nil || actor != "alice" || action != "routes-sync" {
		t.Fatalf("audit: %q %q %v", actor, action, err)
	}
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := outbox.Publish(ctx, tx, outbox.Event{Type: "billing.invoice.paid"})
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "matches no synced route") {
		t.Fatalf("Publish of an unrouted type with strict on: %v", err)
	}

	second := writeRoutes(t, "routes:\n  - prefix: \"mail.\"\n    queues: [outbox_mail, outbox_audit]\n  - prefix: \"billing.\"\n    queue: outbox_billing\n")
	code, out, errOut = routesCtl(t, s, "sync", "--routes", second, "--json")
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil ||
		strings.Join(res.Added, ",") != "billing." || strings.Join(res.Removed, ",") != "audit." || strings.Join(res.Changed, ",") != "mail." || !res.StrictBefore || !res.StrictAfter {
		t.Fatalf("second sync: exit %d %s %s", code, out, errOut)
	}
	pgtest.Publish(t, s.Pool, outbox.Event{Type: "billing.invoice.paid"})

	for _, args := range [][]string{
		{},
		{"show"},
		{"sync"},
		{"sync", "--routes", second, "--strict", "maybe"},
		{"sync", "--routes", writeRoutes(t, "routes:\n  - prefix: \"mail.\"\n    queue: outbox.mail\n")},
		{"sync", "--routes", second, "extra"},
	} {
		if code, _, errOut := routesCtl(t, s, args...); code != 2 {
			t.Errorf("routes %v: exit %d (%s), want 2", args, code, errOut)
		}
	}
}
