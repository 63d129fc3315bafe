package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// The ordering ledger: what the ordering scenarios check. Each worker
// process (chaos/ledgerworker) appends a start and an end record for every
// run of a job to its own file; the outbox and River's tables say what was
// published, in which order (ordering_position) and what became of each
// job. checkOrder compares them.

// orderedRun is one run of a job, from a worker's ledger file.
type orderedRun struct {
	// Proc is the ledger file, one per worker process.
	Proc     string
	JobID    int64
	Attempt  int
	EventID  int64
	Queue    string
	Tenant   string
	Key      string
	Position int64
	Start    time.Time
	// End is zero when the file has no end record: the process died
	// during the run.
	End time.Time
	OK  bool
}

// orderedEvent is one published event as the outbox stores it; Index is
// its number in the scenario (its publish order within its key).
type orderedEvent struct {
	Index    int
	ID       int64
	Tenant   string
	Key      string
	Position int64
	Status   string
	Queues   []string
}

// orderedJob is one River job of a scenario.
type orderedJob struct {
	ID      int64
	EventID int64
	Queue   string
	State   string
	Attempt int
	// CreatedAt is when the dispatcher inserted the job (the database's
	// clock).
	CreatedAt time.Time
}

// orderCounts is what checkOrder found. Every field from Lost on is a
// fault.
type orderCounts struct {
	Keys, Jobs, Runs int
	// Killed are runs without an end record whose process died; Reruns
	// are runs that were not their job's successful one (killed, failed,
	// or done but not completed before the process died).
	Killed, Reruns int
	// RetriedJobs are jobs whose successful run was not their first
	// attempt.
	RetriedJobs int
	Lost        int
	Duplicated  int
	Stuck       int
	Phantom     int
	// Reordered: a key's successful runs did not start in the defined
	// order, or the positions do not follow the publish order.
	Reordered int
	// Early: a run started before the successful run of the event before
	// it (same key and queue) had ended.
	Early int
	// Overlaps: two runs of one key and queue overlapped in time.
	Overlaps int
	// Gaps are, per event after the first of its key and queue whose job
	// existed before the previous event's successful run ended, the time
	// from that end to the first start of its own job (not a fault: a
	// figure).
	Gaps     []time.Duration
	Problems []string
}

func (c *orderCounts) faults() int {
	return c.Lost + c.Duplicated + c.Stuck + c.Phantom + c.Reordered + c.Early + c.Overlaps
}

func (c *orderCounts) problem(format string, a ...any) {
	if len(c.Problems) < 30 {
		c.Problems = append(c.Problems, fmt.Sprintf(format, a...))
	}
}

// ledgerRecord is one line of a ledger file (ledgerworker.Record).
type ledgerRecord struct {
	Kind     string `json:"kind"`
	JobID    int64  `json:"job_id"`
	Attempt  int    `json:"attempt"`
	EventID  int64  `json:"event_id"`
	Queue    string `json:"queue"`
	Tenant   string `json:"tenant"`
	Key      string `json:"key"`
	Position int64  `json:"position"`
	At       int64  `json:"at"`
	OK       bool   `json:"ok"`
}

// readRuns reads every *.jsonl ledger file in dir and pairs each start
// record with its end record. A last line cut short by a kill is skipped;
// any other bad line, or an end without its start, is an error.
func readRuns(dir string) ([]orderedRun, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.jsonl"))
	if err != nil {
		return nil, err
	}
	var runs []orderedRun
	for _, f := range files {
		rs, err := readLedgerFile(f)
		if err != nil {
			return nil, err
		}
		runs = append(runs, rs...)
	}
	return runs, nil
}

// readLedgerFile reads the runs of one ledger file (see readRuns).
func readLedgerFile(f string) ([]orderedRun, error) {
	b, err := os.ReadFile(f)
	if err != nil {
		return nil, err
	}
	proc := filepath.Base(f)
	type ja struct {
		job     int64
		attempt int
	}
	var runs []orderedRun
	open := map[ja]int{} // index in runs
	sc := bufio.NewScanner(bytes.NewReader(b))
	for line := 1; sc.Scan(); line++ {
		var r ledgerRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			if !bytes.HasSuffix(b, []byte("\n")) && bytes.HasSuffix(b, sc.Bytes()) {
				break // the last write, cut by the kill
			}
			return nil, fmt.Errorf("%s line %d: %w", proc, line, err)
		}
		k := ja{r.JobID, r.Attempt}
		switch r.Kind {
		case "start":
			if _, dup := open[k]; dup {
				return nil, fmt.Errorf("%s line %d: job %d attempt %d started twice in one process", proc, line, r.JobID, r.Attempt)
			}
			open[k] = len(runs)
			runs = append(runs, orderedRun{Proc: proc, JobID: r.JobID, Attempt: r.Attempt, EventID: r.EventID, Queue: r.Queue,
				Tenant: r.Tenant, Key: r.Key, Position: r.Position, Start: time.Unix(0, r.At)})
		case "end":
			i, ok := open[k]
			if !ok || !runs[i].End.IsZero() {
				return nil, fmt.Errorf("%s line %d: end of job %d attempt %d without its start", proc, line, r.JobID, r.Attempt)
			}
			runs[i].End, runs[i].OK = time.Unix(0, r.At), r.OK
		default:
			return nil, fmt.Errorf("%s line %d: kind %q, want start or end", proc, line, r.Kind)
		}
	}
	return runs, sc.Err()
}

