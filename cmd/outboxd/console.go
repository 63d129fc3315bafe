package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	neturl "net/url"
	"regexp"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"riverqueue.com/riverui"

	"github.com/outboxhq/outbox/console"
	"github.com/outboxhq/outbox/internal/config"
	"github.com/outboxhq/outbox/internal/dbconn"
	"github.com/outboxhq/outbox/route"
)

// Where the console and River UI are mounted on the HTTP listener.
const (
	consolePrefix = "/console"
	riverUIPrefix = "/riverui"
)

// startListener starts outboxd's HTTP listener on OUTBOX_HTTP_ADDR (on by
// default, on 127.0.0.1:9090): /metrics and the probes always; with a
// database (h.pool set), the console at /console/ (OUTBOX_CONSOLE_ENABLED)
// and River UI at /riverui/ (OUTBOX_RIVERUI_ENABLED), with / redirecting to
// the console. It returns a stop function that does nothing when the
// listener is off (OUTBOX_HTTP_ADDR=off) or when the default address is
// taken (a warning: another outboxd on this host has it); a taken address
// that was set explicitly is an error.
func startListener(ctx context.Context, cfg *config.Config, reg *prometheus.Registry, h health, routes *route.Table, logger *slog.Logger) (func(context.Context) error, error) {
	noop := func(context.Context) error { return nil }
	if cfg.HTTPAddr == "" {
		return noop, nil
	}
	ln, err := listenHTTP(cfg.HTTPAddr)
	if err != nil {
		if cfg.HTTPAddrDefaulted {
			logger.Warn("HTTP listener off: its default address is taken (another outboxd on this host?); set OUTBOX_HTTP_ADDR to a free address, or to off",
				slog.String("error", err.Error()))
			return noop, nil
		}
		return nil, err
	}
	mux := newHTTPHandler(reg, h)
	served := []string{"/metrics", "/healthz", "/readyz"}
	stopUI := func() {}
	if h.pool != nil && cfg.ConsoleEnabled {
		var more []string
		stopUI, more, err = mountUI(ctx, cfg, mux, routes, logger)
		if err != nil {
			_ = ln.Close()
			return nil, err
		}
		served = append(served, more...)
	}
	stop := serveHTTP(ln, mux, logger, "serving "+strings.Join(served, ", "))
	return func(ctx context.Context) error {
		err := stop(ctx)
		stopUI()
		return err
	}, nil
}

// mountUI mounts the console and, unless turned off, River UI on mux. They
// share a small pool of their own, so that a slow page never takes a
// connection from the dispatcher or the workers.
func mountUI(ctx context.Context, cfg *config.Config, mux *http.ServeMux, routes *route.Table, logger *slog.Logger) (stop func(), served []string, err error) {
	pool, err := dbconn.Open(ctx, consoleURL(cfg.DatabaseURL), dbconn.Options{MaxConns: 4, Wait: 30 * time.Second, Logger: logger})
	if err != nil {
		return nil, nil, fmt.Errorf("the console's database pool: %w", err)
	}
	uiCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	fail := func(err error) (func(), []string, error) {
		cancel()
		pool.Close()
		return nil, nil, err
	}
	ccfg := console.Config{
		Pool:         pool,
		Prefix:       consolePrefix,
		Routes:       routes,
		RoutesFile:   cfg.RoutesFile,
		Token:        cfg.ConsoleToken,
		ShowPayloads: cfg.ConsolePayloads,
		Logger:       logger,
	}
	if cfg.RiverUIEnabled {
		ccfg.RiverUIPrefix = riverUIPrefix
	}
	con, err := console.New(ccfg)
	if err != nil {
		return fail(err)
	}
	if err := con.Start(uiCtx); err != nil {
		return fail(err)
	}
	mux.Handle(consolePrefix+"/", con)
	mux.Handle("GET /{$}", http.RedirectHandler(consolePrefix+"/", http.StatusFound))
	served = []string{consolePrefix + "/"}

	if cfg.RiverUIEnabled {
		// River UI logs every request at info: keep its warnings only.
		quiet := slog.New(minLevel{logger.Handler(), slog.LevelWarn}).With(slog.String("component", "riverui"))
		// An insert-only client (no queues, never started): River UI reads
		// and changes jobs through it.
		client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Logger: quiet})
		if err != nil {
			con.Stop()
			return fail(fmt.Errorf("the client of River UI: %w", err))
		}
		rui, err := riverui.NewHandler(&riverui.HandlerOpts{
			Endpoints:                riverui.NewEndpoints(client, nil),
			Logger:                   quiet,
			Prefix:                   riverUIPrefix,
			JobListHideArgsByDefault: !cfg.ConsolePayloads,
		})
		if err == nil {
			err = rui.Start(uiCtx)
		}
		if err != nil {
			con.Stop()
			return fail(fmt.Errorf("the River UI handler: %w", err))
		}
		mux.Handle(riverUIPrefix+"/", con.GuardRiverUI(rui))
		served = append(served, riverUIPrefix+"/")
	}
	return func() {
		cancel()
		con.Stop()
		pool.Close()
	}, served, nil
}

// consoleURL is url with an application_name of its own: the URL's (or
// outboxd's) with "-console" appended, so that pg_stat_activity tells the
// pages' queries from the dispatcher's (and a tool that terminates the
// dispatcher's sessions by application_name leaves the console alone).
func consoleURL(url string) string {
	if !strings.HasPrefix(url, "postgres://") && !strings.HasPrefix(url, "postgresql://") {
		// keyword=value form: a later keyword overrides an earlier one.
		name := "outboxd"
		if m := appNameKV.FindStringSubmatch(url); m != nil {
			name = m[1]
		}
		return url + " application_name=" + name + "-console"
	}
	u, err := neturl.Parse(url)
	if err != nil {
		return url // dbconn.Open reports it
	}
	q := u.Query()
	name := q.Get("application_name")
	if name == "" {
		name = "outboxd"
	}
	q.Set("application_name", name+"-console")
	u.RawQuery = q.Encode()
	return u.String()
}

var appNameKV = regexp.MustCompile(`(?:^|\s)application_name=([^\s']+)`)

// minLevel is a slog.Handler that drops records below a level.
type minLevel struct {
	slog.Handler
	level slog.Level
}

func (m minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= m.level && m.Handler.Enabled(ctx, l)
}

func (m minLevel) WithAttrs(attrs []slog.Attr) slog.Handler {
	return minLevel{m.Handler.WithAttrs(attrs), m.level}
}

func (m minLevel) WithGroup(name string) slog.Handler {
	return minLevel{m.Handler.WithGroup(name), m.level}
}
