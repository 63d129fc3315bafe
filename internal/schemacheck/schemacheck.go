// Package schemacheck tells "the outbox schema is missing" from other
// database errors, so that outboxctl and outboxd say "run `outboxctl
// migrate` first" instead of printing a raw relation error.
package schemacheck

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Querier is what the checks need of a pool, a connection or a transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// MissingError says that the outbox's (or River's) tables are not in Schema.
type MissingError struct {
	// Schema is where the connection looks (current_schema(), or the
	// search_path when none of its schemas exists).
	Schema string
	// Err is the database error that revealed it, if any.
	Err error
}

func (e *MissingError) Error() string {
	return fmt.Sprintf("the outbox schema is missing in %s: run `outboxctl migrate` first", e.Schema)
}

func (e *MissingError) Unwrap() error { return e.Err }

// Undefined reports whether err is an undefined_table (42P01),
// undefined_function (42883) or undefined_object (42704, a missing enum
// type) error about one of the outbox's or River's objects.
func Undefined(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "42P01", "42883", "42704":
	default:
		return false
	}
	return strings.Contains(pgErr.Message, "outbox_") || strings.Contains(pgErr.Message, "river_")
}

// schemaSQL names where the connection looks for unqualified tables.
const schemaSQL = `SELECT coalesce(current_schema(), 'search_path ' || current_setting('search_path'))`

// Explain returns a *MissingError when err is an Undefined error, else err
// unchanged. q reads the schema name for the message.
func Explain(ctx context.Context, q Querier, err error) error {
	if !Undefined(err) {
		return err
	}
	return &MissingError{Schema: schemaName(ctx, q), Err: err}
}

// Check returns a *MissingError when outbox_event or River's river_job is
// not visible on q's search_path, nil when both are, or the query's error.
func Check(ctx context.Context, q Querier) error {
	var outbox, river bool
	err := q.QueryRow(ctx, `SELECT to_regclass('outbox_event') IS NOT NULL, to_regclass('river_job') IS NOT NULL`).Scan(&outbox, &river)
	if err != nil {
		return fmt.Errorf("look for the outbox schema: %w", err)
	}
	if outbox && river {
		return nil
	}
	return &MissingError{Schema: schemaName(ctx, q)}
}

func schemaName(ctx context.Context, q Querier) string {
	var s string
	if q == nil || q.QueryRow(ctx, schemaSQL).Scan(&s) != nil {
		return "the connection's search_path"
	}
	return s
}

// heldFromSQL reports whether outbox_event has held_from, which migration
// 021 adds with the triggers that put held events back (in one
// transaction, so the column stands for both).
const heldFromSQL = `SELECT EXISTS (
    SELECT 1 FROM pg_attribute
    WHERE attrelid = 'outbox_event'::regclass AND attname = 'held_from' AND NOT attisdropped)`

// lineSQL reports whether the schema has migration 025, the role may
// insert into outbox_ordering_wait (which 025 grants outbox_dispatcher;
// the schema's owner always may), and the enqueue trigger fires for this
// session: enabled, and not only for replicas or (with
// session_replication_role = replica) only for origins. A line row written
// while it does not fire would wait behind a head that no key row names.
// The CASE keeps has_table_privilege off a schema without the table.
const lineSQL = `SELECT CASE WHEN to_regclass('outbox_ordering_wait') IS NULL OR to_regclass('river_job') IS NULL THEN false
            ELSE EXISTS (SELECT 1 FROM outbox_schema_migration WHERE version >= 25)
                 AND has_table_privilege('outbox_ordering_wait', 'INSERT')
                 AND EXISTS (SELECT 1 FROM pg_trigger
                             WHERE tgrelid = to_regclass('river_job') AND tgname = 'outbox_ordering_enqueue'
                               AND (tgenabled = 'A'
                                    OR (tgenabled = 'O' AND current_setting('session_replication_role') <> 'replica')))
            END`

// LineWrites reports whether the handoff may write ordered jobs' rows of
// their key's line itself: the schema q looks in has migration 025, the
// role may insert into outbox_ordering_wait, and the enqueue trigger fires. It is one catalog lookup;
// callers decide whether to remember it.
func LineWrites(ctx context.Context, q Querier) (bool, error) {
	var ok bool
	if err := q.QueryRow(ctx, lineSQL).Scan(&ok); err != nil {
		return false, fmt.Errorf("look for migration 025 (INSERT on outbox_ordering_wait): %w", err)
	}
	return ok, nil
}

// HeldFrom reports whether the schema q looks in has migration 021: the
// claim moves held events' due times and the backlog counts them only
// then. It is one catalog lookup; callers decide whether to remember it.
func HeldFrom(ctx context.Context, q Querier) (bool, error) {
	var ok bool
	if err := q.QueryRow(ctx, heldFromSQL).Scan(&ok); err != nil {
		return false, fmt.Errorf("look for migration 021 (outbox_event.held_from): %w", err)
	}
	return ok, nil
}
