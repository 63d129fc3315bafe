package main_test

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

// TestDaemonAlertsParkedKey: outboxd with the dispatcher runs the watch: a
// key parked before it starts is alerted (logged with reason parked_key,
// its key and queue) and it still stops cleanly.
func TestDaemonAlertsParkedKey(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	routesFile, _ := filepath.Abs("../../docs/examples/routes.yaml")
	routes, err := route.Load(routesFile)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "billing.invoice.paid", TenantID: "acme", OrderingKey: "invoice-9"},
		outbox.Event{Type: "billing.invoice.paid", TenantID: "acme", OrderingKey: "invoice-9"})
	if res := ordertest.HandOff(t, s.Pool, routes); res.Jobs != 2 {
		t.Fatalf("handoff %+v; want 2 jobs", res)
	}
	ordertest.FinalizeHead(t, s.Pool, "acme", "invoice-9", "discarded")
	cmd, out := daemon(t, "OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_ROUTES_FILE="+routesFile, "DATABASE_URL="+s.URL, "OUTBOX_HTTP_ADDR=off")
	waitLog(t, out, "reason=parked_key")
	for _, want := range []string{"ordering_key=invoice-9", "queue=outbox_notification", "tenant_id=acme"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the parked_key log lacks %q:\n%s", want, out.String())
		}
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 30*time.Second); code != 0 {
		t.Fatalf("exit %d:\n%s", code, out.String())
	}
}
