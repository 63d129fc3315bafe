package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// rawControls are what must never reach the terminal raw.
var rawControls = []string{"\x1b", "\r", "\b", "\x07", "\u0085", "\u009b", "\u202e", "\u2066", "\u200f"}

func assertNoRawControls(t *testing.T, what, out string) {
	t.Helper()
	for _, c := range rawControls {
		if strings.Contains(out, c) {
			t.Errorf("%s prints %q raw:\n%q", what, c, out)
		}
	}
}

// TestTextOutputEscapesControlCharacters: tenant ids, keys, errors, payloads,
// actors and filters stored with ESC, CR, backspace, C1 controls and bidi
// overrides are escaped by explain and audit; --json stays exact.
func TestTextOutputEscapesControlCharacters(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	const (
		tenant  = "acme\x1b[2J\x1b[31m"
		key     = "key\rowned\b\b\u202eevil\u2066"
		lastErr = "boom\x07\u009b31m\nsecond line"
	)
	var id int64
	if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, tenant_id, dispatch_key, status, last_error)
		VALUES ('mail.user.welcome', jsonb_build_object('note', 'hi' || chr(8238) || 'txt.exe' || chr(133)), $1, $2, 'failed', $3) RETURNING id`,
		tenant, key, lastErr).Scan(&id); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := ctl(t, s.URL, "explain", fmt.Sprint(id))
	if code != 0 {
		t.Fatalf("explain: exit %d: %s", code, stderr)
	}
	assertNoRawControls(t, "explain", stdout)
	for _, want := range []string{`acme\x1b[2J\x1b[31m`, `key\rowned\x08\x08\u202eevil\u2066`, `boom\x07\u009b31m\nsecond line`, `hi\u202etxt.exe\u0085`} {
		if !strings.Contains(stdout, want) {
			t.Errorf("explain output lacks %q:\n%s", want, stdout)
		}
	}
	// JSON carries the exact values (encoding/json escapes them).
	code, stdout, _ = ctl(t, s.URL, "explain", "--json", fmt.Sprint(id))
	var res admin.Explanation
	if err := json.Unmarshal([]byte(stdout), &res); code != 0 || err != nil {
		t.Fatalf("explain --json: exit %d, %v", code, err)
	}
	if *res.Event.TenantID != tenant || *res.Event.DispatchKey != key || *res.Event.LastError != lastErr {
		t.Errorf("--json changed the values: %q %q %q", *res.Event.TenantID, *res.Event.DispatchKey, *res.Event.LastError)
	}
	assertNoRawControls(t, "explain --json", stdout)

	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_audit (actor, action, filter, affected, detail)
		VALUES ($1, 'requeue', jsonb_build_object('tenant', $2::text), 1, '{}')`, "mallory\x1b]0;pwned\x07\r", "t\u202e1"); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr = ctl(t, s.URL, "audit")
	if code != 0 {
		t.Fatalf("audit: exit %d: %s", code, stderr)
	}
	assertNoRawControls(t, "audit", stdout)
	if !strings.Contains(stdout, `mallory\x1b]0;pwned\x07\r`) || !strings.Contains(stdout, `t\u202e1`) {
		t.Errorf("audit output:\n%s", stdout)
	}

	// Error messages, too: an unknown command or a refused tenant.
	code, _, stderr = ctl(t, s.URL, "publish", "--type", "mail.user.welcome", "--tenant", "x\x1b[2J"+strings.Repeat("t", 300))
	if code != 2 {
		t.Errorf("publish with a long tenant: exit %d", code)
	}
	assertNoRawControls(t, "publish error", stderr)
}

func TestClean(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"plain text, ünïcode ✓ and a \\ backslash":               "plain text, ünïcode ✓ and a \\ backslash",
		"a\x1bb\rc\bd\te\nf\x7f":                                 `a\x1bb\rc\x08d\te\nf\x7f`,
		"\u0085\u009f\u202a\u202e\u2066\u2069\u200e\u061c\u2028": `\u0085\u009f\u202a\u202e\u2066\u2069\u200e\u061c\u2028`,
		"bad \xff\xfe utf-8":                                     `bad \xff\xfe utf-8`,
	} {
		if got := clean(in); got != want {
			t.Errorf("clean(%q) = %q, want %q", in, got, want)
		}
	}
}
