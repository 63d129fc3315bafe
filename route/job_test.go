package route_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/route"
)

func TestJobShapeFromFile(t *testing.T) {
	t.Parallel()
	tbl, err := route.Parse([]byte(`
routes:
  - prefix: "billing.invoice.paid"
    queue: mail
    kind: send_invoice_email
    args: payload
    priority: 2
    max_attempts: 10
    tags: [billing]
  - prefix: "billing.invoice."
    queues: [outbox_audit, outbox_ledger]
    priority: 4
  - prefix: "billing.invoice.refunded"
    jobs:
      - queue: outbox_audit
      - queue: mail
        kind: send_refund_email
        args: payload
        max_attempts: 3
        tags: [billing, refund-mail]
  - prefix: "mail."
    queue: outbox_mail
`))
	if err != nil {
		t.Fatal(err)
	}
	cases := map[string][]route.Job{
		"billing.invoice.paid": {
			{Queue: "mail", Kind: "send_invoice_email", Args: route.ArgsPayload, Priority: 2, MaxAttempts: 10, Tags: []string{"billing"}, Line: 3},
		},
		"billing.invoice.voided": {
			{Queue: "outbox_audit", Kind: route.DefaultKind, Args: route.ArgsEnvelope, Priority: 4, Line: 10},
			{Queue: "outbox_ledger", Kind: route.DefaultKind, Args: route.ArgsEnvelope, Priority: 4, Line: 10},
		},
		"billing.invoice.refunded": {
			{Queue: "outbox_audit", Kind: route.DefaultKind, Args: route.ArgsEnvelope, Line: 15},
			{Queue: "mail", Kind: "send_refund_email", Args: route.ArgsPayload, MaxAttempts: 3, Tags: []string{"billing", "refund-mail"}, Line: 16},
		},
		"mail.user.welcome": {
			{Queue: "outbox_mail", Kind: route.DefaultKind, Args: route.ArgsEnvelope, Line: 21},
		},
	}
	for typ, want := range cases {
		rule, ok := tbl.Match(typ)
		if !ok {
			t.Fatalf("%s: no rule", typ)
		}
		if !reflect.DeepEqual(rule.Jobs, want) {
			t.Errorf("%s: jobs\n got %+v\nwant %+v", typ, rule.Jobs, want)
		}
		for i, j := range rule.Jobs {
			if rule.Queues[i] != j.Queue {
				t.Errorf("%s: Queues %v do not follow Jobs", typ, rule.Queues)
			}
		}
	}
}

// Existing routes files keep parsing, every rule with the default job.
func TestReferenceRoutesGetDefaultJobs(t *testing.T) {
	t.Parallel()
	tbl, err := route.Load("../docs/examples/routes.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range tbl.Rules() {
		if len(r.Jobs) != len(r.Queues) {
			t.Fatalf("%s: %d jobs for %d queues", r.Prefix, len(r.Jobs), len(r.Queues))
		}
		for _, j := range r.Jobs {
			if j.Kind != route.DefaultKind || j.Args != route.ArgsEnvelope || j.Priority != 0 || j.MaxAttempts != 0 || j.Tags != nil {
				t.Errorf("%s: job %+v is not the default", r.Prefix, j)
			}
		}
	}
}

