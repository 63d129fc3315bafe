package main

// outboxctl routes sync: write the routes file's prefixes into the database
// for strict routing at publish (migration 008, docs/routes.md). Kept apart
// from ops.go on purpose: it needs only the cli basics of main.go.

import (
	"context"
	"fmt"
	"os"
	"os/user"
	"strings"

	"github.com/outboxhq/outbox/internal/routesync"
	"github.com/outboxhq/outbox/route"
)

// routesSyncSQL calls outbox_routes_sync, which replaces the synced routes,
// sets the mode ($4 NULL keeps it) and writes the audit row in one
// transaction, or, for a dry run, reports the change and records nothing.
const routesSyncSQL = `
SELECT added, removed, changed, unchanged, strict_before, strict_after, audit_id
FROM outbox_routes_sync(actor => $1, dry_run => $2, routes => $3::jsonb, strict => $4, source => $5)`

// routesSyncResult is the output of routes sync (--json prints it).
type routesSyncResult struct {
	DryRun       bool     `json:"dry_run"`
	RoutesFile   string   `json:"routes_file"`
	Routes       int      `json:"routes"`
	Added        []string `json:"added"`
	Removed      []string `json:"removed"`
	Changed      []string `json:"changed"`
	Unchanged    int      `json:"unchanged"`
	StrictBefore bool     `json:"strict_before"`
	StrictAfter  bool     `json:"strict_after"`
	AuditID      *int64   `json:"audit_id"`
	Actor        string   `json:"actor"`
}

func runRoutes(ctx context.Context, c *cli, args []string) error {
	const use = "usage: outboxctl routes sync --routes FILE [--strict on|off] [--dry-run] [--actor A] [--json]"
	if len(args) == 0 || args[0] != "sync" {
		return usagef("%s", use)
	}
	fs := c.flags("routes sync")
	fs.Func("database-url", "Postgres connection string (default $DATABASE_URL)", func(v string) error {
		c.dbURL = v
		return nil
	})
	file := fs.String("routes", os.Getenv("OUTBOX_ROUTES_FILE"), "the routes file to sync (default $OUTBOX_ROUTES_FILE)")
	strictFlag := fs.String("strict", "", "on: publishing refuses event types no synced route matches; off: it accepts them (default: keep the current mode)")
	dryRun := fs.Bool("dry-run", false, "report what would change, change and record nothing")
	actor := fs.String("actor", syncActor(), "who runs this, recorded in the audit (default: the OS user)")
	if err := parse(fs, args[1:]); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	if *file == "" {
		return usagef("--routes is required (or set OUTBOX_ROUTES_FILE): the routes file whose prefixes to sync")
	}
	var strict *bool
	switch strings.ToLower(*strictFlag) {
	case "":
	case "on", "true":
		v := true
		strict = &v
	case "off", "false":
		v := false
		strict = &v
	default:
		return usagef("--strict must be on or off, got %q", *strictFlag)
	}
	if *actor == "" || len(*actor) > 256 || strings.ContainsRune(*actor, 0) {
		return usagef("--actor must be 1 to 256 bytes without NUL characters")
	}
	table, err := route.Load(*file)
	if err != nil {
		return usagef("--routes: %v", err)
	}
	routes := routesync.FromTable(table)
	doc, err := routesync.JSON(routes)
	if err != nil {
		return err
	}

	pool, err := c.db(ctx)
	if err != nil {
		return err
	}
	res := routesSyncResult{DryRun: *dryRun, RoutesFile: *file, Routes: len(routes), Actor: *actor}
	err = pool.QueryRow(ctx, routesSyncSQL, *actor, *dryRun, string(doc), strict, *file).
		Scan(&res.Added, &res.Removed, &res.Changed, &res.Unchanged, &res.StrictBefore, &res.StrictAfter, &res.AuditID)
	if err != nil {
		return fmt.Errorf("sync routes: %w", err)
	}
	if c.jsonOut {
		return c.printJSON(res)
	}
	verb := "synced"
	if res.DryRun {
		verb = "would sync (dry run, nothing changed)"
	}
	fmt.Fprintf(c.stdout, "%s %d routes from %q: %d added, %d removed, %d changed, %d unchanged\n",
		verb, res.Routes, res.RoutesFile, len(res.Added), len(res.Removed), len(res.Changed), res.Unchanged)
	for _, l := range []struct {
		name string
		list []string
	}{{"added", res.Added}, {"removed", res.Removed}, {"changed", res.Changed}} {
		if len(l.list) > 0 {
			fmt.Fprintf(c.stdout, "  %s: %s\n", l.name, strings.Join(l.list, " "))
		}
	}
	mode := map[bool]string{true: "on", false: "off"}
	if res.StrictBefore != res.StrictAfter {
		fmt.Fprintf(c.stdout, "strict routing: %s -> %s\n", mode[res.StrictBefore], mode[res.StrictAfter])
	} else {
		fmt.Fprintf(c.stdout, "strict routing: %s\n", mode[res.StrictAfter])
	}
	if res.AuditID != nil {
		fmt.Fprintf(c.stdout, "audit id %d\n", *res.AuditID)
	}
	return nil
}

// syncActor is the OS user running outboxctl.
func syncActor() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	if v := os.Getenv("USER"); v != "" {
		return v
	}
	return "unknown"
}
