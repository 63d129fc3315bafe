package outboxriver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
)

// NewOrderedCompletionMiddleware returns River worker middleware that
// completes an ordered job (one whose metadata carries
// MetadataOrderingKey) in a short transaction of its own as soon as its
// worker returns nil, instead of leaving it to River's batch completer,
// which writes completions every 50 to 250 ms (see orderedCompletion). The ordering trigger of
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
// usual; the error is logged (slog's default logger).
func NewOrderedCompletionMiddleware() rivertype.WorkerMiddleware {
	return &orderedCompletion{}
}

// orderedCompletion completes at most maxFastCompletions jobs at once,
// each in its own short transaction; a worker whose job ends while all are
// busy waits for one (its River worker slot stays taken, which slows the
// fetch of more jobs: backpressure). Ordered jobs are never left to River's
// batch completer, whose statement would run the release trigger for
// thousands of jobs at once: measured, such a batch outlived River's 10 s
// completer timeout and was retried without end. The goroutines are
// River's workers, each blocked in its own Work until its completion is
// written: nothing outlives them.
type orderedCompletion struct {
	river.WorkerMiddlewareDefaults

	// slots holds a token per completion being written.
	slotsOnce sync.Once
	slots     chan struct{}
}

// maxFastCompletions is how many completions of ordered jobs one
// middleware writes at once.
const maxFastCompletions = 4

// anyArgs stands for the args of any job in river.JobCompleteTx: it
// decodes from any JSON and names no kind.
type anyArgs struct{}

func (anyArgs) Kind() string                { return "" }
func (*anyArgs) UnmarshalJSON([]byte) error { return nil }

func (m *orderedCompletion) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
	err := doInner(ctx)
	if err != nil {
		return err
	}
	if !isOrdered(job) {
		return nil
	}
	client, cerr := river.ClientFromContextSafely[pgx.Tx](ctx)
	if cerr != nil {
		return nil // not a pgx client: River's completer completes the job
	}
	m.slotsOnce.Do(func() { m.slots = make(chan struct{}, maxFastCompletions) })
	select {
	case m.slots <- struct{}{}:
	case <-ctx.Done():
		return nil // River's completer completes the job
	}
	defer func() { <-m.slots }()
	// The work context carries the client and the job's metadata updates;
	// its cancellation (the job's timeout) must not cut the completion.
	if werr := completeNow(context.WithoutCancel(ctx), client, job); werr != nil && ctx.Err() == nil {
		slog.Default().WarnContext(ctx, "outbox: completing an ordered job at once failed; River's completer completes it",
			slog.Int64("job_id", job.ID), slog.String("error", werr.Error()))
	}
	return nil
}

// completeNow completes job in a transaction of its own on client. A job
// its worker completed already is left as it is. ctx must carry the work
// context's values (the client and the job's metadata updates, which
// river.JobCompleteTx writes with the completion).
func completeNow(ctx context.Context, client *river.Client[pgx.Tx], job *rivertype.JobRow) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	execTx, err := client.Driver().GetExecutor().Begin(ctx)
	if err != nil {
		return err
	}
	tx := client.Driver().UnwrapTx(execTx)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// The commit need not wait for its WAL flush: a job that the trigger
	// releases can only start after River's fetch of it commits, and that
	// commit (synchronous, as River's are) flushes the WAL up to and
	// including this one. A crash before that loses the completion and the
	// release together: the job runs again (River's at-least-once, as when
	// a worker dies before River's completer writes), and the next job of
	// its key has not started. It also holds the NOTIFY queue's lock,
	// which every commit that notifies takes, for no flush.
	if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = off`); err != nil {
		return err
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, &river.Job[anyArgs]{JobRow: job}); err != nil && !errors.Is(err, rivertype.ErrNotFound) {
		return err
	}
	return tx.Commit(ctx)
}

// isOrdered reports whether job carries an ordering key in its metadata
// (MetadataOrderingKey).
func isOrdered(job *rivertype.JobRow) bool {
	if job == nil || !bytes.Contains(job.Metadata, []byte(`"`+MetadataOrderingKey+`"`)) {
		return false
	}
	var m struct {
		Key *string `json:"outbox_ordering_key"`
	}
	return json.Unmarshal(job.Metadata, &m) == nil && m.Key != nil
}
