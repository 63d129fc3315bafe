package main_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

const groupRoutes = `routes:
  - prefix: "mail."
    queue: outbox_mail
  - prefix: "webhook."
    queue: outbox_webhook
  - prefix: "workflow."
    queue: outbox_workflow
  - prefix: "audit."
    queue: outbox_audit
  - prefix: "plugin.hook."
    queue: outbox_plugin-hook
`

// TestTwoGroupsWorkOnlyTheirQueues runs a "general" outboxd (dispatcher and
// workers) and a "mail" outboxd (workers only) on one database, and checks
// from River's attempted_by that every job ran in the group of its queue.
func TestTwoGroupsWorkOnlyTheirQueues(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	routes := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(routes, []byte(groupRoutes), 0o600); err != nil {
		t.Fatal(err)
	}
	groups := "OUTBOX_WORKER_GROUPS=general=outbox_workflow,outbox_audit:2,outbox_nowhere; mail=outbox_mail:5,outbox_webhook:cooldown=2ms:poll=50ms"
	common := []string{"DATABASE_URL=" + s.URL, "OUTBOX_ROUTES_FILE=" + routes, "OUTBOX_WORKER_HANDLER=log", groups, "OUTBOX_LOG_FORMAT=json"}

	general, genOut := daemon(t, append(common, "OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_WORKER_GROUP=general")...)
	mail, mailOut := daemon(t, append(common, "OUTBOX_WORKER_GROUP=mail")...)
	waitLog(t, genOut, `"msg":"River workers started"`)
	waitLog(t, mailOut, `"msg":"River workers started"`)
	// Start-up warnings: a worked queue no route targets, and a routed
	// queue no group works.
	waitLog(t, genOut, `"queue":"outbox_nowhere"`)
	waitLog(t, genOut, `no group of OUTBOX_WORKER_GROUPS works`)
	if !strings.Contains(genOut.String(), `"queues":"outbox_plugin-hook"`) {
		t.Errorf("the unworked-queue warning does not name outbox_plugin-hook:\n%s", genOut.String())
	}
	if strings.Contains(mailOut.String(), `"queue":"outbox_mail"`) && strings.Contains(mailOut.String(), "no route targets") {
		t.Errorf("mail group warned about a routed queue:\n%s", mailOut.String())
	}

	ctx := context.Background()
	types := []string{"mail.receipt.requested", "webhook.invoice.paid", "workflow.invoice.overdue", "audit.login.failed"}
	for range 5 {
		for _, typ := range types {
			if _, err := s.Pool.Exec(ctx, `SELECT outbox_publish($1, '{}')`, typ); err != nil {
				t.Fatal(err)
			}
		}
	}
	pgtest.WaitFor(t, 60*time.Second, "the 20 jobs to complete", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == 20
	})
	rows, err := s.Pool.Query(ctx, `SELECT queue, attempted_by[1] FROM river_job ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	wantGroup := map[string]string{"outbox_mail": "mail_", "outbox_webhook": "mail_", "outbox_workflow": "general_", "outbox_audit": "general_"}
	for rows.Next() {
		var queue, by string
		if err := rows.Scan(&queue, &by); err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(by, wantGroup[queue]) {
			t.Errorf("a job of %s ran on client %s, want the %s group", queue, by, strings.TrimSuffix(wantGroup[queue], "_"))
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	// The built-in log handler logged every event it completed.
	if n := strings.Count(mailOut.String(), "event received by the built-in log handler"); n != 10 {
		t.Errorf("mail group logged %d events, want 10", n)
	}

	for _, p := range []struct {
		name string
		cmd  interface{ Signal(os.Signal) error }
	}{{"general", general.Process}, {"mail", mail.Process}} {
		if err := p.cmd.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
	}
	if code := waitExit(t, general, 30*time.Second); code != 0 {
		t.Errorf("general exited %d", code)
	}
	if code := waitExit(t, mail, 30*time.Second); code != 0 {
		t.Errorf("mail exited %d", code)
	}
}

func TestWorkerConfigErrorsStopAtStartup(t *testing.T) {
	t.Parallel()
	cases := map[string][]string{
		"OUTBOX_WORKER_HANDLER is not set":                      {"OUTBOX_WORKER_QUEUES=outbox_mail"},
		`OUTBOX_WORKER_QUEUES: "outbox.mail"`:                   {"OUTBOX_WORKER_QUEUES=outbox.mail", "OUTBOX_WORKER_HANDLER=log"},
		`OUTBOX_WORKER_GROUP="mail" is not a group`:             {"OUTBOX_WORKER_GROUPS=general=outbox_workflow", "OUTBOX_WORKER_GROUP=mail", "OUTBOX_WORKER_HANDLER=log"},
		`OUTBOX_WORKER_GROUP="mail" needs OUTBOX_WORKER_GROUPS`: {"OUTBOX_WORKER_GROUP=mail"},
		`OUTBOX_WORKER_HANDLER="mailer" is not a built-in`:      {"OUTBOX_WORKER_QUEUES=outbox_mail", "OUTBOX_WORKER_HANDLER=mailer"},
		"not both": {"OUTBOX_WORKER_QUEUES=outbox_mail", "OUTBOX_WORKER_GROUP=mail", "OUTBOX_WORKER_GROUPS=mail=outbox_mail", "OUTBOX_WORKER_HANDLER=log"},
	}
	for want, env := range cases {
		cmd, out := daemon(t, append(env, "DATABASE_URL="+pgtest.URL())...)
		if code := waitExit(t, cmd, 30*time.Second); code != 2 {
			t.Errorf("%v: exit %d, want 2", env, code)
		}
		if !strings.Contains(out.String(), want) {
			t.Errorf("%v: output %q lacks %q", env, out.String(), want)
		}
	}
}
