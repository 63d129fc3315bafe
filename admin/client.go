package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/schemacheck"
)

// Client runs the operator actions against one database. It is safe for
// concurrent use.
type Client struct {
	pool *pgxpool.Pool
}

// New returns a Client that uses pool. The pool's search_path must reach the
// outbox's tables (and River's, for Stats and Explain).
func New(pool *pgxpool.Pool) *Client {
	return &Client{pool: pool}
}

// ErrNotFound is returned (wrapped; test with errors.Is) when no
// outbox_event row has the id asked for: it never existed, or retention
// purged it after it was done.
var ErrNotFound = errors.New("admin: event not found")

// ErrSchemaMissing is returned (wrapped; test with errors.Is) when the
// outbox's or River's tables are not on the connection's search_path. The
// error's text names the schema and says to run `outboxctl migrate` first.
var ErrSchemaMissing = errors.New("admin: the outbox schema is missing: run `outboxctl migrate` first")

// SelectionError is a selection or an option that a method refuses before it
// touches the database. Flag names the offending field by its outboxctl flag
// name ("type-prefix", "status", "limit", "actor"), or is empty for a rule
// about the whole selection (a bulk selection without All).
type SelectionError struct {
	Flag string
	Msg  string
}

// Error is "--flag: message", or the message alone for a rule about the
// whole selection.
func (e *SelectionError) Error() string {
	if e.Flag == "" {
		return e.Msg
	}
	return "--" + e.Flag + ": " + e.Msg
}

// notFoundError is the ErrNotFound of one event id.
type notFoundError struct{ id int64 }

func (e *notFoundError) Error() string {
	return fmt.Sprintf("event %d not found: no outbox_event row has this id (it never existed, or retention purged it after it was done)", e.id)
}

func (e *notFoundError) Is(target error) bool { return target == ErrNotFound }

// schemaError is ErrSchemaMissing with the schema's name.
type schemaError struct{ err *schemacheck.MissingError }

func (e *schemaError) Error() string        { return e.err.Error() }
func (e *schemaError) Is(target error) bool { return target == ErrSchemaMissing }
func (e *schemaError) Unwrap() error        { return e.err }

// explain turns an error caused by a missing outbox schema into one that
// says so (ErrSchemaMissing); any other error is returned unchanged.
func (c *Client) explain(ctx context.Context, err error) error {
	if err == nil || !schemacheck.Undefined(err) {
		return err
	}
	// The caller's ctx may be cancelled or spent: name the schema anyway.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var missing *schemacheck.MissingError
	if errors.As(schemacheck.Explain(sctx, c.pool, err), &missing) {
		return &schemaError{err: missing}
	}
	return err
}

// checkActor checks who runs an action, as recorded in the audit.
func checkActor(actor string) error {
	if actor == "" || len(actor) > 256 || strings.ContainsRune(actor, 0) {
		return &SelectionError{Flag: "actor", Msg: "must be 1 to 256 bytes without NUL characters"}
	}
	return nil
}
