package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/dbconn"
)

// health is what /readyz checks. pool is nil when outboxd runs without a
// database (dispatcher disabled); d is nil until the dispatcher started.
type health struct {
	pool  *pgxpool.Pool
	d     *dispatcher.Dispatcher
	dbURL string // only to redact passwords from the logged errors
	// logger gets the details /readyz keeps to itself; nil means
	// slog.Default().
	logger *slog.Logger
}

// newHTTPHandler serves
//
//	/metrics  Prometheus metrics of reg
//	/healthz  200 while the process runs (liveness)
//	/readyz   200 when the database answers a ping within 2 s and, when the
//	          dispatcher is enabled, its loop runs; 503 with the reason
//	          otherwise (readiness)
//
// The endpoints are unauthenticated: they say what is up or down, never a
// user, host, database or error text (the log has those). The console and
// River UI are mounted on the same mux (console.go).
func newHTTPHandler(reg *prometheus.Registry, h health) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg, ErrorHandling: promhttp.ContinueOnError}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if err := h.ready(r.Context()); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintln(w, "not ready:", err)
			return
		}
		_, _ = fmt.Fprintln(w, "ready")
	})
	return mux
}

func (h health) ready(ctx context.Context) error {
	if h.pool != nil {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if err := h.pool.Ping(pctx); err != nil {
			logger := h.logger
			if logger == nil {
				logger = slog.Default()
			}
			logger.Warn("/readyz: database unreachable", slog.String("error", dbconn.Redact(err.Error(), h.dbURL)))
			return errors.New("database unreachable")
		}
	}
	if h.d != nil && !h.d.Running() {
		return errors.New("dispatcher not running")
	}
	return nil
}

// listenHTTP listens on addr, so that a taken port fails start-up.
func listenHTTP(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("OUTBOX_HTTP_ADDR=%s: %w", addr, err)
	}
	return ln, nil
}

// serveHTTP serves h on ln in the background and logs msg with the
// address. The returned function shuts the server down.
func serveHTTP(ln net.Listener, h http.Handler, logger *slog.Logger, msg string) func(context.Context) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	go func() {
		defer close(served)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("HTTP listener failed", slog.String("error", err.Error()))
		}
	}()
	logger.Info(msg, slog.String("addr", ln.Addr().String()))
	// The stop function drains open requests (until ctx ends) and waits
	// for the serving goroutine.
	return func(ctx context.Context) error {
		err := srv.Shutdown(ctx)
		<-served
		return err
	}
}
