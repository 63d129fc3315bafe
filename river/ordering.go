package outboxriver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/outboxhq/outbox/internal/lockorder"
)

// NewOrderedCompletionMiddleware returns River worker middleware that
// completes an ordered job (one whose metadata carries
// MetadataOrderingKey) as soon as its worker returns nil, instead of
// leaving it to River's batch completer, which writes completions every 50
// to 250 ms (see orderedCompletion). The completing transaction (one per
// group of jobs, outbox_ordering_complete of migration 012) releases the
// next job of each key and sends River's insert notification for its
// queue, so the next job starts within milliseconds of the previous one's
// end: for one job through the ordering trigger of migration 011, for a
// group with a few statements for the whole group (migration 017).
//
// The order itself does not depend on it: without this middleware the
// jobs of a key still run one at a time and in order, only with River's
// completion delay between them. Jobs without an ordering key pass through
// untouched (no transaction, no query). QueuesConfig installs it; a River
// client configured by hand adds it to Config.Middleware. A job its worker
// completed already (river.JobCompleteTx, WithIdempotency) is left as it
// is. If the completion fails, River's completer completes the job as
// usual; the error is logged (slog's default logger). Completions run at
// READ COMMITTED, which the release needs, whatever the sessions'
// default_transaction_isolation (see orderedCompletion.isolated).
func NewOrderedCompletionMiddleware() rivertype.WorkerMiddleware {
	return &orderedCompletion{}
}

// orderedCompletion group-commits: a job that ends while no transaction
// of the middleware is open is completed at once in a transaction of its
// own; jobs that end while maxFastCompletions transactions (one) are open
// queue, and the next transaction to start completes all of them (at most
// maxGroup) together. An idle worker thus pays one short transaction, and
// a busy one shares a commit, and the release notifications of a queue
// (Postgres sends identical ones of a transaction once), with the jobs
// that ended beside it. A transaction completes jobs of one River client
// (a middleware shared by two clients groups each client's apart), in the
// order of their keys (package lockorder), the order in which the handoff
// inserts them: a handoff batch and a completion that share two keys
// queue behind each other instead of deadlocking. A group and its
// fallback, one job at a time when the group fails, share a 10 s
// deadline: the workers that wait for them hold their River slots.
//
// Ordered jobs are left to River's batch completer, whose statement would
// run the release trigger for thousands of jobs at once (measured, such a
// batch outlived River's 10 s completer timeout and was retried without
// end), only when their own write fails within its deadline: at most a
// group's worth at a time. The job is completed when the chain inside this
// middleware returns nil: a worker's own middleware, which River runs
// outside the client's, must not turn that into an error. The goroutines are River's workers, each blocked in its own
// Work until its completion is written (its River worker slot stays
// taken, which slows the fetch of more jobs: backpressure); the worker
// that writes a group is one of them. Nothing outlives them.
type orderedCompletion struct {
	river.WorkerMiddlewareDefaults

	mu sync.Mutex
	// queue holds the completions no transaction has taken yet.
	queue []*completion
	// writers counts the transactions open or about to start.
	writers int
	// perJob is set once outbox_ordering_complete is found missing (a
	// schema before migration 012): each job is then completed with
	// river.JobCompleteTx.
	perJob atomic.Bool
	// isolated is set once a completion finds that the client's sessions
	// start their transactions above READ COMMITTED
	// (default_transaction_isolation set for the role or the database):
	// each completion is then a transaction begun and set to READ
	// COMMITTED explicitly, three round trips more than the one statement
	// it is otherwise (completeInTx).
	isolated atomic.Bool
}

// completion is one ordered job whose worker returned nil.
type completion struct {
	// ctx is the work context without its cancellation: it carries the
	// client and the job's metadata updates (river.JobCompleteTx).
	ctx    context.Context
	client *river.Client[pgx.Tx]
	job    *rivertype.JobRow
	scope  lockorder.Key
	// done receives the outcome once; lead asks the completion's worker
	// to write the next group.
	done chan error
	lead chan struct{}
}

