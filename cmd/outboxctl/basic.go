package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"

	"github.com/outboxhq/outbox"
	outboxsql "github.com/outboxhq/outbox/sql"
)

func runMigrate(ctx context.Context, c *cli, args []string) error {
	fs := c.flags("migrate")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	pool, err := c.db(ctx)
	if err != nil {
		return err
	}
	var logger *slog.Logger
	if !c.jsonOut {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	res, err := outboxsql.Migrate(ctx, pool, logger)
	if err != nil {
		return err
	}
	if c.jsonOut {
		return c.printJSON(res)
	}
	fmt.Fprintf(c.stdout, "schema %s: outbox at version %d (applied %v), River migrations applied %v\n",
		clean(res.Schema), res.OutboxVersion, res.OutboxApplied, res.RiverApplied)
	return nil
}

func runPublish(ctx context.Context, c *cli, args []string) error {
	fs := c.flags("publish")
	typ := fs.String("type", "", "event type, <domain>.<entity>.<verb> (required)")
	payload := fs.String("payload", "{}", "JSON payload")
	tenant := fs.String("tenant", "", "tenant id")
	key := fs.String("key", "", "dispatch key (idempotency key of the producer)")
	orderingKey := fs.String("ordering-key", "", "ordering key: the events of one (tenant, ordering key) are worked one at a time, in order")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	if *typ == "" {
		return usagef("--type is required")
	}
	ev := outbox.Event{Type: *typ, Payload: json.RawMessage(*payload), TenantID: *tenant, DispatchKey: *key, OrderingKey: *orderingKey}
	// Validate before connecting, so bad input is a usage error.
	if _, err := outbox.ValidateEvent(ev); err != nil {
		return &usageError{err.Error()}
	}
	cl, err := c.admin(ctx)
	if err != nil {
		return err
	}
	res, err := cl.Publish(ctx, ev)
	if err != nil {
		return err
	}
	if c.jsonOut {
		return c.printJSON(map[string]any{"id": res.ID, "duplicate": res.Duplicate})
	}
	if res.Duplicate {
		fmt.Fprintf(c.stdout, "event %d already holds dispatch key %q; nothing written\n", res.ID, *key)
		return nil
	}
	fmt.Fprintf(c.stdout, "published event %d (%s)\n", res.ID, *typ)
	return nil
}
