package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// isolationWarning returns a warning when q's sessions start their
// transactions above READ COMMITTED (default_transaction_isolation set
// for the role or the database), and "" when they do not. The release of
// ordered jobs looks again for a job queued behind a key's head after
// waiting for the handoff that queued it; at REPEATABLE READ or
// SERIALIZABLE it cannot, and that job stays pending with nothing to
// release it (docs/ordering.md, "Limits").
func isolationWarning(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (string, error) {
	var level string
	if err := q.QueryRow(ctx, `SELECT current_setting('default_transaction_isolation')`).Scan(&level); err != nil {
		return "", err
	}
	if level == "read committed" {
		return "", nil
	}
	return fmt.Sprintf("default_transaction_isolation is %q for this role and database: per-key ordering needs read committed "+
		"for the transactions that complete ordered jobs, or a key's next job can stay pending with nothing to release it; "+
		"set it to read committed for the workers' role or database (docs/ordering.md, Limits)", level), nil
}
