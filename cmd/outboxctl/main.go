// Command outboxctl is the operator's CLI for the outbox.
//
//	outboxctl migrate              apply the outbox's and River's migrations
//	outboxctl publish --type T     publish one event
//	outboxctl requeue [filters]    put failed/cancelled events back to pending
//	outboxctl cancel [filters]     move pending/failed events to cancelled
//	outboxctl stats [--check]      counts, lag, River queues, alerts
//	outboxctl explain <event-id>   what happened to one event: row, routes, River jobs, receipts, its key's order
//	outboxctl keys                 list the ordering keys that wait for an operator (parked, held)
//	outboxctl unpark --key K       let a parked ordering key go on: --retry or --skip its head job
//	outboxctl retention run        purge old done events now
//	outboxctl audit                list the operator actions recorded
//	outboxctl routes sync          write the routes file into the database (strict routing)
//
// Every command reads DATABASE_URL (the operator commands also take
// --database-url) and takes --json. Exit status, the same as outboxd's:
// 0 success, 1 failure (the database, a schema not migrated yet, stats
// --check: an alert threshold is crossed), 2 bad usage or configuration (a
// flag, an environment variable, a routes file, a missing or unparsable
// DATABASE_URL) or a selection refused by a guardrail. See
// docs/operations.md.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/dbconn"
	"github.com/outboxhq/outbox/internal/schemacheck"
)

// command is one subcommand.
type command struct {
	summary string
	run     func(ctx context.Context, c *cli, args []string) error
}

var commands = map[string]command{}

func register(name, summary string, run func(ctx context.Context, c *cli, args []string) error) {
	commands[name] = command{summary: summary, run: run}
}

// usageError makes the process exit 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, a ...any) error { return &usageError{fmt.Sprintf(format, a...)} }

// cli carries what every command needs.
type cli struct {
	stdout, stderr io.Writer
	jsonOut        bool
	dbURL          string
	pool           *pgxpool.Pool
}

// db opens the pool on first use.
func (c *cli) db(ctx context.Context) (*pgxpool.Pool, error) {
	if c.pool != nil {
		return c.pool, nil
	}
	// A missing or unparsable connection string is bad configuration
	// (exit 2), not a database failure.
	if c.dbURL == "" {
		return nil, usagef("DATABASE_URL is not set: give a Postgres connection string, e.g. postgres://user@127.0.0.1:5432/app (or --database-url)")
	}
	if _, err := pgxpool.ParseConfig(c.dbURL); err != nil {
		return nil, usagef("DATABASE_URL is not a valid connection string: %s", dbconn.Redact(err.Error(), c.dbURL))
	}
	pool, err := dbconn.Open(ctx, c.dbURL, dbconn.Options{MaxConns: 4, Wait: 0})
	if err != nil {
		return nil, err
	}
	c.pool = pool
	return pool, nil
}

// printJSON prints v as one indented JSON document ending in exactly one
// newline. encoding/json escapes C0 controls but not C1 controls or the
// bidi controls: those are escaped here too (jsonEscapeUnsafe), so --json
// output is as safe on a terminal as text output.
func (c *cli) printJSON(v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return err
	}
	_, err := c.stdout.Write(jsonEscapeUnsafe(buf.Bytes()))
	return err
}

// flags returns a FlagSet with --json bound, errors returned not printed.
func (c *cli) flags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("outboxctl "+name, flag.ContinueOnError)
	fs.SetOutput(c.stderr)
	fs.BoolVar(&c.jsonOut, "json", false, "print JSON")
	return fs
}

// parse parses args; a flag error becomes a usage error.
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return &usageError{""}
		}
		return &usageError{err.Error()}
	}
	return nil
}

func main() {
	os.Exit(Main(os.Args[1:], os.Stdout, os.Stderr))
}

// Main runs outboxctl with args and DATABASE_URL from the environment and
// returns the exit status.
func Main(args []string, stdout, stderr io.Writer) int {
	return run(args, os.Getenv("DATABASE_URL"), stdout, stderr)
}

// run is Main with the database URL given, so tests can run in parallel.
func run(args []string, dbURL string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	c := &cli{stdout: stdout, stderr: stderr, dbURL: dbURL}
	defer func() {
		if c.pool != nil {
			c.pool.Close()
		}
	}()
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "outboxctl: unknown command %q\n\n", args[0])
		usage(stderr)
		return 2
	}
	err := cmd.run(ctx, c, args[1:])
	if err != nil && c.pool != nil && args[0] != "migrate" && !errors.Is(err, admin.ErrSchemaMissing) {
		// A command run before `outboxctl migrate` says so.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		err = schemacheck.Explain(sctx, c.pool, err)
		cancel()
	}
	// A selection or option refused by the admin package is bad usage.
	if serr := (*admin.SelectionError)(nil); errors.As(err, &serr) {
		err = &usageError{serr.Error()}
	}
	var uerr *usageError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &uerr):
		if uerr.msg != "" {
			if c.jsonOut {
				// --json promises one JSON document on stdout, errors included.
				_ = c.printJSON(map[string]string{"error": dbconn.Redact(uerr.msg, c.dbURL)})
			}
			fmt.Fprintf(stderr, "outboxctl %s: %s\n", args[0], clean(uerr.msg))
		}
		return 2
	default:
		msg := dbconn.Redact(err.Error(), c.dbURL)
		if c.jsonOut {
			_ = c.printJSON(map[string]string{"error": msg})
		}
		fmt.Fprintf(stderr, "outboxctl %s: %s\n", args[0], clean(msg))
		return 1
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: outboxctl <command> [flags]   (DATABASE_URL selects the database)")
	fmt.Fprintln(w)
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-10s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nEvery command takes --json. Exit status: 0 success, 1 failure, 2 bad usage or configuration.")
}

func init() {
	register("migrate", "apply the outbox's and River's migrations (idempotent, safe to run concurrently)", runMigrate)
	register("publish", "publish one event: --type T [--payload JSON] [--tenant ID] [--key KEY] [--ordering-key K]", runPublish)
	register("requeue", "put failed/cancelled events back to pending: --id N | --status S --type-prefix P --tenant T --since --until --error-contains --limit [--dry-run] [--all] [--allow-replay]", runRequeue)
	register("cancel", "move pending/failed events to cancelled: same selection as requeue [--dry-run] [--all]", runCancel)
	register("stats", "counts by status, dispatcher lag, River jobs per queue, alerts: [--check] [--stalled-after D] [--routes F] [--worked-queues Q,...]", runStats)
	register("retention", "purge old done events now: run [--dry-run] [--hours N] [--batch-size N]", runRetention)
	register("audit", "list recorded operator actions, newest first: [--limit N] [--action A] [--since T]", runAudit)
	register("routes", "sync the routes file into the database for strict routing at publish: sync --routes F [--strict on|off] [--dry-run] [--actor A]", runRoutes)
	register("explain", "what happened to one event: its row, matching routes, River jobs, receipts and its key's order: <event-id> [--routes F]", runExplain)
	register("keys", "list the ordering keys that wait for an operator, oldest first: [--tenant T] [--key K] [--queue Q] [--parked] [--limit N]", runKeys)
	register("unpark", "let a parked ordering key go on: --key K [--tenant T] [--queue Q] --retry|--skip [--dry-run] [--reason R] [--actor A]", runUnpark)
}
