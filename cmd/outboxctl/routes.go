package main

// outboxctl routes sync: write the routes file's prefixes into the database
// for strict routing at publish (admin.RoutesSync, docs/routes.md).

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/route"
)

func runRoutes(ctx context.Context, c *cli, args []string) error {
	const use = "usage: outboxctl routes sync --routes FILE [--strict on|off] [--dry-run] [--actor A] [--json]"
	if len(args) == 0 || args[0] != "sync" {
		return usagef("%s", use)
	}
	fs := c.opsFlags("routes sync")
	file := fs.String("routes", os.Getenv("OUTBOX_ROUTES_FILE"), "the routes file to sync (default $OUTBOX_ROUTES_FILE)")
	strictFlag := fs.String("strict", "", "on: publishing refuses event types no synced route matches; off: it accepts them (default: keep the current mode)")
	dryRun := fs.Bool("dry-run", false, "report what would change, change and record nothing")
	actor := fs.String("actor", defaultActor(), "who runs this, recorded in the audit (default: the OS user)")
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
	table, err := route.Load(*file)
	if err != nil {
		return usagef("--routes: %v", err)
	}
	cl, err := c.admin(ctx)
	if err != nil {
		return err
	}
	res, err := cl.RoutesSync(ctx, admin.RoutesSyncOpts{Routes: table, Source: *file, Strict: strict, Actor: *actor, DryRun: *dryRun})
	if err != nil {
		return err
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
