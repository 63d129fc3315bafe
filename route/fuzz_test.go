package route

import (
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"
)

// riverKind and riverTag are River's own rules (rivercommon.
// UserSpecifiedIDOrKindRE, river.tagRE), restated so that the fuzz target
// checks route against River rather than against itself.
var (
	riverKind = regexp.MustCompile(`\A[\w][\w\-\[\]<>\/.·:+]+\z`)
	riverTag  = regexp.MustCompile(`\A[\w][\w\-]+[\w]\z`)
)

// checkJob fails unless River would accept j's shape.
func checkJob(t *testing.T, prefix string, j Job) {
	t.Helper()
	switch {
	case !riverKind.MatchString(j.Kind) || utf8.RuneCountInString(j.Kind) >= 128:
		t.Fatalf("rule %q: accepted kind %q", prefix, j.Kind)
	case j.Args != ArgsEnvelope && j.Args != ArgsPayload:
		t.Fatalf("rule %q: accepted args %q", prefix, j.Args)
	case j.Args == ArgsPayload && j.Kind == DefaultKind:
		t.Fatalf("rule %q: accepted payload args under kind %s", prefix, DefaultKind)
	case j.Priority < 0 || j.Priority > 4:
		t.Fatalf("rule %q: accepted priority %d", prefix, j.Priority)
	case j.MaxAttempts < 0 || j.MaxAttempts > 32767:
		t.Fatalf("rule %q: accepted max_attempts %d", prefix, j.MaxAttempts)
	}
	for _, tag := range j.Tags {
		if !riverTag.MatchString(tag) || len(tag) > 255 {
			t.Fatalf("rule %q: accepted tag %q", prefix, tag)
		}
	}
}

// FuzzParse feeds arbitrary documents to the routes-file parser: it never
// panics, every refusal names a line or the problem, and an accepted table
// holds only valid, distinct prefixes, River-valid, distinct queues, and
// jobs River accepts (a kind matching River's rule, envelope or payload
// args, payload args never under the envelope's kind, priority 0 or 1-4,
// max_attempts 0 or 1-32767, valid tags), one job per queue, and survives a
// round trip through the file format.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"routes:\n  - prefix: \"mail.\"\n    queue: outbox_mail\n",
		"routes:\n  - prefix: \"plugin.hook.\"\n    queues: [outbox_plugin-hook, outbox_audit]\n",
		"routes:\n  - prefix: \"mail.\"\n    queue: outbox.mail\n",
		"routes:\n  - prefix: mail.\n    queue: a\n  - prefix: mail.\n    queue: b\n",
		"", "routes: []\n", "routes:\n  - 1\n", "other: x\n", "routes: {a: b}\n", "[", "routes:\n  - prefix: [a]\n",
		"routes:\n  - prefix: \"a.b.c\"\n    queue: q\n    queues: [r]\n", "routes: &a\n  - *a\n",
		"routes:\n  - prefix: \"billing.invoice.paid\"\n    queue: mail\n    kind: send_invoice_email\n    args: payload\n    priority: 2\n    max_attempts: 10\n    tags: [billing]\n",
		"routes:\n  - prefix: \"billing.\"\n    jobs:\n      - queue: outbox_audit\n      - queue: mail\n        kind: \"a/b[c]<d>:e·f+g\"\n        args: payload\n        tags: [x-y, z_1]\n",
		"routes:\n  - prefix: \"billing.\"\n    queue: mail\n    args: payload\n",
		"routes:\n  - prefix: \"billing.\"\n    queues: [a, b]\n    priority: 5\n    max_attempts: 0x10\n    tags: [ab]\n",
		"routes:\n  - prefix: \"billing.\"\n    jobs: [{queue: a, kind: k}, {queue: a}]\n",
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
			if len(r.Jobs) != len(r.Queues) {
				t.Fatalf("rule %q: %d jobs for %d queues", r.Prefix, len(r.Jobs), len(r.Queues))
			}
			fmt.Fprintf(&doc, "  - prefix: %q\n    jobs:\n", r.Prefix)
			for i, j := range r.Jobs {
				checkJob(t, r.Prefix, j)
				if j.Queue != r.Queues[i] {
					t.Fatalf("rule %q: job %d is for queue %q, Queues[%d] is %q", r.Prefix, i, j.Queue, i, r.Queues[i])
				}
				fmt.Fprintf(&doc, "      - queue: %s\n        kind: %q\n        args: %s\n", j.Queue, j.Kind, j.Args)
				if j.Priority != 0 {
					fmt.Fprintf(&doc, "        priority: %d\n", j.Priority)
				}
				if j.MaxAttempts != 0 {
					fmt.Fprintf(&doc, "        max_attempts: %d\n", j.MaxAttempts)
				}
				if j.Tags != nil {
					fmt.Fprintf(&doc, "        tags: [%s]\n", strings.Join(j.Tags, ", "))
				}
			}
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
			for i := range want.Jobs {
				g, w := got.Jobs[i], want.Jobs[i]
				g.Line, w.Line = 0, 0
				if len(g.Tags) == 0 && len(w.Tags) == 0 {
					g.Tags, w.Tags = nil, nil
				}
				if !reflect.DeepEqual(g, w) {
					t.Fatalf("round trip changed the job of %q in %s: %+v vs %+v", typ, w.Queue, g, w)
				}
			}
		}
	})
}