const (
	// maxFastCompletions is how many completion transactions one middleware
	// has open at once. Fewer writers make larger groups, so fewer
	// transactions, round trips and River fetches per job; more let a
	// completion go on while another waits for a key a handoff holds (since
	// migration 013 only a release that empties its key's line waits so).
	// Measured with migration 014 (10,000 keys × 10, 50 workers, interleaved
	// full-size drains on fresh production-like clusters,
	// docs/ordering-measurements.md): one writer 0.37-0.42 of the unordered
	// rate and 755-940 ms of Postgres CPU per 1,000 events in four runs, two
	// writers 0.33-0.34 (927-1,007 ms), four 0.30-0.37 (1,038-1,317 ms); a
	// hot key, one job at a time, is the same with any number. Before 013,
	// four did better on the larger backlog (0.34-0.43 against 0.26-0.38 with
	// two), when every release waited for the
	// handoffs that queued behind its key.
	maxFastCompletions = 1
	// maxGroup is how many jobs one transaction completes at most.
	maxGroup = 64
)

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
	scope, ordered := orderedScope(job)
	if !ordered {
		return nil
	}
	client, cerr := river.ClientFromContextSafely[pgx.Tx](ctx)
	if cerr != nil {
		// Not a pgx client: River's completer completes the job; the job
		// itself succeeded.
		return nil //nolint:nilerr // cerr is about the client, not the work
	}
	c := &completion{
		ctx: context.WithoutCancel(ctx), client: client, job: job, scope: scope,
		done: make(chan error, 1), lead: make(chan struct{}, 1),
	}
	m.mu.Lock()
	m.queue = append(m.queue, c)
	write := m.writers < maxFastCompletions
	if write {
		m.writers++
	}
	m.mu.Unlock()
	if write {
		m.writeGroup()
	}
	for {
		select {
		case werr := <-c.done:
			// A place handed to c while it was queued, before another
			// writer took it, is still c's to use or give up.
			select {
			case <-c.lead:
				m.writeGroup()
			default:
			}
			if werr != nil {
				slog.Default().WarnContext(ctx, "outbox: completing an ordered job at once failed; River's completer completes it",
					slog.Int64("job_id", job.ID), slog.String("error", werr.Error()))
			}
			return nil
		case <-c.lead:
			m.writeGroup()
		}
	}
}

// writeGroup completes queued completions of one client (the first
// queued one's, at most maxGroup) in one transaction, then hands its
// writer's place to the first completion still queued, or gives it up.
// The caller holds a writer's place. Every completion it takes gets its
// outcome, whatever happens: a panic while writing becomes their error.
func (m *orderedCompletion) writeGroup() {
	m.mu.Lock()
	var group []*completion
	if len(m.queue) > 0 {
		client := m.queue[0].client
		rest := m.queue[:0]
		for _, c := range m.queue {
			if c.client == client && len(group) < maxGroup {
				group = append(group, c)
			} else {
				rest = append(rest, c)
			}
		}
		clear(m.queue[len(rest):])
		m.queue = rest
	}
	m.mu.Unlock()

	if len(group) > 0 {
		slices.SortStableFunc(group, func(a, b *completion) int { return lockorder.Compare(a.scope, b.scope) })
		// One deadline for the group and its fallback: the workers wait
		// for it, and their River slots with them.
		deadline := time.Now().Add(10 * time.Second)
		err := m.completeGroup(deadline, group)
		if err != nil && len(group) > 1 {
			// One job's trouble (a deadlock with a hand-made change) must
			// not fail the others: each goes alone, until the deadline.
			for _, c := range group {
				c.done <- m.completeGroup(deadline, []*completion{c})
			}
		} else {
			for _, c := range group {
				c.done <- err
			}
		}
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.queue) > 0 {
		select {
		case m.queue[0].lead <- struct{}{}:
			return // the place goes to it
		default:
			// It holds a place already (handed to it, not yet used): it
			// takes the queue, and this place is given up.
		}
	}
	m.writers--
}

