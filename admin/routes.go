package admin

import (
	"context"
	"fmt"

	"github.com/outboxhq/outbox/internal/routesync"
	"github.com/outboxhq/outbox/route"
)

// RoutesSyncOpts configures RoutesSync.
type RoutesSyncOpts struct {
	// Routes is the routing table to write into the database (outbox_route).
	Routes *route.Table
	// Source names where the routes came from (the routes file), recorded
	// with them.
	Source string
	// Strict sets strict routing at publish: true refuses event types no
	// synced route matches, false accepts them, nil keeps the current mode.
	Strict *bool
	// Actor is who runs the sync, recorded in the audit.
	Actor string
	// DryRun reports what would change and changes and records nothing.
	DryRun bool
}

// RoutesSyncResult is what RoutesSync did (or would do).
type RoutesSyncResult struct {
	DryRun       bool     `json:"dry_run"`
	RoutesFile   string   `json:"routes_file"`
	Routes       int      `json:"routes"`
	Added        []string `json:"added"`
	Removed      []string `json:"removed"`
	Changed      []string `json:"changed"`
	Unchanged    int      `json:"unchanged"`
	StrictBefore bool     `json:"strict_before"`
	StrictAfter  bool     `json:"strict_after"`
	// AuditID is the audit row of the sync; nil for a dry run.
	AuditID *int64 `json:"audit_id"`
	Actor   string `json:"actor"`
}

// routesSyncSQL calls outbox_routes_sync (migration 008), which replaces the
// synced routes, sets the mode ($4 NULL keeps it) and writes the audit row
// in one transaction, or, for a dry run, reports the change and records
// nothing.
const routesSyncSQL = `
SELECT added, removed, changed, unchanged, strict_before, strict_after, audit_id
FROM outbox_routes_sync(actor => $1, dry_run => $2, routes => $3::jsonb, strict => $4, source => $5)`

// RoutesSync writes a routing table's prefixes into the database for strict
// routing at publish (docs/routes.md), audited like requeue and cancel.
func (c *Client) RoutesSync(ctx context.Context, opts RoutesSyncOpts) (*RoutesSyncResult, error) {
	if err := checkActor(opts.Actor); err != nil {
		return nil, err
	}
	if opts.Routes == nil {
		return nil, &SelectionError{Flag: "routes", Msg: "a routing table is required"}
	}
	routes := routesync.FromTable(opts.Routes)
	doc, err := routesync.JSON(routes)
	if err != nil {
		return nil, err
	}
	res := &RoutesSyncResult{DryRun: opts.DryRun, RoutesFile: opts.Source, Routes: len(routes), Actor: opts.Actor}
	err = c.pool.QueryRow(ctx, routesSyncSQL, opts.Actor, opts.DryRun, string(doc), opts.Strict, opts.Source).
		Scan(&res.Added, &res.Removed, &res.Changed, &res.Unchanged, &res.StrictBefore, &res.StrictAfter, &res.AuditID)
	if err != nil {
		return nil, fmt.Errorf("sync routes: %w", c.explain(ctx, err))
	}
	return res, nil
}
