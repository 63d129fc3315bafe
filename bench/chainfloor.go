package main

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
)

// ordChainFloor is the ordering scenario's floor for one key: not the
// outbox but the least any design can do that runs one key's jobs through
// River one after another, each starting only once the previous one is
// finalized. Each job, when its work is done, completes itself and inserts
// its successor as an available job in one statement (one round trip, one
// transaction committed without waiting for the WAL flush, as the ordered
// completion is) that also sends River's insert notification; River's
// producer fetches the successor on that notification. There is no outbox
// event, no dispatcher, no waiting job, key row or trigger: the successor
// is written once, when it may run. So its time per job, and its next
// job's start after the previous job's end, are lower bounds for the hot
// key's, measured in the same run on the same River workers
// (docs/ordering-measurements.md, "The floor of one key").
const ordChainFloor = "floor: River chain, one key"

// chainFloorArgs is a job of the floor's chain: its position and the
// chain's length.
type chainFloorArgs struct {
	Pos int `json:"pos"`
	N   int `json:"n"`
}

func (chainFloorArgs) Kind() string { return "bench_chain_floor" }

// chainFloorSQL completes running job $1 and, when $2 is not the chain's
// last position ($3 jobs in all), inserts the job of position $2 + 1 into
// the same queue, available, and sends River's insert notification for
// it, all in one statement and one transaction that does not wait for its
// WAL flush. Its result is the number of jobs it completed.
const chainFloorSQL = `
WITH done AS (
    UPDATE river_job
    SET state = 'completed', finalized_at = now()
    WHERE id = $1 AND state = 'running'
    RETURNING queue, kind, max_attempts
), next AS (
    INSERT INTO river_job (args, kind, max_attempts, queue, state)
    SELECT jsonb_build_object('pos', $2::int + 1, 'n', $3::int), kind, max_attempts, queue, 'available'
    FROM done
    WHERE $2::int + 1 < $3::int
    RETURNING queue
)
SELECT (SELECT count(*) FROM done),
       (SELECT count(pg_notify(current_schema() || '.river_insert', json_build_object('queue', queue)::text)) FROM next),
       set_config('synchronous_commit', 'off', true)`

// chainFloorWorker records each job's Work as orderWorker does, then
// completes the job and inserts the next in one statement.
type chainFloorWorker struct {
	river.WorkerDefaults[chainFloorArgs]
	runLog
	pool *pgxpool.Pool
	err  atomic.Pointer[error]
}

func (w *chainFloorWorker) Work(ctx context.Context, job *river.Job[chainFloorArgs]) error {
	start := time.Now()
	w.add("chain", orderRun{id: int64(job.Args.Pos), start: start, end: time.Now()})
	var completed, notified int64
	var sc string
	if err := w.pool.QueryRow(ctx, chainFloorSQL, job.ID, job.Args.Pos, job.Args.N).Scan(&completed, &notified, &sc); err != nil || completed != 1 {
		if err == nil {
			err = fmt.Errorf("chain floor: job %d (position %d) was not running", job.ID, job.Args.Pos)
		}
		w.err.CompareAndSwap(nil, &err)
		return err
	}
	w.worked.Add(1)
	return nil
}

// chainFloorRun runs a chain of n jobs on the same River workers as the
// ordered modes and times it from the workers' start to the last job's
// start.
func chainFloorRun(ctx context.Context, e *env, schema string, n, workers int) (OrderingRun, map[string][]orderRun, error) {
	r := OrderingRun{Events: n}
	p, err := e.migrated(ctx, schema, 8)
	if err != nil {
		return r, nil, err
	}
	defer p.Close()
	wp, err := e.pool(ctx, schema, int32(workers/2+8), appWorkers)
	if err != nil {
		return r, nil, err
	}
	defer wp.Close()
	w := &chainFloorWorker{pool: wp}
	ws := river.NewWorkers()
	river.AddWorker(ws, w)
	ow, err := newOrderingWorkers(e, p, wp, ws, workers)
	if err != nil {
		return r, nil, err
	}
	if _, err := ow.rc.Insert(ctx, chainFloorArgs{Pos: 0, N: n}, &river.InsertOpts{Queue: benchQueue}); err != nil {
		return r, nil, fmt.Errorf("chain floor: insert the first job: %w", err)
	}
	srv0, self0 := backendCPU(ctx, p), selfCPUSeconds()
	start := time.Now()
	r.started = start
	if err := ow.start(ctx); err != nil {
		return r, nil, err
	}
	defer ow.stop(ctx)
	err = waitWorked(ctx, &w.worked, n, func() error {
		if perr := w.err.Load(); perr != nil {
			return *perr
		}
		return nil
	})
	if err != nil {
		return r, nil, fmt.Errorf("chain floor: %w", err)
	}
	return r, w.finish(ctx, p, &r, srv0, self0, start), nil
}
