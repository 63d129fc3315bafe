package claim

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox/route"
)

// handoffSQL inserts a batch's River jobs and marks their events done, in
// one statement: the handoff's second and last round trip before COMMIT.
//
// River's InsertManyTx returns the new jobs' ids to the client, which then
// needed a round trip of its own to record them in the events
// (river_job_ids), and a third for River's notification; on two shared cores
// each round trip is a wait for a core on both sides
// (docs/benchmarks-record.md, "The floor"). Here the statement takes the
// ids from River's sequence itself and records them in the same statement.
// The rows are River's own: the columns River's
// JobInsertFastMany writes, with the values River's
// insertParamsFromConfigArgsAndOptions computes for the handoff's jobs
// (jobColumns; TestDirectInsertMatchesRiver compares every column with
// InsertManyTx's), and River's insert notification in River's channel and
// format for each queue that got a job a worker may fetch (an ordered job
// queued behind its key's head waits in the key's line, and is inserted
// and announced when the release lets it go).
//
// $1..$9 are parallel arrays, one entry per job in insert order (see
// insertOrder): event id, the job's place among its event's jobs (route
// order: river_job_ids keeps it), then River's columns. A rule names each
// queue once (route.Table), so (event, queue) finds a job's input row.
// The statement returns the jobs inserted, the events marked done, the job
// ids recorded in them and the queues announced; the caller checks the
// first three before it commits.
var handoffSQL = handoffStatement(handoffWrites, handoffCounts)

// handoffLineSQL is handoffSQL that writes the key's line itself (lineWrites):
// the handoff's statement on a schema with migration 025, by a role that may
// insert into outbox_ordering_wait (Handoff.canLine).
var handoffLineSQL = handoffStatement(lineWrites, lineCounts)

// handoffStatement is handoffSQL with writes and counts.
func handoffStatement(writes, counts string) string {
	return `
WITH job AS (
    SELECT *
    FROM unnest($1::bigint[], $2::int[], $3::jsonb[], $4::text[], $5::smallint[], $6::jsonb[], $7::smallint[], $8::text[], $9::text[])
        WITH ORDINALITY AS j(event_id, route_pos, args, kind, max_attempts, metadata, priority, queue, tags, ord)
),` + writes + `
SELECT ` + counts
}

// handoffWrites are the common-table expressions that write a handoff: given
// a CTE job with one row per job (event_id, route_pos, args, kind,
// max_attempts, metadata, priority, queue, tags, and ord, the insert order),
// jobn gives each job its River id (river_job_id_seq, in insert order), ins
// inserts River's rows with those ids, done marks the events done with
// their jobs' ids in route order, and announced sends River's insert
// notification once per queue that got a job a worker may fetch. An
// ordered job that must wait for its key is not inserted: the ordering
// trigger queues it in the key's line with its id (migration 024), so ins
// does not return it and the counts add it (waitedSQL). The trigger does
// that only for the handoff's own inserts: jobn sets outbox.ordering_line
// to the transaction's id with each row, before ins inserts it (ins reads
// jobn row by row), and other inserts of ordered jobs wait as pending
// River rows. The setting holds for the rest of the transaction: the
// dispatcher's handoff transactions insert nothing else into river_job.
// handoffSQL takes the jobs from the client; the one-statement claim
// (fastSQL) builds them in SQL.
var handoffWrites = handoffWritesSQL(routeOrderIDs, false)

// lineWrites is handoffWrites that writes the key's line itself: in a
// batch's jobs of one (tenant, ordering key, queue), only the first goes
// through River's insert and the enqueue trigger, which makes it the key's
// head or queues it, and locks the key's row either way (as its inserter,
// or FOR KEY SHARE) until the batch commits. The key's later jobs of the
// batch wait behind it whatever it became, so the statement writes their
// rows of the line (lined) with the columns the trigger would have
// written, after that first insert: lined reads the count of ins, so ins
// has run, for every row, before lined inserts one, and the key's row is
// locked before any line row of the batch exists, as with the trigger.
// One set-based insert into a small table instead of a trigger call per
// job (a PL/pgSQL frame with its SECURITY DEFINER switch, a lookup and
// lock of the key's row, an insert through SPI, two settings): the bench's
// 10,000-event hot key is walked in 0.68-0.92 s instead of 0.95-1.49 s, on
// the cores its first jobs run on (docs/ordering-measurements.md, "The walk
// writes the line itself"). It needs INSERT on outbox_ordering_wait, which migration 025
// grants to outbox_dispatcher; on an older schema the handoff uses
// handoffWrites (Handoff.canLine). The one-statement claim (fastSQL) keeps
// handoffWrites: it never walks a key, and its batches in claim order
// rarely hold two jobs of one key.
var lineWrites = handoffWritesSQL(routeOrderIDs, true)

