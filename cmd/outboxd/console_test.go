package main

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxhq/outbox/internal/config"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/internal/proctest"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// TestListenerServesConsoleAndRiverUI: one address serves the probes, the
// console (/ redirects to it) and River UI (v0.22 on this River), whose API
// answers; River UI stays closed to a reader while payloads are hidden.
func TestListenerServesConsoleAndRiverUI(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	logger := slog.New(slog.NewTextHandler(&proctest.SyncBuffer{}, nil))
	start := func(payloads bool) string {
		addr := freeAddr(t)
		cfg := &config.Config{HTTPAddr: addr, DatabaseURL: s.URL, ConsoleEnabled: true, RiverUIEnabled: true, ConsolePayloads: payloads}
		stop, err := startListener(ctx, cfg, prometheus.NewRegistry(), health{pool: s.Pool}, nil, logger)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = stop(context.Background()) })
		return "http://" + addr
	}
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	status := func(url string) (int, string) {
		res, err := noRedirect.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res.StatusCode, res.Header.Get("Location")
	}

	base := start(false)
	if code, loc := status(base + "/"); code != http.StatusFound || loc != "/console/" {
		t.Errorf("/: %d %q", code, loc)
	}
	if code, body := get(t, base+"/console/"); code != 200 || !strings.Contains(body, `href="/riverui/"`) {
		t.Errorf("/console/: %d\n%s", code, body)
	}
	if code, _ := get(t, base+"/readyz"); code != 200 {
		t.Errorf("/readyz: %d", code)
	}
	if code, loc := status(base + "/riverui/jobs/1"); code != http.StatusSeeOther || !strings.HasPrefix(loc, "/console/login?") {
		t.Errorf("River UI with payloads hidden: %d %q", code, loc)
	}

	base = start(true)
	if code, body := get(t, base+"/riverui/"); code != 200 || !strings.Contains(body, "<div id=\"root\"") && !strings.Contains(body, "River") {
		t.Errorf("River UI: %d\n%.300s", code, body)
	}
	if code, body := get(t, base+"/riverui/api/jobs?state=available"); code != 200 || !strings.Contains(body, `"data"`) {
		t.Errorf("River UI's API: %d\n%.300s", code, body)
	}
	if code, body := get(t, base+"/riverui/api/queues"); code != 200 {
		t.Errorf("River UI's queues: %d\n%.300s", code, body)
	}
}

// TestTakenDefaultAddressIsAWarning: when OUTBOX_HTTP_ADDR is unset and its
// default address is taken, outboxd runs without the listener and says so;
// an address set explicitly and taken is an error.
func TestTakenDefaultAddressIsAWarning(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	out := &proctest.SyncBuffer{}
	logger := slog.New(slog.NewTextHandler(out, nil))
	cfg := &config.Config{HTTPAddr: ln.Addr().String(), HTTPAddrDefaulted: true}
	stop, err := startListener(context.Background(), cfg, prometheus.NewRegistry(), health{}, nil, logger)
	if err != nil || stop == nil || !strings.Contains(out.String(), "HTTP listener off: its default address is taken") {
		t.Fatalf("default taken: %v\n%s", err, out.String())
	}
	cfg.HTTPAddrDefaulted = false
	if _, err := startListener(context.Background(), cfg, prometheus.NewRegistry(), health{}, nil, logger); err == nil || !strings.Contains(err.Error(), "OUTBOX_HTTP_ADDR=") {
		t.Fatalf("explicit taken: %v", err)
	}
}

// TestConsoleURLNamesItsSessions: the console's pool gets an
// application_name of its own, in both forms of a connection string.
func TestConsoleURLNamesItsSessions(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"postgres://u@h/db": "postgres://u@h/db?application_name=outboxd-console",
		"postgres://u@h/db?search_path=s&application_name=x": "postgres://u@h/db?application_name=x-console&search_path=s",
		"host=h user=u":             "host=h user=u application_name=outboxd-console",
		"host=h application_name=x": "host=h application_name=x application_name=x-console",
	} {
		if got := consoleURL(in); got != want {
			t.Errorf("consoleURL(%q) = %q, want %q", in, got, want)
		}
	}
}
