package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/internal/routesync"
	"github.com/outboxhq/outbox/route"
)

// warnRoutesDrift compares the routes file with the routes `outboxctl
// routes sync` last wrote into the database (strict routing at publish,
// docs/routes.md) and, when some were synced and they differ, logs a
// warning and raises an alert naming the prefixes: with strict routing on,
// producers are refused (or let through) by another set of routes than the
// one this dispatcher routes by. Nothing synced, or a schema before
// migration 008, is not a drift. It never stops outboxd; it reports
// whether it warned.
func warnRoutesDrift(ctx context.Context, q routesync.Querier, routes *route.Table, logger *slog.Logger, al alert.Alerter) bool {
	if routes == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st, err := routesync.Read(ctx, q)
	if errors.Is(err, routesync.ErrNotMigrated) {
		return false
	}
	if err != nil {
		logger.Warn("cannot compare the routes file with the synced routes", slog.String("error", err.Error()))
		return false
	}
	if len(st.Routes) == 0 {
		return false
	}
	d := routesync.Compare(routesync.FromTable(routes), st.Routes)
	if d.Empty() {
		return false
	}
	var parts []string
	for _, l := range []struct {
		name string
		list []string
	}{{"not synced", d.Added}, {"synced but not in the file", d.Removed}, {"other queues", d.Changed}} {
		if len(l.list) > 0 {
			parts = append(parts, fmt.Sprintf("%s: %s", l.name, strings.Join(l.list, " ")))
		}
	}
	strict := "off"
	if st.Strict {
		strict = "on"
	}
	msg := fmt.Sprintf("the routes file (OUTBOX_ROUTES_FILE) differs from the routes synced into the database (strict routing %s): %s; run `outboxctl routes sync --routes FILE` with this file", strict, strings.Join(parts, "; "))
	logger.Warn(msg, slog.Any("not_synced", d.Added), slog.Any("removed", d.Removed), slog.Any("changed", d.Changed), slog.Bool("strict", st.Strict))
	al.Alert(ctx, alert.Alert{Reason: alert.RoutesOutOfSync, Message: msg})
	return true
}