// routeOrderIDs gives each event's job ids in route order (handoffWritesSQL).
const routeOrderIDs = `
        SELECT event_id, array_agg(jid ORDER BY route_pos) AS ids
        FROM jobn
        GROUP BY event_id`

// handoffWritesSQL is handoffWrites with ids, the query that gives each
// event's job ids in route order (event_id, ids), and lineWrites when line
// is set: then jobk marks the jobs behind their key's first of the batch
// (behind; the window runs over jobn, whose ids are already drawn in insert
// order), ins inserts the others and lined writes those into the line.
// Without line the statement is the same as before migration 025.
func handoffWritesSQL(ids string, line bool) string {
	from, jobk, lined := "jobn", "", ""
	if line {
		from = "jobk\n    WHERE NOT behind"
		jobk = `
jobk AS MATERIALIZED (
    SELECT n.*,
           n.metadata ? 'outbox_ordering_key'
           AND row_number() OVER (PARTITION BY coalesce(n.metadata->>'outbox_tenant_id', ''), n.metadata->>'outbox_ordering_key', n.queue
                                  ORDER BY n.ord) > 1 AS behind
    FROM jobn n
),`
		lined = `
lined AS (
    INSERT INTO outbox_ordering_wait (tenant_id, ordering_key, queue, position, job_id, event_id,
                                      args, created_at, kind, max_attempts, metadata, priority, tags)
    SELECT coalesce(metadata->>'outbox_tenant_id', ''), metadata->>'outbox_ordering_key', queue,
           coalesce((metadata->>'outbox_ordering_position')::bigint, jid), jid, event_id,
           args, now(), kind, max_attempts, metadata, priority, string_to_array(tags, ',')::varchar(255)[]
    FROM jobk
    WHERE behind AND (SELECT count(*) FROM ins) >= 0
    ORDER BY ord
    RETURNING 1
),`
	}
	return `
jobn AS MATERIALIZED (
    SELECT j.*, nextval('river_job_id_seq') AS jid,
           set_config('outbox.ordering_line', txid_current()::text, true) AS line
    FROM (SELECT * FROM job ORDER BY ord) j
),` + jobk + `
ins AS (
    INSERT INTO river_job (id, args, created_at, kind, max_attempts, metadata, priority, queue, scheduled_at, state, tags)
    SELECT jid, args, now(), kind, max_attempts, metadata, priority, queue, now(), 'available', string_to_array(tags, ',')::varchar(255)[]
    FROM ` + from + `
    ORDER BY ord
    RETURNING id, (metadata->>'outbox_event_id')::bigint AS event_id, queue, state
),` + lined + `
done AS (
    UPDATE outbox_event e
    SET status = 'done', processed_at = clock_timestamp(), locked_until = NULL, river_job_ids = x.ids
    FROM (` + ids + `
    ) x
    WHERE e.id = x.event_id
    RETURNING cardinality(e.river_job_ids) AS jobs
),
announced AS (
    SELECT pg_notify(current_schema() || '.river_insert', '{"queue": ' || to_json(q.queue)::text || '}')
    FROM (SELECT DISTINCT queue FROM ins WHERE state <> 'pending') q
)`
}

// handoffCounts are the four counts a handoff statement returns: jobs
// written (inserted into River or queued in their key's line by the
// trigger), events marked done, job ids recorded in them, queues announced.
// Reading announced is also what makes its notifications run: Postgres
// evaluates a SELECT in WITH only when the query reads it.
const handoffCounts = `(SELECT count(*) + ` + waitedSQL + ` FROM ins), ` + doneCounts

// lineCounts are handoffCounts for lineWrites: the jobs written add the
// line rows the statement wrote itself (lined).
const lineCounts = `(SELECT count(*) + ` + waitedSQL + ` + (SELECT count(*) FROM lined) FROM ins), ` + doneCounts