func TestNewJobShapes(t *testing.T) {
	t.Parallel()
	tbl, err := route.New([]route.Rule{
		{Prefix: "mail.", Queues: []string{"outbox_mail", "outbox_audit"}},
		{Prefix: "billing.", Jobs: []route.Job{{Queue: "mail", Kind: "send_invoice_email", Args: route.ArgsPayload}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if r, _ := tbl.Match("mail.x.y"); len(r.Jobs) != 2 || !reflect.DeepEqual(r.Jobs[1], route.Job{Queue: "outbox_audit", Kind: route.DefaultKind, Args: route.ArgsEnvelope}) {
		t.Errorf("queues-only rule: jobs %+v", r.Jobs)
	}
	if r, _ := tbl.Match("billing.x.y"); strings.Join(r.Queues, ",") != "mail" {
		t.Errorf("jobs-only rule: queues %v", r.Queues)
	}
	bad := []struct {
		rule route.Rule
		want string
	}{
		{route.Rule{Prefix: "a.", Queues: []string{"q"}, Jobs: []route.Job{{Queue: "r"}}}, `Queues[0] is "q" but Jobs[0].Queue is "r"`},
		{route.Rule{Prefix: "a.", Queues: []string{"q", "r"}, Jobs: []route.Job{{Queue: "q"}}}, "Queues has 2 names but Jobs has 1"},
		{route.Rule{Prefix: "a.", Jobs: []route.Job{{Queue: "q", Priority: 7}}}, "route 1 (prefix \"a.\"): priority 7 is out of range"},
		{route.Rule{Prefix: "a.", Jobs: []route.Job{{Queue: "q", MaxAttempts: -1}}}, "max_attempts -1 is out of range"},
		{route.Rule{Prefix: "a.", Jobs: []route.Job{{Queue: "q", Args: "raw"}}}, `args "raw" is not a shape`},
		{route.Rule{Prefix: "a.", Jobs: []route.Job{{Queue: "q", Args: route.ArgsPayload}}}, "args: payload needs the kind"},
		{route.Rule{Prefix: "a.", Jobs: []route.Job{{Queue: "q", Kind: "a b"}}}, `try "a_b"`},
		{route.Rule{Prefix: "a.", Jobs: []route.Job{{Queue: "q", Tags: []string{"x"}}}}, `tag "x" is not valid`},
		{route.Rule{Prefix: "a.", Jobs: []route.Job{{Queue: "q"}, {Queue: "r", Priority: 9}}}, `queue r: priority 9`},
	}
	for _, c := range bad {
		_, err := route.New([]route.Rule{c.rule})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: err = %v, want %q", c.rule, err, c.want)
		}
	}
}

// Every new routes-file key is validated at load, with the line and the fix.
func TestJobShapeErrors(t *testing.T) {
	t.Parallel()
	rule := "routes:\n  - prefix: \"billing.\"\n    queue: mail\n" // the rule is at line 2, the next key at line 4
	long := strings.Repeat("k", 128)
	cases := []struct {
		name, body string
		want       []string
	}{
		{"kind with a space", rule + "    kind: send invoice\n", []string{"line 4", `kind "send invoice" is not valid for River`, `try "send_invoice"`}},
		{"kind with a comma", rule + "    kind: \"a,b\"\n", []string{"line 4", "no spaces or commas", `try "a_b"`}},
		{"kind of one character", rule + "    kind: k\n", []string{"line 4", "at least two characters"}},
		{"kind too long", rule + "    kind: " + long + "\n", []string{"line 4", "128 characters, River allows at most 127"}},
		{"kind empty", rule + "    kind: \"\"\n", []string{"line 4", "kind is empty", "outbox_event"}},
		{"kind not a string", rule + "    kind: [a]\n", []string{"line 4", "kind must be a string"}},
		{"args unknown", rule + "    args: raw\n", []string{"line 4", `args "raw" is not a shape`, "envelope", "payload"}},
		{"args empty", rule + "    args: \"\"\n", []string{"line 4", "args must be envelope or payload"}},
		{"payload args with the default kind", rule + "    args: payload\n", []string{"line 2", "args: payload needs the kind", "outboxriver.Worker"}},
		{"payload args with kind outbox_event", rule + "    kind: outbox_event\n    args: payload\n", []string{"line 2", "args: payload needs the kind"}},
		{"priority 0", rule + "    priority: 0\n", []string{"line 4", "priority 0 is out of range", "1 (highest) to 4 (lowest)"}},
		{"priority 5", rule + "    priority: 5\n", []string{"line 4", "priority 5 is out of range"}},
		{"priority a word", rule + "    priority: high\n", []string{"line 4", "priority must be an integer"}},
		{"priority a fraction", rule + "    priority: 2.5\n", []string{"line 4", "priority must be an integer"}},
		{"priority quoted", rule + "    priority: \"2\"\n", []string{"line 4", "priority must be an integer"}},
		{"max_attempts 0", rule + "    max_attempts: 0\n", []string{"line 4", "max_attempts 0 is out of range", "1 to 32767"}},
		{"max_attempts beyond smallint", rule + "    max_attempts: 40000\n", []string{"line 4", "max_attempts 40000 is out of range"}},
		{"max_attempts a word", rule + "    max_attempts: ten\n", []string{"line 4", "max_attempts must be an integer"}},
		{"tags not a list", rule + "    tags: billing\n", []string{"line 4", "tags must be a list"}},
		{"tag too short", rule + "    tags:\n      - ok-tag\n      - ab\n", []string{"line 6", `tag "ab" is not valid for River`, "3 to 255"}},
		{"tag with a dot", rule + "    tags: [billing.invoice]\n", []string{"line 4", `try "billing_invoice"`}},
		{"tag ending in a dash", rule + "    tags: [billing-]\n", []string{"line 4", `try "billing"`}},
		{"tag too long", rule + "    tags: [" + strings.Repeat("t", 256) + "]\n", []string{"line 4", "256 characters, River allows at most 255"}},
		{"tag not a string", rule + "    tags: [[a]]\n", []string{"line 4", "each tag must be a string"}},
		{"unknown rule key", rule + "    priorty: 2\n", []string{"line 4", `unknown key "priorty"`, "max_attempts, tags"}},
		{"key twice", rule + "    kind: a_b\n    kind: c_d\n", []string{"line 5", `key "kind" is given twice`, "line 4"}},
		{"jobs and queue", rule + "    jobs: [{queue: q}]\n", []string{"line 2", "both jobs and queue(s)"}},
		{"jobs and a rule-level shape", "routes:\n  - prefix: \"a.\"\n    tags: [billing]\n    jobs: [{queue: q}]\n", []string{"line 3", "rule-level tags", "in each job"}},
		{"jobs empty", "routes:\n  - prefix: \"a.\"\n    jobs: []\n", []string{"line 3", "jobs must be a non-empty list"}},
		{"job not a mapping", "routes:\n  - prefix: \"a.\"\n    jobs: [q]\n", []string{"line 3", "a job must be a mapping"}},
		{"job without queue", "routes:\n  - prefix: \"a.\"\n    jobs:\n      - kind: a_b\n", []string{"line 4", "job has no queue"}},
		{"job queue a list", "routes:\n  - prefix: \"a.\"\n    jobs:\n      - queue: [a, b]\n", []string{"line 4", "one job per queue"}},
		{"unknown job key", "routes:\n  - prefix: \"a.\"\n    jobs:\n      - queue: q\n        prefix: b.\n", []string{"line 5", `unknown key "prefix" in a job`, "queue, kind, args"}},
		{"job with a dotted queue", "routes:\n  - prefix: \"a.\"\n    jobs:\n      - queue: q\n      - queue: outbox.mail\n", []string{"route at line 2", "job at line 5", `try "outbox_mail"`}},
		{"job queue twice", "routes:\n  - prefix: \"a.\"\n    jobs:\n      - queue: q\n      - queue: q\n        kind: a_b\n", []string{"job at line 5", `queue "q" is listed twice`}},
		{"job payload without kind", "routes:\n  - prefix: \"a.\"\n    jobs:\n      - queue: q\n      - queue: r\n        args: payload\n", []string{"route at line 2", "job at line 5", "queue r: args: payload needs the kind"}},
		{"job priority out of range", "routes:\n  - prefix: \"a.\"\n    jobs:\n      - queue: q\n        priority: 9\n", []string{"line 5", "priority 9 is out of range"}},
		{"job bad tag", "routes:\n  - prefix: \"a.\"\n    jobs:\n      - queue: q\n        tags: [\"no space\"]\n", []string{"line 5", `try "no_space"`}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, err := route.Parse([]byte(c.body))
			if err == nil {
				t.Fatalf("accepted:\n%s", c.body)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestValidKindsAndTags(t *testing.T) {
	t.Parallel()
	job := func(j route.Job) error {
		j.Queue = "outbox_mail"
		_, err := route.New([]route.Rule{{Prefix: "mail.", Jobs: []route.Job{j}}})
		return err
	}
	for _, k := range []string{"outbox_event", "send_invoice_email", "ab", "Billing.Invoice:v2", "a/b[c]<d>+e-f", strings.Repeat("k", 127)} {
		if err := job(route.Job{Kind: k}); err != nil {
			t.Errorf("kind %q: %v", k, err)
		}
	}
	for _, tag := range []string{"abc", "billing", "Refund_Mail", "a-b", "x-y-z", strings.Repeat("t", 255)} {
		if err := job(route.Job{Tags: []string{tag}}); err != nil {
			t.Errorf("tag %q: %v", tag, err)
		}
	}
}

func TestValidateInsertChecksWhatRiverRefuses(t *testing.T) {
	t.Parallel()
	if err := route.ValidateInsert("outbox_mail", 1, 25, []string{"a_b", "x-y-z"}); err != nil {
		t.Fatalf("valid job refused: %v", err)
	}
	for _, tc := range []struct {
		queue       string
		priority    int
		maxAttempts int
		tags        []string
		want        string
	}{
		{"no.dots", 1, 25, nil, `queue name "no.dots"`},
		{"q", 0, 25, nil, "priority 0 is out of range"},
		{"q", 5, 25, nil, "priority 5 is out of range"},
		{"q", 1, 0, nil, "max_attempts 0 is out of range"},
		{"q", 1, 32768, nil, "max_attempts 32768 is out of range"},
		{"q", 1, 25, []string{"ok_tag", "ab"}, `tag "ab" is not valid`},
	} {
		err := route.ValidateInsert(tc.queue, tc.priority, tc.maxAttempts, tc.tags)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ValidateInsert(%q, %d, %d, %v) = %v, want an error containing %q", tc.queue, tc.priority, tc.maxAttempts, tc.tags, err, tc.want)
		}
	}
}
