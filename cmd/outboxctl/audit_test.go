package main

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestAuditTextKeepsStoredKeyOrder: the FILTER column prints the stored
// JSON on one line as the database gives it (json.Compact), without
// reordering its keys or escaping <, > and &.
func TestAuditTextKeepsStoredKeyOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	if _, err := s.Pool.Exec(context.Background(), `INSERT INTO outbox_audit (actor, action, filter, affected, detail)
		VALUES ('bob', 'requeue', '{"limit": 1000, "ids": [1], "x": "<&>"}', 1, '{}')`); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := ctl(t, s.URL, "audit")
	// jsonb stores keys shorter first: x, ids, limit.
	if want := `{"x":"<&>","ids":[1],"limit":1000}`; code != 0 || !strings.Contains(out, want) {
		t.Fatalf("audit: exit %d, stderr %q\n%s\nwant the filter %s", code, errOut, out, want)
	}
}

// TestUsageCommentListsEveryCommand: the package comment of main.go names
// every registered command.
func TestUsageCommentListsEveryCommand(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	doc, _, _ := strings.Cut(string(src), "\npackage main")
	for name := range commands {
		if !strings.Contains(doc, "//\toutboxctl "+name+" ") {
			t.Errorf("the usage comment of main.go does not list %q", name)
		}
	}
}