// loadOrdered reads the run's events and jobs from the outbox and River.
func loadOrdered(ctx context.Context, pool *pgxpool.Pool, run string) ([]orderedEvent, []orderedJob, error) {
	rows, err := pool.Query(ctx, `SELECT (payload->>'i')::int, id, coalesce(tenant_id, ''), coalesce(ordering_key, ''),
		coalesce(ordering_position, 0), status::text, event_type
		FROM outbox_event WHERE starts_with(dispatch_key, $1)`, run+":")
	if err != nil {
		return nil, nil, err
	}
	var evs []orderedEvent
	for rows.Next() {
		var e orderedEvent
		var typ string
		if err := rows.Scan(&e.Index, &e.ID, &e.Tenant, &e.Key, &e.Position, &e.Status, &typ); err != nil {
			return nil, nil, err
		}
		e.Queues = queuesOf(typ)
		evs = append(evs, e)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	jrows, err := pool.Query(ctx, `SELECT id, (args->>'event_id')::bigint, queue, state::text, attempt, created_at FROM river_job
		WHERE starts_with(args->>'dispatch_key', $1)`, run+":")
	if err != nil {
		return nil, nil, err
	}
	var jobs []orderedJob
	for jrows.Next() {
		var j orderedJob
		if err := jrows.Scan(&j.ID, &j.EventID, &j.Queue, &j.State, &j.Attempt, &j.CreatedAt); err != nil {
			return nil, nil, err
		}
		jobs = append(jobs, j)
	}
	return evs, jobs, jrows.Err()
}

// groupKey is one ordered stream: a (tenant, ordering key, queue).
type groupKey struct{ tenant, key, queue string }

func (g groupKey) String() string { return fmt.Sprintf("%s/%s/%s", g.tenant, g.key, g.queue) }

// checkOrder checks the scenario's n events (indexes 0..n-1), their jobs
// and the runs the workers recorded; died holds the time each dead worker
// process (by ledger file) was known dead. Per (tenant, key, queue):
//   - the positions follow the publish order (Index);
//   - every event has exactly one job per route queue, completed, and that
//     job exactly one successful run (the run of its last attempt, ended
//     with success): re-runs of the same job (a killed attempt, retried)
//     are allowed, a second job or a second successful run is not;
//   - the successful runs start in position order, and no run of an event
//     starts before the successful run of the event before it ended;
//   - no two runs overlap in time. A run without an end record ends when
//     its process was known dead; one whose process is alive never ends.
func checkOrder(n int, events []orderedEvent, jobs []orderedJob, runs []orderedRun, died map[string]time.Time) orderCounts {
	var c orderCounts
	c.Jobs, c.Runs = len(jobs), len(runs)
	byIndex := make(map[int]orderedEvent, len(events))
	byID := make(map[int64]orderedEvent, len(events))
	for _, e := range events {
		if _, dup := byIndex[e.Index]; dup {
			c.Duplicated++
			c.problem("event %d is stored twice", e.Index)
			continue
		}
		byIndex[e.Index], byID[e.ID] = e, e
	}
	// Publish order: per key, positions rise with the index.
	keyLast := map[[2]string]orderedEvent{}
	for i := range n {
		e, ok := byIndex[i]
		if !ok {
			c.Lost++
			c.problem("event %d was committed but is not in outbox_event", i)
			continue
		}
		switch e.Status {
		case "done":
		case "pending", "processing":
			c.Stuck++
			c.problem("event %d is %s", i, e.Status)
		default:
			c.Lost++
			c.problem("event %d is %s, want done", i, e.Status)
		}
		k := [2]string{e.Tenant, e.Key}
		if prev, ok := keyLast[k]; ok && prev.Position >= e.Position {
			c.Reordered++
			c.problem("key %s: event %d (position %d) was published before event %d (position %d)", e.Key, prev.Index, prev.Position, i, e.Position)
		}
		keyLast[k] = e
	}
	c.Keys = len(keyLast)

	// Jobs: one per (event, route queue), completed.
	type eq struct {
		event int64
		queue string
	}
	jobOf := map[eq]orderedJob{}
	jobByID := map[int64]orderedJob{}
	for _, j := range jobs {
		jobByID[j.ID] = j
		e, known := byID[j.EventID]
		if !known || !slices.Contains(e.Queues, j.Queue) {
			c.Phantom++
			c.problem("job %d in %s for event id %d, which has no route there", j.ID, j.Queue, j.EventID)
			continue
		}
		if prev, dup := jobOf[eq{j.EventID, j.Queue}]; dup {
			c.Duplicated++
			c.problem("event %d has two jobs in %s: %d and %d", e.Index, j.Queue, prev.ID, j.ID)
			continue
		}
		jobOf[eq{j.EventID, j.Queue}] = j
		if j.State != "completed" {
			c.Stuck++
			c.problem("job %d (event %d, %s) is %s", j.ID, e.Index, j.Queue, j.State)
		}
	}

	// Runs: by job; the successful one is the end-with-success of the
	// completed job's last attempt.
	runsOf := map[int64][]int{}
	seenAttempt := map[[2]int64]string{}
	for i, r := range runs {
		j, ok := jobByID[r.JobID]
		if !ok {
			c.Phantom++
			c.problem("%s ran job %d, which is not a job of this scenario", r.Proc, r.JobID)
			continue
		}
		if e := byID[j.EventID]; r.EventID != j.EventID || r.Key != e.Key || r.Tenant != e.Tenant || r.Position != e.Position || r.Queue != j.Queue {
			c.Phantom++
			c.problem("%s ran job %d as event %d %s/%s position %d in %s; the job is event %d %s/%s position %d in %s",
				r.Proc, r.JobID, r.EventID, r.Tenant, r.Key, r.Position, r.Queue, j.EventID, e.Tenant, e.Key, e.Position, j.Queue)
			continue
		}
		a := [2]int64{r.JobID, int64(r.Attempt)}
		if other, dup := seenAttempt[a]; dup {
			c.Duplicated++
			c.problem("job %d attempt %d ran in %s and in %s", r.JobID, r.Attempt, other, r.Proc)
		}
		seenAttempt[a] = r.Proc
		runsOf[r.JobID] = append(runsOf[r.JobID], i)
	}
	success := map[int64]int{} // job id -> index in runs
	for id, idx := range runsOf {
		j := jobByID[id]
		for _, i := range idx {
			r := runs[i]
			if r.OK && j.State == "completed" && r.Attempt == j.Attempt {
				if _, dup := success[id]; dup {
					c.Duplicated++
					c.problem("job %d has two successful runs of attempt %d", id, r.Attempt)
					continue
				}
				success[id] = i
			}
		}
	}
	for _, e := range byIndex {
		for _, q := range e.Queues {
			if _, ok := jobOf[eq{e.ID, q}]; !ok {
				c.Lost++
				c.problem("event %d (%s) has no job in %s", e.Index, e.Status, q)
			}
		}
	}
	for k, j := range jobOf {
		if _, ok := success[j.ID]; !ok && j.State == "completed" {
			c.Lost++
			c.problem("job %d (event %d, %s) is completed but no worker recorded its successful run", j.ID, byID[k.event].Index, j.Queue)
		}
	}

	// Effective ends.
	forever := time.Unix(0, math.MaxInt64)
	end := make([]time.Time, len(runs))
	for i, r := range runs {
		switch d, dead := died[r.Proc]; {
		case !r.End.IsZero():
			end[i] = r.End
		case dead:
			end[i] = d
			c.Killed++
		default:
			end[i] = forever
			c.Stuck++
			c.problem("%s: job %d attempt %d has no end record and its process is alive", r.Proc, r.JobID, r.Attempt)
		}
		if s, ok := success[r.JobID]; !ok || s != i {
			c.Reruns++
		}
	}
	for id, i := range success {
		if runs[i].Attempt > 1 && len(runsOf[id]) > 1 {
			c.RetriedJobs++
		}
	}

	// Per (tenant, key, queue): the defined order (positions) and the runs.
	order := map[groupKey][]orderedEvent{}
	for _, e := range byIndex {
		for _, q := range e.Queues {
			g := groupKey{e.Tenant, e.Key, q}
			order[g] = append(order[g], e)
		}
	}
	groupRuns := map[groupKey][]int{}
	for id, idx := range runsOf {
		j := jobByID[id]
		e := byID[j.EventID]
		g := groupKey{e.Tenant, e.Key, j.Queue}
		groupRuns[g] = append(groupRuns[g], idx...)
	}
	for g, evs := range order {
		sort.Slice(evs, func(a, b int) bool { return evs[a].Position < evs[b].Position })
		// The successful runs, in start order, follow the positions.
		var succ []int
		for _, e := range evs {
			if j, ok := jobOf[eq{e.ID, g.queue}]; ok {
				if i, ok := success[j.ID]; ok {
					succ = append(succ, i)
				}
			}
		}
		sort.Slice(succ, func(a, b int) bool { return runs[succ[a]].Start.Before(runs[succ[b]].Start) })
		for k := 1; k < len(succ); k++ {
			if a, b := runs[succ[k-1]], runs[succ[k]]; a.Position > b.Position {
				c.Reordered++
				c.problem("%s: position %d (job %d) started at %s, before position %d (job %d) at %s",
					g, b.Position, b.JobID, b.Start.Format(time.StampMicro), a.Position, a.JobID, a.Start.Format(time.StampMicro))
			}
		}
		// No run of an event starts before the successful run of the one
		// before it ended.
		for k := 1; k < len(evs); k++ {
			pj, ok := jobOf[eq{evs[k-1].ID, g.queue}]
			if !ok {
				continue
			}
			ps, ok := success[pj.ID]
			if !ok {
				continue
			}
			j, ok := jobOf[eq{evs[k].ID, g.queue}]
			if !ok {
				continue
			}
			first := time.Time{}
			for _, i := range runsOf[j.ID] {
				if first.IsZero() || runs[i].Start.Before(first) {
					first = runs[i].Start
				}
				if runs[i].Start.Before(runs[ps].End) {
					c.Early++
					c.problem("%s: job %d (position %d, attempt %d) started %s before job %d (position %d) ended",
						g, j.ID, evs[k].Position, runs[i].Attempt, runs[ps].End.Sub(runs[i].Start), pj.ID, evs[k-1].Position)
				}
			}
			if !first.IsZero() && j.CreatedAt.Before(runs[ps].End) {
				c.Gaps = append(c.Gaps, first.Sub(runs[ps].End))
			}
		}
		// No two runs overlap.
		rs := groupRuns[g]
		sort.Slice(rs, func(a, b int) bool { return runs[rs[a]].Start.Before(runs[rs[b]].Start) })
		last := -1
		for _, i := range rs {
			if last >= 0 && runs[i].Start.Before(end[last]) {
				c.Overlaps++
				c.problem("%s: job %d attempt %d (%s) started while job %d attempt %d (%s) ran, %s before its end",
					g, runs[i].JobID, runs[i].Attempt, runs[i].Proc, runs[last].JobID, runs[last].Attempt, runs[last].Proc, end[last].Sub(runs[i].Start))
			}
			if last < 0 || end[i].After(end[last]) {
				last = i
			}
		}
	}
	return c
}

// summary is the counts in one line, for the log and the report's note.
func (c *orderCounts) summary() string {
	return fmt.Sprintf("keys=%d jobs=%d runs=%d killed-runs=%d reruns=%d retried-jobs=%d lost=%d dup=%d stuck=%d phantom=%d reordered=%d early=%d overlaps=%d; %s",
		c.Keys, c.Jobs, c.Runs, c.Killed, c.Reruns, c.RetriedJobs, c.Lost, c.Duplicated, c.Stuck, c.Phantom, c.Reordered, c.Early, c.Overlaps, c.gapFigures())
}

// gapFigures is the median, p99 and largest gap between the end of an
// event's successful run and the start of the next event's job, when that
// job was waiting. It is not the bench's handoff latency: it includes the
// wait for a free worker slot, the load of the machine and the rescue of
// killed jobs.
func (c *orderCounts) gapFigures() string {
	if len(c.Gaps) == 0 {
		return "no gaps"
	}
	g := slices.Clone(c.Gaps)
	slices.Sort(g)
	at := func(q float64) time.Duration { return g[min(len(g)-1, int(q*float64(len(g))))] }
	return fmt.Sprintf("next waiting job started after (slot waits and rescues included) p50=%s p99=%s max=%s", at(0.5).Round(10*time.Microsecond), at(0.99).Round(10*time.Microsecond), g[len(g)-1].Round(time.Millisecond))
}

// problems is the first problems, one a line.
func (c *orderCounts) problems() string { return strings.Join(c.Problems, "\n") }
