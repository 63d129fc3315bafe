package claim

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// rollbackTimeout bounds the rollback of a batch transaction. The caller's
// context may be done (that is often why the batch is rolled back), so the
// rollback runs without its cancellation but never longer than this; a
// rollback that fails or times out makes pgx close the connection, which
// ends the server session and its locks.
const rollbackTimeout = 5 * time.Second

// rollback ends tx if it is still open. After a Commit or an earlier
// Rollback it does nothing (pgx returns ErrTxClosed).
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// beginAndClaim begins a transaction on conn and runs setup and the claim
// query in it, all in one round trip (pgx's Batch.BeginTx), and returns the
// open transaction and the claimed events. On error the transaction is
// rolled back.
func beginAndClaim(ctx context.Context, conn *pgx.Conn, setup string, scan pgx.RowToFunc[Event], sql string, args ...any) (pgx.Tx, []Event, error) {
	b := &pgx.Batch{}
	// READ COMMITTED whatever the session's default: the ordering trigger
	// that the batch's River inserts fire locks or makes its key's row,
	// and at REPEATABLE READ that fails the batch with a serialization
	// error whenever a release deleted or made the row after the claim's
	// snapshot (TestHandoffRunsAtReadCommitted).
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	b.Queue(setup)
	b.Queue(sql, args...)
	br := conn.SendBatch(ctx, b)
	tx := br.Tx()
	events, err := readClaim(br, 2, scan)
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		// After a failed BEGIN the batch has closed tx already: rollback
		// then does nothing.
		rollback(ctx, tx)
		return nil, nil, err
	}
	return tx, events, nil
}

// readClaim reads the results of the batch's first execs statements (BEGIN
// and the setup statement, or the setup alone) and of the claim, whose rows
// scan reads.
func readClaim(br pgx.BatchResults, execs int, scan pgx.RowToFunc[Event]) ([]Event, error) {
	for range execs {
		if _, err := br.Exec(); err != nil {
			return nil, err
		}
	}
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, scan)
}

// queued is one statement of the final step of a batch. A statement with
// row returns one row, scanned into it.
type queued struct {
	what string
	sql  string
	args []any
	row  []any
}

// read reads s's result from br.
func (s queued) read(br pgx.BatchResults) error {
	if s.row != nil {
		return br.QueryRow().Scan(s.row...)
	}
	_, err := br.Exec()
	return err
}

// optional is a statement whose failure does not fail its batch: finish
// runs it after the others, under a savepoint, and when it fails rolls
// back to the savepoint, passes the error to onFail and commits the rest.
// (After a failed statement Postgres skips the rest of the round trip, so
// it can only come last.) An error that pgx raises before anything is sent
// (it prepares every statement of the batch first: an optional statement
// that no longer parses, after a schema change) fails the whole batch.
type optional struct {
	queued
	onFail func(error)
}

// optionalSavepoint is the savepoint an optional statement runs under.
const optionalSavepoint = "outbox_optional"

// finish runs the final statements of a batch in tx, then opt (if not
// nil), in one round trip, then check (if not nil) on what they returned,
// and commits.
func finish(ctx context.Context, tx pgx.Tx, stmts []queued, opt *optional, check func() error) error {
	if len(stmts) > 0 || opt != nil {
		optErr, err := sendFinal(ctx, tx, stmts, opt)
		if err != nil {
			return err
		}
		if optErr != nil {
			if ctx.Err() != nil {
				return optErr
			}
			if _, rerr := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+optionalSavepoint); rerr != nil {
				return fmt.Errorf("%w (and rolling back to its savepoint: %w)", optErr, rerr)
			}
			if opt.onFail != nil {
				opt.onFail(optErr)
			}
		}
	}
	if check != nil {
		if err := check(); err != nil {
			return err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// sendFinal sends stmts and opt in one round trip and reads their results.
// It returns opt's failure apart (optErr), after which the transaction
// waits for a rollback to the savepoint; err is any other failure.
func sendFinal(ctx context.Context, tx pgx.Tx, stmts []queued, opt *optional) (optErr, err error) {
	b := &pgx.Batch{}
	for _, s := range stmts {
		b.Queue(s.sql, s.args...)
	}
	if opt != nil {
		b.Queue("SAVEPOINT " + optionalSavepoint)
		b.Queue(opt.sql, opt.args...)
	}
	br := tx.SendBatch(ctx, b)
	defer func() {
		// After a failed statement Close returns that statement's error
		// again.
		if cerr := br.Close(); err == nil && optErr == nil {
			err = cerr
		}
	}()
	for _, s := range stmts {
		if err := s.read(br); err != nil {
			return nil, fmt.Errorf("%s: %w", s.what, err)
		}
	}
	if opt != nil {
		if _, err := br.Exec(); err != nil {
			return nil, fmt.Errorf("savepoint before %s: %w", opt.what, err)
		}
		if err := opt.read(br); err != nil {
			return fmt.Errorf("%s: %w", opt.what, err), nil
		}
	}
	return nil, nil
}