// doneCounts are the last three of handoffCounts.
const doneCounts = `(SELECT count(*) FROM done), (SELECT coalesce(sum(jobs), 0) FROM done),
       (SELECT count(*) FROM announced)`

// waitedSQL is how many of the statement's jobs the ordering trigger
// queued in their key's line instead of inserting them (migration 024):
// the trigger counts them in the transaction-local setting
// outbox.ordering_waited as "<statement start in µs>/<count>". It is read
// in the projection of the count over ins, which runs once the insert has
// run for every row, and only a count tagged with this statement's start
// counts. Before 024 (or with no keyed job waiting) it is 0.
const waitedSQL = `CASE WHEN split_part(current_setting('outbox.ordering_waited', true), '/', 1)
                = (extract(epoch FROM statement_timestamp()) * 1000000)::bigint::text
           THEN split_part(current_setting('outbox.ordering_waited', true), '/', 2)::bigint ELSE 0 END`

// jobColumns holds a batch's jobs as the parallel arrays of handoffSQL.
type jobColumns struct {
	eventID     []int64
	routePos    []int32
	args        [][]byte
	kind        []string
	maxAttempts []int16
	metadata    [][]byte
	priority    []int16
	queue       []string
	tags        []string
}

// sqlArgs returns the arguments of handoffSQL.
func (c *jobColumns) sqlArgs() []any {
	return []any{c.eventID, c.routePos, c.args, c.kind, c.maxAttempts, c.metadata, c.priority, c.queue, c.tags}
}

// add appends one job of event eventID, the pos-th of its event in route
// order, with the values River's InsertManyTx would give it: args encoded
// with encoding/json, River's defaults for a priority, max attempts and
// queue left at zero, no tags as an empty list, metadata {} when none. The
// handoff's jobs (outboxriver.JobParams) set no unique options, schedule,
// pending state or insert options of their args type; add refuses such a
// job instead of inserting it differently from River, and checks what River
// checks (route.ValidateInsert: queue name, priority, max attempts, tags)
// so that a bad value fails the batch with a clear error instead of a
// constraint violation or a row River would have refused.
func (c *jobColumns) add(eventID int64, pos int, p river.InsertManyParams) error {
	if p.Args == nil {
		return errors.New("job has no args")
	}
	if _, ok := p.Args.(river.JobArgsWithInsertOpts); ok {
		return fmt.Errorf("job kind %s: args with their own insert options are not supported by the handoff", p.Args.Kind())
	}
	opts := p.InsertOpts
	if opts == nil {
		opts = &river.InsertOpts{}
	}
	if !opts.ScheduledAt.IsZero() || opts.Pending || !uniqueEmpty(opts.UniqueOpts) {
		return fmt.Errorf("job kind %s: scheduled, pending or unique jobs are not supported by the handoff", p.Args.Kind())
	}
	encoded, err := json.Marshal(p.Args)
	if err != nil {
		return fmt.Errorf("job kind %s: encode args: %w", p.Args.Kind(), err)
	}
	priority := cmp.Or(opts.Priority, river.PriorityDefault)
	maxAttempts := cmp.Or(opts.MaxAttempts, river.MaxAttemptsDefault)
	queue := cmp.Or(opts.Queue, river.QueueDefault)
	if err := route.ValidateInsert(queue, priority, maxAttempts, opts.Tags); err != nil {
		return fmt.Errorf("job kind %s: %w", p.Args.Kind(), err)
	}
	metadata := opts.Metadata
	if len(metadata) == 0 {
		metadata = []byte("{}")
	}
	c.eventID = append(c.eventID, eventID)
	c.routePos = append(c.routePos, int32(pos))
	c.args = append(c.args, encoded)
	c.kind = append(c.kind, p.Args.Kind())
	c.maxAttempts = append(c.maxAttempts, int16(maxAttempts))
	c.metadata = append(c.metadata, metadata)
	c.priority = append(c.priority, int16(priority))
	c.queue = append(c.queue, queue)
	c.tags = append(c.tags, strings.Join(opts.Tags, ","))
	return nil
}

func uniqueEmpty(u river.UniqueOpts) bool {
	// River's own test (UniqueOpts.isEmpty): a non-nil ByState, even an
	// empty one, makes a job unique.
	return !u.ByArgs && u.ByPeriod == 0 && !u.ByQueue && u.ByState == nil && !u.ExcludeKind
}
