package route_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/route"
)

func TestLongestPrefixWins(t *testing.T) {
	t.Parallel()
	tbl, err := route.New([]route.Rule{
		{Prefix: "plugin.", Queues: []string{"outbox_plugin"}},
		{Prefix: "plugin.hook.", Queues: []string{"outbox_plugin-hook", "outbox_audit"}},
		{Prefix: "plugin.hook.workflow.executed", Queues: []string{"outbox_exact"}},
		{Prefix: "mail.", Queues: []string{"outbox_mail"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	cases := map[string]string{
		"plugin.capability-use.granted":  "outbox_plugin",
		"plugin.hook.workflow.started":   "outbox_plugin-hook,outbox_audit",
		"plugin.hook.workflow.executed":  "outbox_exact",
		"plugin.hook.workflow.executed2": "outbox_plugin-hook,outbox_audit",
		"mail.user.welcome":              "outbox_mail",
		"mailbox.user.created":           "",
		"billing.invoice.paid":           "",
	}
	for typ, want := range cases {
		rule, ok := tbl.Match(typ)
		if got := strings.Join(rule.Queues, ","); got != want || ok != (want != "") {
			t.Errorf("Match(%q) = %q, %v, want %q", typ, got, ok, want)
		}
	}
	if got := strings.Join(tbl.AllQueues(), ","); got != "outbox_audit,outbox_exact,outbox_mail,outbox_plugin,outbox_plugin-hook" {
		t.Errorf("AllQueues = %s", got)
	}
}

func TestQueueNameValidation(t *testing.T) {
	t.Parallel()
	good := []string{"outbox_mail", "outbox_plugin-hook", "a", "a1_b2-c3", strings.Repeat("q", 64)}
	for _, q := range good {
		if err := route.ValidateQueueName(q); err != nil {
			t.Errorf("%q: %v", q, err)
		}
	}
	bad := map[string]string{
		"outbox.mail":           `try "outbox_mail"`,
		"Outbox_Mail":           `try "outbox_mail"`,
		"outbox__mail":          "single",
		"_outbox":               "single",
		"outbox-":               "single",
		"":                      "empty",
		strings.Repeat("q", 65): "at most 64",
		"outbox|mail":           "no dots",
	}
	for q, want := range bad {
		err := route.ValidateQueueName(q)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: err = %v, want %q", q, err, want)
		}
	}
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadReferenceRoutes(t *testing.T) {
	t.Parallel()
	tbl, err := route.Load("../docs/examples/routes.yaml")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"tenant.subscription.renewed":   "outbox_notification",
		"mail.user.welcome":             "outbox_mail",
		"webhook.endpoint.called":       "outbox_webhook",
		"notification.push.sent":        "outbox_notification",
		"audit.user.login":              "outbox_audit",
		"workflow.run.started":          "outbox_workflow",
		"search.index.updated":          "outbox_search-index",
		"ai.cost.recorded":              "outbox_ai-cost",
		"marketing.lead.captured":       "outbox_marketing",
		"form.submission.received":      "outbox_form-submission-route",
		"billing.invoice.paid":          "outbox_notification",
		"plugin.hook.workflow.executed": "outbox_plugin-hook",
		"plugin.capability-use.granted": "outbox_plugin-capability-use",
		"rag.index.chunked":             "outbox_rag-index",
	}
	for typ, q := range want {
		rule, _ := tbl.Match(typ)
		if got := strings.Join(rule.Queues, ","); got != q {
			t.Errorf("%s → %q, want %q", typ, got, q)
		}
	}
	if len(tbl.Rules()) != 14 {
		t.Errorf("%d rules, want 14", len(tbl.Rules()))
	}
}

func TestFanOutFromFile(t *testing.T) {
	t.Parallel()
	tbl, err := route.Load(writeFile(t, `
routes:
  - prefix: "mail."
    queue: outbox_mail
  - prefix: "plugin.hook."
    queues: [outbox_plugin-hook, outbox_audit]
`))
	if err != nil {
		t.Fatal(err)
	}
	if rule, _ := tbl.Match("plugin.hook.x.y"); strings.Join(rule.Queues, ",") != "outbox_plugin-hook,outbox_audit" {
		t.Fatalf("fan-out = %v", rule.Queues)
	}
}

func TestRoutesFileErrors(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, body string
		want       []string
	}{
		{"empty file", ``, []string{"empty"}},
		{"malformed", "routes: [\n  - prefix: \"a.\"\n", []string{"not valid YAML"}},
		{"not a mapping", "- a\n- b\n", []string{"line 1", "routes"}},
		{"unknown top key", "routes:\n  - prefix: a.\n    queue: q\nrutes: []\n", []string{"line 4", `unknown key "rutes"`}},
		{"no routes", "routes: []\n", []string{"routes is empty"}},
		{"unknown rule key", "routes:\n  - prefix: \"mail.\"\n    queue: outbox_mail\n    queeu: x\n", []string{"line 4", `unknown key "queeu"`, "prefix, queue, queues"}},
		{"dotted queue", "routes:\n  - prefix: \"mail.\"\n    queue: outbox.mail\n", []string{"line 2", `prefix "mail."`, `try "outbox_mail"`}},
		{"empty queue", "routes:\n  - prefix: \"mail.\"\n    queue: \"\"\n", []string{"line 2", "queue name is empty"}},
		{"no queue", "routes:\n  - prefix: \"mail.\"\n", []string{"line 2", "no queue"}},
		{"both queue and queues", "routes:\n  - prefix: \"mail.\"\n    queue: a\n    queues: [b]\n", []string{"line 2", "both queue and queues"}},
		{"duplicate prefix", "routes:\n  - prefix: \"mail.\"\n    queue: a\n  - prefix: \"mail.\"\n    queue: b\n", []string{"line 4", `duplicate prefix "mail."`, "line 2"}},
		{"prefix without dot", "routes:\n  - prefix: \"mail\"\n    queue: a\n", []string{"line 2", `use "mail."`}},
		{"uppercase prefix", "routes:\n  - prefix: \"Mail.\"\n    queue: a\n", []string{"line 2", "lowercase"}},
		{"no prefix", "routes:\n  - queue: a\n", []string{"line 2", "no prefix"}},
		{"queue twice", "routes:\n  - prefix: \"a.\"\n    queues: [q, q]\n", []string{"listed twice"}},
		{"queues not a list", "routes:\n  - prefix: \"a.\"\n    queues: q\n", []string{"line 3", "must be a list"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, err := route.Load(writeFile(t, c.body))
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
	if _, err := route.Load(filepath.Join(t.TempDir(), "missing.yaml")); err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("missing file: %v", err)
	}
}
