package outboxriver_test

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

func TestParseQueues(t *testing.T) {
	t.Parallel()
	got, err := outboxriver.ParseQueues(" outbox_mail:20, outbox_webhook ,outbox_marketing:workers=5:cooldown=5ms:poll=200ms,,")
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
		_, err := outboxriver.ParseQueues(spec)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseQueues(%q): %v, want an error containing %q", spec, err, want)
		}
	}
}

func TestParseGroups(t *testing.T) {
	t.Parallel()
	got, err := outboxriver.ParseGroups("general=outbox_workflow; mail = outbox_mail:20,outbox_webhook;")
	if err != nil {
		t.Fatal(err)
	}
	want := []outboxriver.Group{
		{Name: "general", Queues: []outboxriver.Queue{{Name: "outbox_workflow"}}},
		{Name: "mail", Queues: []outboxriver.Queue{{Name: "outbox_mail", MaxWorkers: 20}, {Name: "outbox_webhook"}}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v\nwant %+v", got, want)
	}
	if g, ok := outboxriver.FindGroup(got, "mail"); !ok || !reflect.DeepEqual(g.QueueNames(), []string{"outbox_mail", "outbox_webhook"}) {
		t.Errorf("FindGroup(mail) = %+v, %v", g, ok)
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
		_, err := outboxriver.ParseGroups(spec)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseGroups(%q): %v, want an error containing %q", spec, err, want)
		}
	}
}

func TestUnworkedAndUnroutedQueues(t *testing.T) {
	t.Parallel()
	routes := testRoutes(t) // outbox_mail, outbox_webhook, outbox_audit, outbox_plugin-hook
	groups, err := outboxriver.ParseGroups("general=outbox_audit,outbox_workflow;mail=outbox_mail")
	if err != nil {
		t.Fatal(err)
	}
	if got := outboxriver.UnworkedQueues(routes, groups); !reflect.DeepEqual(got, []string{"outbox_plugin-hook", "outbox_webhook"}) {
		t.Errorf("UnworkedQueues = %v", got)
	}
	if got := outboxriver.UnroutedQueues(routes, groups[0].Queues); !reflect.DeepEqual(got, []string{"outbox_workflow"}) {
		t.Errorf("UnroutedQueues = %v", got)
	}
}

func TestQueuesConfigKeepsRiverValid(t *testing.T) {
	t.Parallel()
	workers := river.NewWorkers()
	river.AddWorker(workers, outboxriver.NewWorker(outboxriver.NewHandlers(), outboxriver.WorkerOptions{Logger: quiet}))
	cfg := outboxriver.QueuesConfig(workers, []outboxriver.Queue{
		{Name: "a"},
		{Name: "b", MaxWorkers: 3, FetchCooldown: 500 * time.Millisecond}, // above the client's 100 ms poll
		{Name: "c", FetchPollInterval: 2 * time.Second},
	}, outboxriver.WorkerLatency{})
	if cfg.Queues["a"].MaxWorkers != outboxriver.DefaultMaxWorkers || cfg.Queues["b"].MaxWorkers != 3 {
		t.Errorf("max workers: %+v", cfg.Queues)
	}
	if cfg.Queues["b"].FetchPollInterval != 500*time.Millisecond {
		t.Errorf("queue b's poll interval %s was not raised to its cooldown", cfg.Queues["b"].FetchPollInterval)
	}
	if cfg.FetchCooldown != outboxriver.DefaultFetchCooldown || cfg.FetchPollInterval != outboxriver.DefaultFetchPollInterval {
		t.Errorf("client latency %s/%s", cfg.FetchCooldown, cfg.FetchPollInterval)
	}
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true})
	if _, err := river.NewClient(riverDriver(s), cfg); err != nil {
		t.Errorf("River refuses the config: %v", err)
	}
}

func TestActiveQueues(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	startWorkers(t, s.Pool, outboxriver.NewHandlers(), nil, "outbox_mail", "outbox_webhook")
	pgtest.WaitFor(t, 30*time.Second, "River to report its queues", func() bool {
		got, err := outboxriver.ActiveQueues(ctx, s.Pool, 0)
		return err == nil && reflect.DeepEqual(got, []string{"outbox_mail", "outbox_webhook"})
	})
	if _, err := s.Pool.Exec(ctx, `UPDATE river_queue SET paused_at = now() WHERE name = 'outbox_webhook'`); err != nil {
		t.Fatal(err)
	}
	got, err := outboxriver.ActiveQueues(ctx, s.Pool, 0)
	if err != nil || !reflect.DeepEqual(got, []string{"outbox_mail"}) {
		t.Errorf("with outbox_webhook paused: %v, %v", got, err)
	}
}
