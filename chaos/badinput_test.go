package chaos

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// outboxctl runs the built CLI with DATABASE_URL=url.
func outboxctl(t *testing.T, url string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	cmd := exec.Command(outboxctlBin, args...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "DATABASE_URL=" + url, "USER=chaos"}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		code = ee.ExitCode()
	default:
		t.Fatal(err)
	}
	return code, out.String(), errb.String()
}

// injections are SQL-injection-shaped values: each must be stored or
// matched literally, never interpreted.
var injections = []string{
	`acme' OR '1'='1`,
	`'; DROP TABLE outbox_event; --`,
	`x'); UPDATE outbox_event SET status = 'done'; --`,
	`%`,
	`_`,
	`\`,
	`$1`,
	`$$; SELECT pg_sleep(5); $$`,
	`" OR ""="`,
	`acme'::text OR true --`,
}

// TestOutboxctlStoresInjectionShapedValuesLiterally publishes through the
// CLI with SQL-injection-shaped tenants, keys and payloads: each is stored
// verbatim, nothing else changes, and the password never shows.
func TestOutboxctlStoresInjectionShapedValuesLiterally(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	pw := secret()
	url := withPassword(s.URL, pw)
	for i, v := range injections {
		payload, _ := json.Marshal(map[string]string{"v": v})
		code, out, errOut := outboxctl(t, url, "publish", "--type", "mail.user.welcome", "--tenant", v, "--key", v, "--payload", string(payload), "--json")
		if code != 0 {
			t.Fatalf("publish %q: exit %d: %s", v, code, errOut)
		}
		if strings.Contains(out+errOut, pw) {
			t.Fatalf("password in output: %s %s", out, errOut)
		}
		var res struct{ ID int64 }
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatalf("%q: %v: %s", v, err, out)
		}
		var tenant, key, got string
		var n int
		if err := s.Pool.QueryRow(ctx, `SELECT tenant_id, dispatch_key, payload->>'v', (SELECT count(*) FROM outbox_event) FROM outbox_event WHERE id = $1`, res.ID).Scan(&tenant, &key, &got, &n); err != nil {
			t.Fatal(err)
		}
		if tenant != v || key != v || got != v || n != i+1 {
			t.Fatalf("stored tenant %q key %q payload %q, %d rows; want %q and %d rows", tenant, key, got, n, v, i+1)
		}
	}
	// An injection-shaped type is refused as bad usage, nothing written.
	for _, v := range injections {
		code, _, errOut := outboxctl(t, url, "publish", "--type", "mail.user."+v)
		if code != 2 || !strings.Contains(errOut, "Type") {
			t.Errorf("type %q: exit %d (%s), want 2 naming Type", v, code, errOut)
		}
	}
	var n, notPending int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE status <> 'pending') FROM outbox_event`).Scan(&n, &notPending); err != nil {
		t.Fatal(err)
	}
	if n != len(injections) || notPending != 0 {
		t.Fatalf("%d rows (%d not pending), want %d pending", n, notPending, len(injections))
	}
}

// TestFilterFlagsMatchInjectionShapedValuesLiterally requeues and cancels
// with SQL-injection-shaped --tenant, --type-prefix and --error-contains:
// each selects exactly the rows holding that literal text.
func TestFilterFlagsMatchInjectionShapedValuesLiterally(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	pw := secret()
	url := withPassword(s.URL, pw)
	// One failed event per injection value (as tenant and as error), plus
	// bystanders that a wildcard or a tautology would catch.
	for _, v := range append(slices.Clone(injections), "acme", "bystander") {
		if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, tenant_id, status, last_error) VALUES ('mail.user.welcome', '{}', $1, 'failed', 'boom: ' || $1)`, v); err != nil {
			t.Fatal(err)
		}
	}
	type result struct {
		Affected int     `json:"affected"`
		IDs      []int64 `json:"ids"`
	}
	for _, v := range injections {
		for _, flag := range []string{"--tenant", "--error-contains"} {
			code, out, errOut := outboxctl(t, url, "requeue", flag, v, "--dry-run", "--json")
			if strings.Contains(out+errOut, pw) {
				t.Fatalf("password in output")
			}
			if code != 0 {
				t.Errorf("requeue %s %q: exit %d: %s", flag, v, code, errOut)
				continue
			}
			var r result
			if err := json.Unmarshal([]byte(out), &r); err != nil {
				t.Fatalf("%v: %s", err, out)
			}
			want := 1
			if flag == "--error-contains" {
				// strpos: values contained in other values match those too.
				if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE strpos(last_error, $1) > 0`, v).Scan(&want); err != nil {
					t.Fatal(err)
				}
			}
			if r.Affected != want {
				t.Errorf("requeue %s %q selected %d events, want %d (literal match)", flag, v, r.Affected, want)
			}
		}
		// No event type starts with these: a LIKE wildcard would match all.
		code, out, errOut := outboxctl(t, url, "cancel", "--type-prefix", v, "--json")
		if code != 0 && code != 2 {
			t.Errorf("cancel --type-prefix %q: exit %d: %s", v, code, errOut)
		}
		if code == 0 {
			var r result
			if err := json.Unmarshal([]byte(out), &r); err != nil || r.Affected != 0 {
				t.Errorf("cancel --type-prefix %q changed %d events (%v)", v, r.Affected, err)
			}
		}
	}
	// Ids are numbers or bad usage.
	for _, v := range []string{"1 OR 1=1", "1; DELETE FROM outbox_event", "0x1", "-1"} {
		if code, _, _ := outboxctl(t, url, "requeue", "--id", v); code != 2 {
			t.Errorf("requeue --id %q: exit %d, want 2", v, code)
		}
	}
	var failed, total int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'failed'), count(*) FROM outbox_event`).Scan(&failed, &total); err != nil {
		t.Fatal(err)
	}
	if failed != total || total != len(injections)+2 {
		t.Fatalf("%d of %d events still failed, want all %d untouched", failed, total, len(injections)+2)
	}
}

// TestOutboxctlErrorsNeverShowThePassword makes every command fail after
// connecting (the schema has no outbox tables) and checks stdout, stderr
// and --json for the password.
func TestOutboxctlErrorsNeverShowThePassword(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 1, NoMigrate: true})
	pw := secret()
	urls := map[string]string{
		"url":       withPassword(s.URL, pw),
		"key=value": "host=127.0.0.1 port=1 user=postgres password=" + pw + " dbname=postgres connect_timeout=1",
		"bad url":   "postgres://postgres:" + pw + "@127.0.0.1:notaport/x",
	}
	cmds := [][]string{
		{"stats"}, {"stats", "--json"}, {"requeue", "--id", "1", "--json"}, {"cancel", "--id", "1"},
		{"publish", "--type", "a.b.c"}, {"explain", "1", "--json"}, {"retention", "run", "--dry-run"}, {"audit", "--json"},
	}
	for name, url := range urls {
		for _, args := range cmds {
			code, out, errOut := outboxctl(t, url, args...)
			if code == 0 {
				t.Errorf("%s: %v succeeded on a schema without tables", name, args)
			}
			if strings.Contains(out+errOut, pw) {
				t.Errorf("%s: %v printed the password:\n%s%s", name, args, out, errOut)
			}
		}
	}
}
