package routesync

import (
	"strings"
	"testing"

	"github.com/outboxhq/outbox/route"
)

// TestRoutesCompare: added, removed and changed prefixes (queue order
// counts: it is the fan-out order), nothing for identical sets.
func TestRoutesCompare(t *testing.T) {
	table, err := route.Parse([]byte("routes:\n  - prefix: \"mail.\"\n    queues: [a, b]\n  - prefix: \"billing.\"\n    queue: c\n  - prefix: \"audit.\"\n    queue: d\n"))
	if err != nil {
		t.Fatal(err)
	}
	file := FromTable(table)
	if d := Compare(file, file); !d.Empty() {
		t.Fatalf("same set: %+v", d)
	}
	d := Compare(file, []Route{{"mail.", []string{"b", "a"}}, {"audit.", []string{"d"}}, {"webhook.", []string{"e"}}})
	if strings.Join(d.Added, ",") != "billing." || strings.Join(d.Removed, ",") != "webhook." || strings.Join(d.Changed, ",") != "mail." {
		t.Fatalf("drift %+v", d)
	}
	if b, err := JSON(nil); err != nil || string(b) != "[]" {
		t.Fatalf("JSON(nil) = %s %v", b, err)
	}
}
