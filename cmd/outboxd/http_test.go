package main

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/metrics"
	"github.com/outboxhq/outbox/route"
)

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// metricLines returns the scrape's sample lines by name{labels}.
func metricLines(body string) map[string]string {
	out := map[string]string{}
	for line := range strings.SplitSeq(body, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		out[line[:i]] = line[i+1:]
	}
	return out
}

func TestMetricsMoveDuringDispatch(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)
	routes, err := route.New([]route.Rule{
		{Prefix: "mail.", Queues: []string{"outbox_mail"}},
		{Prefix: "plugin.hook.", Queues: []string{"outbox_plugin-hook", "outbox_audit"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m := metrics.New(metrics.Config{Pool: s.Pool, Routes: routes})
	if err := m.Register(reg); err != nil {
		t.Fatal(err)
	}
	var alerts atomic.Int64
	d, err := dispatcher.New(s.Pool, dispatcher.Config{
		Routes: routes, PollInterval: 100 * time.Millisecond, OnBatch: m.OnBatch,
		Alerter: m.Alerter(alert.Func(func(context.Context, alert.Alert) { alerts.Add(1) })),
	})
	if err != nil {
		t.Fatal(err)
	}
	m.SetDispatcher(d)
	srv := httptest.NewServer(newHTTPHandler(reg, health{pool: s.Pool, d: d}))
	t.Cleanup(srv.Close)

	// Before the dispatcher runs: pending events show, nothing dispatched.
	evs := []outbox.Event{{Type: "plugin.hook.workflow.executed"}, {Type: "billing.invoice.paid"}}
	for range 5 {
		evs = append(evs, outbox.Event{Type: "mail.user.welcome"})
	}
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := outbox.PublishMany(ctx, tx, evs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	_, body := get(t, srv.URL+"/metrics")
	before := metricLines(body)
	if before["outbox_pending_events"] != "7" || before["outbox_database_up"] != "1" || before["outbox_dispatcher_running"] != "0" {
		t.Fatalf("before dispatch: pending %q, db up %q, running %q\n%s", before["outbox_pending_events"], before["outbox_database_up"], before["outbox_dispatcher_running"], body)
	}
	if code, _ := get(t, srv.URL+"/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz before the dispatcher runs = %d, want 503", code)
	}

	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = d.Stop(context.Background())
		}
	})
	want := map[string]string{
		`outbox_events_dispatched_total{route="mail."}`:                "5",
		`outbox_events_dispatched_total{route="plugin.hook."}`:         "1",
		`outbox_events_failed_total{reason="unroutable",route="none"}`: "1",
		`outbox_jobs_inserted_total`:                                   "7",
		`outbox_handoff_latency_seconds_count`:                         "6",
		`outbox_pending_events`:                                        "0",
		`outbox_failed_events`:                                         "1",
		`outbox_dispatcher_running`:                                    "1",
		`outbox_listener_connected`:                                    "1",
	}
	var last map[string]string
	pgtest.WaitFor(t, 30*time.Second, "the counters to move", func() bool {
		_, body := get(t, srv.URL+"/metrics")
		last = metricLines(body)
		for k, v := range want {
			if last[k] != v {
				return false
			}
		}
		return true
	})
	if n, _ := strconv.Atoi(last["outbox_batches_total"]); n < 1 || last["outbox_batch_size_count"] != last["outbox_batches_total"] {
		t.Fatalf("batches %q, batch size count %q", last["outbox_batches_total"], last["outbox_batch_size_count"])
	}
	if alerts.Load() != 1 {
		t.Fatalf("the metrics alerter forwarded %d alerts, want 1", alerts.Load())
	}
	if code, body := get(t, srv.URL+"/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz = %d %q", code, body)
	}
	if code, body := get(t, srv.URL+"/healthz"); code != http.StatusOK || strings.TrimSpace(body) != "ok" {
		t.Fatalf("/healthz = %d %q", code, body)
	}

	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	stopped = true
	if code, body := get(t, srv.URL+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "dispatcher not running") {
		t.Fatalf("/readyz after stop = %d %q", code, body)
	}
}

