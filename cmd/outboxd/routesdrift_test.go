package main

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

// TestRoutesDriftWarning: outboxd (as outbox_dispatcher) warns at start-up,
// in the log and with an alert naming the prefixes, when routes were
// synced and differ from its routes file; not when nothing was synced or
// they agree.
func TestRoutesDriftWarning(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["role"] = "outbox_dispatcher"
	cfg.MaxConns = 2
	d, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)

	table, err := route.Parse([]byte("routes:\n  - prefix: \"mail.\"\n    queue: outbox_mail\n  - prefix: \"billing.\"\n    queue: outbox_billing\n"))
	if err != nil {
		t.Fatal(err)
	}
	check := func() (bool, string, []alert.Alert) {
		var (
			buf    bytes.Buffer
			mu     sync.Mutex
			alerts []alert.Alert
		)
		logger := slog.New(slog.NewTextHandler(&buf, nil))
		warned := warnRoutesDrift(ctx, d, table, logger, alert.Func(func(_ context.Context, a alert.Alert) {
			mu.Lock()
			defer mu.Unlock()
			alerts = append(alerts, a)
		}))
		return warned, buf.String(), alerts
	}
	syncRoutes := func(routes string) {
		if _, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_routes_sync('test', false, $1::jsonb, true)`, routes); err != nil {
			t.Fatal(err)
		}
	}

	if warned, log, alerts := check(); warned || log != "" || len(alerts) != 0 {
		t.Fatalf("nothing synced: warned %v %q %v", warned, log, alerts)
	}
	syncRoutes(`[{"prefix": "billing.", "queues": ["outbox_billing"]}, {"prefix": "mail.", "queues": ["outbox_mail"]}]`)
	if warned, log, alerts := check(); warned || log != "" || len(alerts) != 0 {
		t.Fatalf("in sync: warned %v %q %v", warned, log, alerts)
	}
	syncRoutes(`[{"prefix": "mail.", "queues": ["outbox_other"]}, {"prefix": "audit.", "queues": ["outbox_audit"]}]`)
	warned, log, alerts := check()
	if !warned || len(alerts) != 1 || alerts[0].Reason != alert.RoutesOutOfSync || !strings.Contains(log, "level=WARN") {
		t.Fatalf("drift: warned %v %q %v", warned, log, alerts)
	}
	for _, want := range []string{"not synced: billing.", "synced but not in the file: audit.", "other queues: mail.", "strict routing on", "outboxctl routes sync"} {
		if !strings.Contains(alerts[0].Message, want) {
			t.Errorf("alert %q does not say %q", alerts[0].Message, want)
		}
	}
}
