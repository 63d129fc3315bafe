package config_test

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/config"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

func TestParseQueues(t *testing.T) {
	t.Parallel()
	got, err := config.ParseQueues(" outbox_mail:20, outbox_webhook ,outbox_marketing:workers=5:cooldown=5ms:poll=200ms,,")
	if err != nil {
		t.Fatal(err)
	}
	want := []outboxriver.Queue{
		{Name: "outbox_mail", MaxWorkers: 20},
		{Name: "outbox_webhook"},
		{Name: "outbox_marketing", MaxWorkers: 5, FetchCooldown: 5 * time.Millisecond, FetchPollInterval: 200 * time.Millisecond},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v\nwant %+v", got, want)
	}

	bad := map[string]string{
		"outbox.mail":               `try "outbox_mail"`,
		"outbox_mail:0":             "from 1 to 10000",
		"outbox_mail:many":          "from 1 to 10000",
		"outbox_mail:cooldown=fast": "positive duration",
		"outbox_mail:cooldown=10us": "minimum of 1ms",
		"outbox_mail:speed=3":       `unknown setting "speed"`,
		"outbox_mail,outbox_mail":   "listed twice",
		"q:cooldown=1s:poll=10ms":   "must not be shorter than cooldown",
	}
	for spec, want := range bad {
		_, err := config.ParseQueues(spec)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseQueues(%q): %v, want an error containing %q", spec, err, want)
		}
	}
}

func TestParseGroups(t *testing.T) {
	t.Parallel()
	got, err := config.ParseGroups("general=outbox_workflow; mail = outbox_mail:20,outbox_webhook;")
	if err != nil {
		t.Fatal(err)
	}
	want := []config.Group{
		{Name: "general", Queues: []outboxriver.Queue{{Name: "outbox_workflow"}}},
		{Name: "mail", Queues: []outboxriver.Queue{{Name: "outbox_mail", MaxWorkers: 20}, {Name: "outbox_webhook"}}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v\nwant %+v", got, want)
	}
	if g, ok := config.FindGroup(got, "mail"); !ok || !reflect.DeepEqual(g.QueueNames(), []string{"outbox_mail", "outbox_webhook"}) {
		t.Errorf("FindGroup(mail) = %+v, %v", g, ok)
	}
	if _, ok := config.FindGroup(got, "web"); ok {
		t.Error("FindGroup found a group that is not declared")
	}
	bad := map[string]string{
		"outbox_mail":                   "want NAME=QUEUE",
		"Mail=outbox_mail":              `group name "Mail"`,
		"a=q1;a=q2":                     `group "a" is defined twice`,
		"a=":                            `group "a" lists no queue`,
		"mail=outbox.mail":              `group "mail": "outbox.mail"`,
		"mail=outbox_mail;web=x:cool=1": `group "web"`,
	}
	for spec, want := range bad {
		_, err := config.ParseGroups(spec)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseGroups(%q): %v, want an error containing %q", spec, err, want)
		}
	}
}

func TestUnworkedAndUnroutedQueues(t *testing.T) {
	t.Parallel()
	routes, err := route.New([]route.Rule{
		{Prefix: "mail.", Queues: []string{"outbox_mail"}},
		{Prefix: "webhook.", Queues: []string{"outbox_webhook"}},
		{Prefix: "audit.", Queues: []string{"outbox_audit"}},
		{Prefix: "plugin.hook.", Queues: []string{"outbox_plugin-hook", "outbox_audit"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	groups, err := config.ParseGroups("general=outbox_audit,outbox_workflow;mail=outbox_mail")
	if err != nil {
		t.Fatal(err)
	}
	if got := config.UnworkedQueues(routes, groups); !reflect.DeepEqual(got, []string{"outbox_plugin-hook", "outbox_webhook"}) {
		t.Errorf("UnworkedQueues = %v", got)
	}
	if got := config.UnroutedQueues(routes, groups[0].Queues); !reflect.DeepEqual(got, []string{"outbox_workflow"}) {
		t.Errorf("UnroutedQueues = %v", got)
	}
}

// TestActiveQueues writes river_queue as River's producers do (an upsert at
// start and every report interval; paused_at set by a pause): a queue
// reported recently and not paused is active.
func TestActiveQueues(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	if _, err := s.Pool.Exec(ctx, `
INSERT INTO river_queue (name, created_at, metadata, paused_at, updated_at) VALUES
  ('outbox_webhook', now(), '{}', NULL, now()),
  ('outbox_mail', now(), '{}', NULL, now() - interval '1 minute'),
  ('outbox_paused', now(), '{}', now(), now()),
  ('outbox_gone', now() - interval '1 day', '{}', NULL, now() - interval '21 minutes')`); err != nil {
		t.Fatal(err)
	}
	got, err := config.ActiveQueues(ctx, s.Pool, 0)
	if err != nil || !reflect.DeepEqual(got, []string{"outbox_mail", "outbox_webhook"}) {
		t.Errorf("ActiveQueues(0) = %v, %v; want [outbox_mail outbox_webhook]", got, err)
	}
	got, err = config.ActiveQueues(ctx, s.Pool, 30*time.Second)
	if err != nil || !reflect.DeepEqual(got, []string{"outbox_webhook"}) {
		t.Errorf("ActiveQueues(30s) = %v, %v; want [outbox_webhook]", got, err)
	}
}
