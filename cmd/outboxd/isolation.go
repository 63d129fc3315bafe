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
// waiting for the handoff that queued it, which only a READ COMMITTED
// statement can. outboxd's handoffs, the completions of outboxriver's
// middleware and unpark run at READ COMMITTED whatever the default; what
// completes an ordered job otherwise (River's own completer when the
// middleware's write fails or is not installed, River UI, a worker's
// river.JobCompleteTx in a transaction of its own) runs at the default,
// and there the release leaves the key idle: its next job waits for the
// dispatcher's wake of idle keys, about a second (migration 018;
// docs/ordering.md, "Limits").
func isolationWarning(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (string, error) {
	var level string
	if err := q.QueryRow(ctx, `SELECT current_setting('default_transaction_isolation')`).Scan(&level); err != nil {
		return "", err
	}
	if level == "read committed" || level == "read uncommitted" {
		return "", nil
	}
	return fmt.Sprintf("default_transaction_isolation is %q for this role and database: outboxd's handoffs and the ordered "+
		"completions of outboxriver's middleware run at read committed anyway, but River's own completer, River UI and "+
		"transactions of your workers that complete ordered jobs run at %q, where a release can leave a key idle and its "+
		"next job waits for the dispatcher's wake of idle keys (about a second); set it to read committed for the workers' role or database (docs/ordering.md, Limits)", level, level), nil
}
