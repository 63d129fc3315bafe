package claim

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// pipeTx is a pgx.Tx on a dedicated connection whose BEGIN travels in the
// same round trip as the claim, and whose COMMIT travels in the same round
// trip as the final UPDATE. A batch thus costs four round trips (BEGIN+claim,
// River's insert, River's NOTIFY, UPDATE+COMMIT) instead of six. River only
// uses Exec, Query, QueryRow and CopyFrom of the transaction it is given.
type pipeTx struct {
	conn   *pgx.Conn
	closed bool
}

var errNested = errors.New("claim: nested transactions are not supported in a batch transaction")

// beginAndQuery sends BEGIN, a setup statement and the query in one round
// trip and returns the open transaction and the query's rows.
func beginAndQuery(ctx context.Context, conn *pgx.Conn, setup, sql string, args ...any) (*pipeTx, pgx.Rows, error) {
	b := &pgx.Batch{}
	b.Queue("begin")
	b.Queue(setup)
	b.Queue(sql, args...)
	br := conn.SendBatch(ctx, b)
	tx := &pipeTx{conn: conn}
	for range 2 {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			tx.abandon(ctx)
			return nil, nil, err
		}
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		tx.abandon(ctx)
		return nil, nil, err
	}
	return tx, &batchRows{Rows: rows, br: br}, nil
}

// batchRows closes the batch when the rows are closed; a failure to close
// it (a broken connection) is reported by Err after Close.
type batchRows struct {
	pgx.Rows
	br       pgx.BatchResults
	closeErr error
}

func (r *batchRows) Close() {
	r.Rows.Close()
	if r.br != nil {
		r.closeErr = r.br.Close()
		r.br = nil
	}
}

func (r *batchRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.closeErr
}

// commitWith runs the final statements and COMMIT in one round trip.
func (t *pipeTx) commitWith(ctx context.Context, stmts []queued) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	b := &pgx.Batch{}
	for _, s := range stmts {
		b.Queue(s.sql, s.args...)
	}
	b.Queue("commit")
	br := t.conn.SendBatch(ctx, b)
	for _, s := range stmts {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			t.abandon(ctx)
			return fmt.Errorf("%s: %w", s.what, err)
		}
	}
	tag, err := br.Exec()
	closeErr := br.Close()
	t.closed = true
	if err == nil {
		err = closeErr
	}
	if err != nil {
		if t.conn.PgConn().TxStatus() != 'I' {
			_ = t.conn.Close(ctx) // outcome unknown: never reuse this session
		}
		return fmt.Errorf("commit: %w", err)
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

// abandon rolls back (best effort) after a failure.
func (t *pipeTx) abandon(ctx context.Context) {
	_ = t.Rollback(context.WithoutCancel(ctx))
}

// queued is one statement of the final round trip.
type queued struct {
	what string
	sql  string
	args []any
}

func (t *pipeTx) Begin(context.Context) (pgx.Tx, error) { return nil, errNested }

func (t *pipeTx) Commit(ctx context.Context) error { return t.commitWith(ctx, nil) }

func (t *pipeTx) Rollback(ctx context.Context) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	t.closed = true
	if t.conn.IsClosed() || t.conn.PgConn().TxStatus() == 'I' {
		return nil
	}
	_, err := t.conn.Exec(ctx, "rollback")
	if err != nil {
		_ = t.conn.Close(ctx)
	}
	return err
}

func (t *pipeTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	return t.conn.CopyFrom(ctx, table, cols, src)
}

func (t *pipeTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.conn.SendBatch(ctx, b)
}

func (t *pipeTx) LargeObjects() pgx.LargeObjects { return pgx.LargeObjects{} }

func (t *pipeTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.conn.Prepare(ctx, name, sql)
}

func (t *pipeTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.conn.Exec(ctx, sql, args...)
}

func (t *pipeTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.conn.Query(ctx, sql, args...)
}

func (t *pipeTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *pipeTx) Conn() *pgx.Conn { return t.conn }

var _ pgx.Tx = (*pipeTx)(nil)
