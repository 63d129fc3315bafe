// Package admin is the operator's API of the outbox: requeue and cancel
// events, read the counters and alerts, explain what happened to one event,
// list the audit log, run retention now, publish one event, and list and
// unpark the ordering keys that wait for an operator. outboxctl's requeue,
// cancel, stats, explain, audit, retention, publish, keys and unpark commands
// are thin layers over it (flag parsing and rendering), and an operator
// console calls the same methods.
//
// Every method takes a context and returns a typed result that carries JSON
// tags (outboxctl --json prints these values), or an error a caller can
// branch on:
//
//   - a *SelectionError for a selection or an option refused before
//     anything touches the database (outboxctl exits 2);
//   - ErrNotFound (errors.Is) for an event id that no row has;
//   - ErrNotParked (errors.Is; a *NotParkedError says what holds the key
//     instead) when Unpark finds no parked key;
//   - ErrSchemaMissing (errors.Is) when the outbox's tables are not on the
//     connection's search_path: run `outboxctl migrate` first;
//   - any other error is the database's.
//
// Requeue and Cancel change events through the audited SQL functions
// outbox_requeue and outbox_cancel (migration 007): the change and its audit
// row commit together, and a dry run changes and records nothing; Unpark
// does the same through outbox_unpark (migration 011). The
// package builds no SQL from its input: every query is a constant with
// parameters.
//
//	cli := admin.New(pool)
//	sel := admin.Selection{TypePrefix: "mail.", Statuses: []string{"failed"}}
//	res, err := cli.Requeue(ctx, sel, admin.RequeueOpts{Actor: "alice", DryRun: true})
package admin