// tcpProxy forwards to the database until Close, which makes it unreachable.
type tcpProxy struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func startProxy(t *testing.T, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{ln: ln}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, up)
			p.mu.Unlock()
			go func() { _, _ = io.Copy(up, c); up.Close() }()
			go func() { _, _ = io.Copy(c, up); c.Close() }()
		}
	}()
	t.Cleanup(p.Close)
	return p
}

func (p *tcpProxy) Close() {
	p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

func TestReadyzTurnsUnreadyWhenDatabaseUnreachable(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	target := net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))
	p := startProxy(t, target)
	host, port, _ := net.SplitHostPort(p.ln.Addr().String())
	cfg.ConnConfig.Host = host
	pn, _ := strconv.Atoi(port)
	cfg.ConnConfig.Port = uint16(pn)
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	reg := prometheus.NewRegistry()
	m := metrics.New(metrics.Config{Pool: pool})
	if err := m.Register(reg); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(newHTTPHandler(reg, health{pool: pool, logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)

	if code, body := get(t, srv.URL+"/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz through the proxy = %d %q", code, body)
	}
	p.Close()
	var unready string
	pgtest.WaitFor(t, 30*time.Second, "/readyz to turn unready", func() bool {
		code, body := get(t, srv.URL+"/readyz")
		unready = body
		return code == http.StatusServiceUnavailable && strings.Contains(body, "database unreachable")
	})
	// An unauthenticated endpoint names no user, host, port or database.
	for _, secret := range []string{cfg.ConnConfig.User, host, port, cfg.ConnConfig.Database, s.Name, "user=", "database="} {
		if strings.Contains(unready, secret) {
			t.Errorf("/readyz shows %q: %q", secret, unready)
		}
	}
	if code, _ := get(t, srv.URL+"/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz must stay 200 (the process is alive), got %d", code)
	}
	_, body := get(t, srv.URL+"/metrics")
	if metricLines(body)["outbox_database_up"] != "0" {
		t.Fatalf("outbox_database_up should be 0 with the database unreachable:\n%s", body)
	}
}

type fakeListener struct {
	running, connected atomic.Bool
	checks             atomic.Int64
}

func (f *fakeListener) Running() bool           { f.checks.Add(1); return f.running.Load() }
func (f *fakeListener) ListenerConnected() bool { return f.connected.Load() }

func TestWatchListenerAlertsOncePerOutage(t *testing.T) {
	t.Parallel()
	ctx := pgtest.Context(t, time.Minute)
	f := &fakeListener{}
	f.running.Store(true)
	f.connected.Store(true)
	got := make(chan alert.Alert, 10)
	go watchListener(ctx, f, alert.Func(func(_ context.Context, a alert.Alert) { got <- a }), 50*time.Millisecond, 5*time.Millisecond)

	waitTicks := func(n int64) {
		start := f.checks.Load()
		pgtest.WaitFor(t, 30*time.Second, "the watcher to tick", func() bool { return f.checks.Load() >= start+n })
	}
	waitTicks(5)
	if len(got) != 0 {
		t.Fatal("alert while connected")
	}
	f.connected.Store(false)
	select {
	case a := <-got:
		if a.Reason != alert.ListenerDisconnected || !strings.Contains(a.Message, "OUTBOX_LISTEN_ENABLED=false") {
			t.Fatalf("alert %+v", a)
		}
	case <-ctx.Done():
		t.Fatal("no alert for a listener down past the threshold")
	}
	waitTicks(30)
	if len(got) != 0 {
		t.Fatal("a second alert for the same outage")
	}
	f.connected.Store(true)
	waitTicks(3)
	f.connected.Store(false)
	select {
	case <-got:
	case <-ctx.Done():
		t.Fatal("no alert for the second outage")
	}
}
