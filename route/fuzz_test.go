package route

import (
	"fmt"
	"strings"
	"testing"
)

// FuzzParse feeds arbitrary documents to the routes-file parser: it never
// panics, every refusal names a line or the problem, and an accepted table
// holds only valid, distinct prefixes and River-valid, distinct queues, and
// survives a round trip through the file format.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"routes:\n  - prefix: \"mail.\"\n    queue: outbox_mail\n",
		"routes:\n  - prefix: \"plugin.hook.\"\n    queues: [outbox_plugin-hook, outbox_audit]\n",
		"routes:\n  - prefix: \"mail.\"\n    queue: outbox.mail\n",
		"routes:\n  - prefix: mail.\n    queue: a\n  - prefix: mail.\n    queue: b\n",
		"", "routes: []\n", "routes:\n  - 1\n", "other: x\n", "routes: {a: b}\n", "[", "routes:\n  - prefix: [a]\n",
		"routes:\n  - prefix: \"a.b.c\"\n    queue: q\n    queues: [r]\n", "routes: &a\n  - *a\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		tbl, err := Parse(data)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error")
			}
			return
		}
		rules := tbl.Rules()
		if len(rules) == 0 {
			t.Fatal("accepted a table without rules")
		}
		seen := map[string]bool{}
		var doc strings.Builder
		doc.WriteString("routes:\n")
		for _, r := range rules {
			if err := ValidatePrefix(r.Prefix); err != nil {
				t.Fatalf("accepted prefix %q: %v", r.Prefix, err)
			}
			if seen[r.Prefix] {
				t.Fatalf("accepted duplicate prefix %q", r.Prefix)
			}
			seen[r.Prefix] = true
			if len(r.Queues) == 0 {
				t.Fatalf("rule %q has no queue", r.Prefix)
			}
			qs := map[string]bool{}
			for _, q := range r.Queues {
				if err := ValidateQueueName(q); err != nil || len(q) > 64 || strings.ContainsAny(q, ". ") {
					t.Fatalf("accepted queue %q (%v)", q, err)
				}
				if qs[q] {
					t.Fatalf("rule %q lists queue %q twice", r.Prefix, q)
				}
				qs[q] = true
			}
			fmt.Fprintf(&doc, "  - prefix: %q\n    queues: [%s]\n", r.Prefix, strings.Join(r.Queues, ", "))
		}
		again, err := Parse([]byte(doc.String()))
		if err != nil {
			t.Fatalf("the accepted table does not parse back: %v\n%s", err, doc.String())
		}
		for _, r := range rules {
			typ := r.Prefix + "x.y.z"
			got, _ := again.Match(typ)
			want, _ := tbl.Match(typ)
			if strings.Join(got.Queues, ",") != strings.Join(want.Queues, ",") {
				t.Fatalf("round trip changed the routing of %q: %v vs %v", typ, got.Queues, want.Queues)
			}
		}
	})
}
