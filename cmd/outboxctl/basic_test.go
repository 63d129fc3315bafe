package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"sync"
	"testing"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// ctl runs outboxctl in-process against url.
func ctl(t *testing.T, url string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(args, url, &out, &errb)
	return code, out.String(), errb.String()
}

func TestUsageErrorsExit2(t *testing.T) {
	t.Parallel()
	cases := [][]string{
		{},
		{"no-such-command"},
		{"publish"},
		{"publish", "--type", "Bad.Type"},
		{"publish", "--type", "a.b.c", "--payload", "{"},
		{"publish", "--type", "a.b.c", "--payload", `{"a":"\u0000"}`},
		{"publish", "--type", "a.b.c", "--tenant", strings.Repeat("t", 200)},
		{"publish", "--nope"},
		{"migrate", "extra"},
	}
	for _, args := range cases {
		code, _, stderr := ctl(t, "postgres://postgres:pw@127.0.0.1:1/x", args...)
		if code != 2 {
			t.Errorf("%v: exit %d, want 2 (stderr %q)", args, code, stderr)
		}
	}
	code, _, stderr := ctl(t, "", "publish", "--type", "a.b.c")
	if code != 2 || !strings.Contains(stderr, "DATABASE_URL is not set") {
		t.Errorf("no DATABASE_URL: exit %d, stderr %q", code, stderr)
	}
}

func TestDatabaseErrorsExit1WithoutPassword(t *testing.T) {
	t.Parallel()
	code, _, stderr := ctl(t, "postgres://postgres:topsecret@127.0.0.1:1/x?connect_timeout=1", "migrate")
	if code != 1 {
		t.Fatalf("exit %d, want 1", code)
	}
	if strings.Contains(stderr, "topsecret") {
		t.Fatalf("password in output: %s", stderr)
	}
	if !strings.Contains(stderr, "cannot reach the database") {
		t.Fatalf("stderr = %q", stderr)
	}
}

func TestMigrateTwiceConcurrentlyThenPublish(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true})
	var wg sync.WaitGroup
	codes := make([]int, 2)
	for i := range codes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i], _, _ = ctl(t, s.URL, "migrate", "--json")
		}()
	}
	wg.Wait()
	if codes[0] != 0 || codes[1] != 0 {
		t.Fatalf("concurrent migrate exit codes %v", codes)
	}
	code, out, stderr := ctl(t, s.URL, "migrate", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res struct {
		Schema        string `json:"schema"`
		OutboxApplied []int  `json:"outbox_applied"`
		OutboxVersion int    `json:"outbox_version"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if res.Schema != s.Name || len(res.OutboxApplied) != 0 || res.OutboxVersion < 1 {
		t.Fatalf("third migrate = %+v", res)
	}

	code, out, stderr = ctl(t, s.URL, "publish", "--type", "mail.user.welcome", "--payload", `{"to":"x"}`, "--key", "k1", "--tenant", "acme", "--json")
	if code != 0 {
		t.Fatalf("publish exit %d: %s", code, stderr)
	}
	var first struct {
		ID        int64 `json:"id"`
		Duplicate bool  `json:"duplicate"`
	}
	if err := json.Unmarshal([]byte(out), &first); err != nil || first.ID == 0 || first.Duplicate {
		t.Fatalf("publish output %s (%v)", out, err)
	}
	code, out, _ = ctl(t, s.URL, "publish", "--type", "mail.user.welcome", "--key", "k1", "--tenant", "acme")
	if code != 0 || !strings.Contains(out, "already holds dispatch key") {
		t.Fatalf("duplicate publish: exit %d, %q", code, out)
	}
}