// completeGroup completes the jobs of group (all of one client), in its
// order, before deadline: with one call of outbox_ordering_complete
// (migration 012), a transaction of its own in one round trip, or, against
// an older schema, with one River completion statement per job in one
// transaction. A job its worker completed already is left as it is. A
// panic is returned as an error.
func (m *orderedCompletion) completeGroup(deadline time.Time, group []*completion) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("outbox: completing ordered jobs panicked: %v", r)
		}
	}()
	ctx, cancel := context.WithDeadline(group[0].ctx, deadline)
	defer cancel()
	client := group[0].client
	if !m.perJob.Load() {
		ids := make([]int64, len(group))
		for i, c := range group {
			ids[i] = c.job.ID
		}
		// The function commits without waiting for the WAL flush (see its
		// comment in migration 012). River's completer, which runs after
		// the middleware, still merges the work's metadata updates into
		// the finalized job.
		var err error
		if !m.isolated.Load() {
			// One statement, its own transaction, at the session's default
			// isolation: it completes nothing unless that is READ
			// COMMITTED (see isolated).
			var n *int32
			err = client.Driver().GetExecutor().QueryRow(ctx, completeAtReadCommittedSQL, ids).Scan(&n)
			if err == nil && n == nil {
				m.isolated.Store(true)
			}
		}
		if err == nil && m.isolated.Load() {
			err = completeInTx(ctx, client, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `SELECT outbox_ordering_complete($1)`, ids)
				return err
			})
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42883" && strings.Contains(pgErr.Message, "outbox_ordering_complete") {
			m.perJob.Store(true) // a schema before 012
			return m.completeGroup(deadline, group)
		}
		return err
	}
	// As outbox_ordering_complete's: no wait for the WAL flush.
	return completeInTx(ctx, client, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = off`); err != nil {
			return err
		}
		for _, c := range group {
			jctx, jcancel := context.WithDeadline(c.ctx, deadline)
			_, err := river.JobCompleteTx[*riverpgxv5.Driver](jctx, tx, &river.Job[anyArgs]{JobRow: c.job})
			jcancel()
			if err != nil && !errors.Is(err, rivertype.ErrNotFound) {
				return err
			}
		}
		return nil
	})
}

// completeAtReadCommittedSQL completes a group in one statement when the
// session starts its transactions at READ COMMITTED (or READ UNCOMMITTED,
// which Postgres runs as READ COMMITTED), and returns NULL,
// completing nothing, when it does not. CASE evaluates the call only when
// its condition holds.
const completeAtReadCommittedSQL = `SELECT CASE WHEN current_setting('transaction_isolation') IN ('read committed', 'read uncommitted')
	THEN outbox_ordering_complete($1) END`

// completeInTx runs f in a transaction of client's pool at READ COMMITTED,
// whatever the session's default_transaction_isolation, and commits it.
// The release of a key whose line looks empty waits for the handoffs that
// hold the key's row and then looks again for the jobs they queued: only a
// statement of a READ COMMITTED transaction, whose snapshot is taken after
// that wait, sees them. At REPEATABLE READ or SERIALIZABLE the release
// would leave the key idle (migration 018; before it, delete the key's row
// and strand such a job), and the key's next job would wait for the
// dispatcher's wake of idle keys, about a second.
func completeInTx(ctx context.Context, client *river.Client[pgx.Tx], f func(pgx.Tx) error) error {
	execTx, err := client.Driver().GetExecutor().Begin(ctx)
	if err != nil {
		return err
	}
	tx := client.Driver().UnwrapTx(execTx)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL READ COMMITTED`); err != nil {
		return err
	}
	if err := f(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// orderedScope reports whether job carries an ordering key in its
// metadata (MetadataOrderingKey), and the key its completion locks.
func orderedScope(job *rivertype.JobRow) (lockorder.Key, bool) {
	if job == nil || !bytes.Contains(job.Metadata, []byte(`"`+MetadataOrderingKey+`"`)) {
		return lockorder.Key{}, false
	}
	var m struct {
		Tenant *string `json:"outbox_tenant_id"`
		Key    *string `json:"outbox_ordering_key"`
	}
	if json.Unmarshal(job.Metadata, &m) != nil || m.Key == nil {
		return lockorder.Key{}, false
	}
	s := lockorder.Key{OrderingKey: *m.Key, Queue: job.Queue}
	if m.Tenant != nil {
		s.Tenant = *m.Tenant
	}
	return s, true
}
