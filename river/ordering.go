package outboxriver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
)

// NewOrderedCompletionMiddleware returns River worker middleware that
// completes an ordered job (one whose metadata carries
// MetadataOrderingKey) in its own short transaction as soon as its worker
// returns nil, instead of leaving it to River's batch completer, which
// writes completions every 50 to 250 ms. The ordering trigger of
// migration 011 runs in that transaction: it releases the next job of the
// key and sends River's insert notification for its queue, so the next job
// starts within milliseconds of the previous one's end.
//
// The order itself does not depend on it: without this middleware the
// jobs of a key still run one at a time and in order, only with River's
// completion delay between them. Jobs without an ordering key pass through
// untouched (no transaction, no query). QueuesConfig installs it; a River
// client configured by hand adds it to Config.Middleware. A job its worker
// completed already (river.JobCompleteTx, WithIdempotency) is left as it
// is. If the completion fails, River's completer completes the job as
// usual; the error is logged through the client's logger.
func NewOrderedCompletionMiddleware() rivertype.WorkerMiddleware {
	return &orderedCompletion{}
}

type orderedCompletion struct {
	river.WorkerMiddlewareDefaults
}

// anyArgs stands for the args of any job in river.JobCompleteTx: it
// decodes from any JSON and names no kind.
type anyArgs struct{}

func (anyArgs) Kind() string                { return "" }
func (*anyArgs) UnmarshalJSON([]byte) error { return nil }

func (m *orderedCompletion) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
	err := doInner(ctx)
	if err != nil || !isOrdered(job) {
		return err
	}
	client, cerr := river.ClientFromContextSafely[pgx.Tx](ctx)
	if cerr != nil {
		return nil // not a pgx client: River's completer completes the job
	}
	if cerr := completeNow(ctx, client, job); cerr != nil && !errors.Is(cerr, rivertype.ErrNotFound) && ctx.Err() == nil {
		slog.Default().WarnContext(ctx, "outbox: completing an ordered job at once failed; River's completer completes it",
			slog.Int64("job_id", job.ID), slog.String("error", cerr.Error()))
	}
	return nil
}

func completeNow(ctx context.Context, client *river.Client[pgx.Tx], job *rivertype.JobRow) error {
	execTx, err := client.Driver().GetExecutor().Begin(ctx)
	if err != nil {
		return err
	}
	tx := client.Driver().UnwrapTx(execTx)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, &river.Job[anyArgs]{JobRow: job}); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// isOrdered reports whether job carries an ordering key in its metadata.
func isOrdered(job *rivertype.JobRow) bool {
	if job == nil || !bytes.Contains(job.Metadata, []byte(`"`+MetadataOrderingKey+`"`)) {
		return false
	}
	var m struct {
		Key *string `json:"outbox_ordering_key"`
	}
	return json.Unmarshal(job.Metadata, &m) == nil && m.Key != nil
}
