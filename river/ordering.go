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
// MetadataOrderingKey) in a short transaction as soon as its worker
// returns nil (shared with the ordered jobs that end meanwhile: see
// orderedCompletion), instead of leaving it to River's batch completer, which
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

// orderedCompletion group-commits: the worker whose job ends while no
// completion transaction is running writes its own at once; jobs that end
// meanwhile queue, and when that transaction ends, the first of them
// writes all that queued, in one transaction. One transaction (and one
// NOTIFY per queue) serves many jobs under load, and a lone job waits for
// nobody. The goroutines are River's workers, each blocked in its own
// Work until its completion is written: nothing outlives them.
type orderedCompletion struct {
	river.WorkerMiddlewareDefaults

	mu sync.Mutex
	// queue holds the completions waiting for the next transaction;
	// writing is true while a worker writes one.
	queue   []*completion
	writing bool
}

type completion struct {
	ctx    context.Context
	client *river.Client[pgx.Tx]
	job    *rivertype.JobRow
	// done receives the outcome of the transaction that wrote the
	// completion; lead tells a waiting worker to write the next one.
	done chan error
	lead chan struct{}
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
	// The work context carries the client and the job's metadata updates;
	// its cancellation (the job's timeout) must not cut a transaction that
	// writes other jobs too.
	c := &completion{ctx: context.WithoutCancel(ctx), client: client, job: job, done: make(chan error, 1), lead: make(chan struct{}, 1)}
	m.mu.Lock()
	m.queue = append(m.queue, c)
	first := !m.writing
	m.writing = true
	m.mu.Unlock()
	if first {
		m.write()
	}
	var werr error
	select {
	case werr = <-c.done:
	case <-c.lead:
		m.write()
		werr = <-c.done
	}
	if werr != nil && ctx.Err() == nil {
		slog.Default().WarnContext(ctx, "outbox: completing an ordered job at once failed; River's completer completes it",
			slog.Int64("job_id", job.ID), slog.String("error", werr.Error()))
	}
	return nil
}

// write writes every queued completion in one transaction, then passes
// the writing on to the first completion queued meanwhile, if any.
func (m *orderedCompletion) write() {
	m.mu.Lock()
	batch := m.queue
	m.queue = nil
	m.mu.Unlock()
	err := completeNow(batch)
	for _, c := range batch {
		c.done <- err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.queue) == 0 {
		m.writing = false
		return
	}
	m.queue[0].lead <- struct{}{}
}

// completeNow completes the jobs of batch in one transaction (on the
// first one's client: every client of one middleware works one database).
// A job its worker completed already is skipped.
func completeNow(batch []*completion) error {
	if len(batch) == 0 {
		return nil
	}
	first := batch[0]
	ctx, cancel := context.WithTimeout(first.ctx, 10*time.Second)
	defer cancel()
	execTx, err := first.client.Driver().GetExecutor().Begin(ctx)
	if err != nil {
		return err
	}
	tx := first.client.Driver().UnwrapTx(execTx)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// The commit need not wait for its WAL flush: a job that the trigger
	// releases can only start after River's fetch of it commits, and that
	// commit (synchronous, as River's are) flushes the WAL up to and
	// including this one. A crash before that loses the completions and
	// the releases together: the jobs run again (River's at-least-once, as
	// when a worker dies before River's completer writes), and the next
	// jobs of their keys have not started. It also holds the NOTIFY
	// queue's lock, which every commit that notifies takes, for no flush.
	if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = off`); err != nil {
		return err
	}
	for _, c := range batch {
		jctx, jcancel := context.WithTimeout(c.ctx, 10*time.Second)
		_, err := river.JobCompleteTx[*riverpgxv5.Driver](jctx, tx, &river.Job[anyArgs]{JobRow: c.job})
		jcancel()
		if err != nil && !errors.Is(err, rivertype.ErrNotFound) {
			return err
		}
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
