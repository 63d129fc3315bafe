-- 024: a waiting ordered job waits in outbox_ordering_wait itself, not as a
-- pending row of river_job; it enters River, available, when its turn
-- comes. Same guarantee, same key rows and the same line (docs/ordering.md,
-- "How it works"; docs/architecture.md, "Per-key ordering", says why).
--
-- Before 024 a waiting job was written to river_job twice before a worker
-- could fetch it: inserted pending by the handoff, then made available by
-- the release. Each version of a River row writes River's seven indexes,
-- two of them GIN over its args and metadata. Now the handoff writes the
-- job's columns to its row in the line (one small table, one B-tree), and
-- the release inserts the River row once, available. Measured on the
-- bench's many-keys drain (10,000 keys x 10 events, six interleaved pairs
-- on fresh production-like clusters, 2026-12-03): 0.53-0.58x the
-- unordered drain (mean 0.56) against 0.43-0.53x (mean 0.49) before, and
-- 13 % less Postgres CPU per event; the hot key unchanged
-- (docs/ordering-measurements.md, "Waiting jobs out of River's table").
--
-- - The handoff gives every job its id from river_job_id_seq before it
--   inserts it (package claim), so an event records its jobs' ids at the
--   handoff whether they run at once or wait; a waiting job keeps that id
--   in the line (job_id) and in River.
-- - outbox_ordering_enqueue (BEFORE INSERT on river_job): a job of the
--   handoff that must wait goes into the line with its columns, and the
--   insert of its River row is skipped (RETURN NULL). The handoff says
--   which inserts are its own: its statement sets the transaction-local
--   setting outbox.ordering_line to the transaction's id before its first
--   job is inserted (package claim, jobn); the job must also be shaped as
--   the handoff's (available, never attempted, not unique). The trigger
--   counts the jobs it skipped in the transaction-local setting
--   outbox.ordering_waited, tagged with the statement's start
--   (statement_timestamp, in microseconds), so that the handoff's check of
--   its counts (016) adds them to the rows it inserted (package claim,
--   handoffCounts). Any other insert of a job with the ordering metadata
--   (River's InsertManyTx of outboxriver.JobParams, SQL) waits as before
--   024, as a pending River row: River's insert returns a row for every
--   job it was given, as its callers expect.
-- - The enqueue trigger gets a WHEN clause like 017's: the release's own
--   inserts (outbox.ordering_release set to the transaction's id) skip it.
--   It compares with txid_current(), not 017's txid_current_if_assigned():
--   a BEFORE INSERT trigger can run before its transaction has an id (017's
--   UPDATE triggers run after the row's lock gave it one), and NULL would
--   make an unset setting compare equal and skip the trigger. The insert
--   takes an id anyway.
-- - outbox_ordering_advance and outbox_ordering_complete release a job
--   from the line by inserting its River row (available, scheduled now,
--   created when it was handed off), and a job queued before 024 by
--   making its pending row available, as before.
-- - River UI no longer shows waiting jobs: they are not River rows until
--   their turn. outboxctl keys and explain show them (docs/ordering.md).
--
-- The new columns are nullable, with no default: adding them rewrites
-- nothing. River's own table is left as River makes it: no column of ours
-- uses its row type, which would block River's later ALTER TABLEs.
--
-- One transaction. Recreating the enqueue trigger takes a SHARE ROW
-- EXCLUSIVE lock on river_job, and adding the columns an ACCESS EXCLUSIVE
-- lock on outbox_ordering_wait (handoffs and releases of ordered jobs
-- wait), each for a moment.

BEGIN;
SET LOCAL lock_timeout = '10s';

ALTER TABLE outbox_ordering_wait
    ADD COLUMN IF NOT EXISTS args         jsonb,
    ADD COLUMN IF NOT EXISTS created_at   timestamptz,
    ADD COLUMN IF NOT EXISTS kind         text,
    ADD COLUMN IF NOT EXISTS max_attempts smallint,
    ADD COLUMN IF NOT EXISTS metadata     jsonb,
    ADD COLUMN IF NOT EXISTS priority     smallint,
    ADD COLUMN IF NOT EXISTS tags         varchar(255)[];

COMMENT ON COLUMN outbox_ordering_wait.kind IS
    'Set (with args, created_at, max_attempts, metadata, priority and tags) when the job waits here rather than as a pending river_job row (migration 024); the release inserts its River row.';

CREATE OR REPLACE FUNCTION outbox_ordering_enqueue() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    v_tenant text   := coalesce(NEW.metadata->>'outbox_tenant_id', '');
    v_key    text   := NEW.metadata->>'outbox_ordering_key';
    v_event  bigint := (NEW.metadata->>'outbox_event_id')::bigint;
    v_pos    bigint := coalesce((NEW.metadata->>'outbox_ordering_position')::bigint, NEW.id);
    v_stmt   text;
    v_count  text;
BEGIN
    -- The key's row is locked until this transaction ends, as its inserter
    -- or FOR KEY SHARE (013's header).
    LOOP
        PERFORM 1 FROM outbox_ordering_key k
        WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = NEW.queue
        FOR KEY SHARE;
        EXIT WHEN FOUND;
        INSERT INTO outbox_ordering_key (tenant_id, ordering_key, queue, head_job_id, head_event_id, head_position)
        VALUES (v_tenant, v_key, NEW.queue, NEW.id, v_event, v_pos)
        ON CONFLICT (tenant_id, ordering_key, queue) DO NOTHING;
        IF FOUND THEN
            RETURN NEW; -- the key was free: this job is its head
        END IF;
        -- Another transaction made the key's row in between (or released
        -- its head and deleted it): look again.
    END LOOP;
    IF current_setting('outbox.ordering_line', true) = txid_current()::text
       AND NEW.state = 'available' AND NEW.attempt = 0 AND NEW.attempted_at IS NULL AND NEW.attempted_by IS NULL
       AND NEW.errors IS NULL AND NEW.finalized_at IS NULL AND NEW.unique_key IS NULL AND NEW.unique_states IS NULL THEN
        -- The handoff's job: it waits in the line, not in River.
        INSERT INTO outbox_ordering_wait (tenant_id, ordering_key, queue, position, job_id, event_id,
                                          args, created_at, kind, max_attempts, metadata, priority, tags)
        VALUES (v_tenant, v_key, NEW.queue, v_pos, NEW.id, v_event,
                NEW.args, NEW.created_at, NEW.kind, NEW.max_attempts, NEW.metadata, NEW.priority, NEW.tags);
        v_stmt := (extract(epoch FROM statement_timestamp()) * 1000000)::bigint::text;
        v_count := current_setting('outbox.ordering_waited', true);
        PERFORM set_config('outbox.ordering_waited',
                           v_stmt || '/' || CASE WHEN split_part(v_count, '/', 1) = v_stmt
                                                 THEN split_part(v_count, '/', 2)::bigint + 1 ELSE 1 END,
                           true);
        RETURN NULL;
    END IF;
    INSERT INTO outbox_ordering_wait (tenant_id, ordering_key, queue, position, job_id, event_id)
    VALUES (v_tenant, v_key, NEW.queue, v_pos, NEW.id, v_event);
    NEW.state := 'pending';
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_ordering_enqueue ON river_job;
CREATE TRIGGER outbox_ordering_enqueue
    BEFORE INSERT ON river_job
    FOR EACH ROW WHEN (NEW.metadata ? 'outbox_ordering_key'
                       AND current_setting('outbox.ordering_release', true) IS DISTINCT FROM txid_current()::text)
    EXECUTE FUNCTION outbox_ordering_enqueue();

CREATE OR REPLACE FUNCTION outbox_ordering_advance(p_tenant text, p_key text, p_queue text, p_schema text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    -- The keys in the database's default collation, whatever the call's
    -- (012's header).
    v_tenant text COLLATE "default" := p_tenant;
    v_key    text COLLATE "default" := p_key;
    v_queue  text COLLATE "default" := p_queue;
    w        record;
    v_state  text;
    v_found  boolean;
    v_final  boolean := false;
    v_prev   text;
    v_released boolean;
BEGIN
    LOOP
        -- The first in line, taken off the queue. The caller holds the
        -- key's row FOR NO KEY UPDATE (or FOR UPDATE): no other release
        -- runs; a handoff may be queueing jobs behind, all after this one.
        DELETE FROM outbox_ordering_wait x
        WHERE x.ctid = (SELECT y.ctid FROM outbox_ordering_wait y
                        WHERE y.tenant_id = v_tenant AND y.ordering_key = v_key AND y.queue = v_queue
                        ORDER BY y.position, y.job_id LIMIT 1)
        RETURNING x.position, x.job_id, x.event_id, x.args, x.created_at, x.kind, x.max_attempts, x.metadata, x.priority, x.tags INTO w;
        IF NOT FOUND THEN
            IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
                -- This snapshot cannot show what the handoffs that hold
                -- the row queued: the key stays, idle, for
                -- outbox_ordering_wake to release at READ COMMITTED. Its
                -- head is done: a parking (by that head) ends here, as
                -- the row's deletion would have ended it.
                UPDATE outbox_ordering_key k
                SET idle_since = coalesce(k.idle_since, now()), parked_at = NULL, parked_state = NULL
                WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue;
                RETURN;
            END IF;
            IF NOT v_final THEN
                -- Wait for the handoffs that hold the row FOR KEY SHARE
                -- (each may have queued a job this statement's snapshot
                -- did not see), keep new ones out, and look again.
                PERFORM 1 FROM outbox_ordering_key k
                WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue
                FOR UPDATE;
                v_final := true;
                CONTINUE;
            END IF;
            DELETE FROM outbox_ordering_key k WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue;
            RETURN;
        END IF;
        IF w.kind IS NOT NULL THEN
            -- 024: the job waited in the line itself. It enters River now,
            -- available, with the id the handoff gave it; the enqueue
            -- trigger skips it (this transaction's id in
            -- outbox.ordering_release, restored afterwards: a group call
            -- that runs this has set it already).
            v_prev := current_setting('outbox.ordering_release', true);
            PERFORM set_config('outbox.ordering_release', txid_current()::text, true);
            INSERT INTO river_job (id, args, created_at, kind, max_attempts, metadata, priority, queue, scheduled_at, state, tags)
            VALUES (w.job_id, w.args, w.created_at, w.kind, w.max_attempts, w.metadata, w.priority, v_queue, now(), 'available', w.tags);
            v_released := FOUND;
            PERFORM set_config('outbox.ordering_release', coalesce(v_prev, ''), true);
        ELSE
            -- Queued before 024 (or by other code than the handoff):
            -- River's pending row. The common case: the job waits as it
            -- was queued. By primary key only: state::text is no index
            -- condition (014's header).
            UPDATE river_job r SET state = 'available', scheduled_at = now() WHERE r.id = w.job_id AND r.state::text = 'pending';
            v_released := FOUND;
        END IF;
        IF v_released THEN
            UPDATE outbox_ordering_key k
            SET head_job_id = w.job_id, head_event_id = w.event_id, head_position = w.position, head_since = now(),
                parked_at = NULL, parked_state = NULL, idle_since = NULL
            WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue;
            PERFORM pg_notify(p_schema || '.river_insert', json_build_object('queue', v_queue)::text);
            RETURN;
        END IF;
        -- Changed by hand while it waited: completed is skipped, cancelled,
        -- discarded or deleted parks the key, any other state (River's
        -- retry of it is held pending, so this is rare) becomes the head as
        -- it is.
        SELECT r.state::text INTO v_state FROM river_job r WHERE r.id = w.job_id FOR UPDATE;
        v_found := FOUND;
        IF v_found AND v_state = 'completed' THEN
            CONTINUE;
        END IF;
        UPDATE outbox_ordering_key k
        SET head_job_id = w.job_id, head_event_id = w.event_id, head_position = w.position, head_since = now(),
            parked_at = CASE WHEN NOT v_found OR v_state IN ('cancelled', 'discarded') THEN now() END,
            parked_state = CASE WHEN NOT v_found THEN 'deleted' WHEN v_state IN ('cancelled', 'discarded') THEN v_state END,
            idle_since = NULL
        WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue;
        RETURN;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION outbox_ordering_complete(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    v_n      integer;
    v_t      text[];
    v_k      text[];
    v_q      text[];
    v_id     bigint[];
    v_queues text[];
    v_heads  bigint[];
    v_moved  bigint[];
    v_rest   record;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    IF cardinality(p_ids) = 1 THEN
        -- One job (a hot key's, or a quiet moment's): the triggers release
        -- its key's next job, as before 017, which costs less than the
        -- statements below for one job (017's header).
        UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = p_ids[1] AND state::text = 'running';
        GET DIAGNOSTICS v_n = ROW_COUNT;
        RETURN v_n;
    END IF;
    -- The triggers leave this call's changes to it (017's header): the
    -- setting names this transaction, which is writing anyway.
    PERFORM set_config('outbox.ordering_release', txid_current()::text, true);

    -- Complete, by primary key only (state::text is no index condition:
    -- 014's header). The ordered ones, in the order given.
    WITH done AS (
        UPDATE river_job SET state = 'completed', finalized_at = now()
        WHERE id = ANY(p_ids) AND state::text = 'running'
        RETURNING id, coalesce(metadata->>'outbox_tenant_id', '') AS t, metadata->>'outbox_ordering_key' AS k, queue AS q
    )
    SELECT count(*)::integer,
           array_agg(t ORDER BY o) FILTER (WHERE k IS NOT NULL),
           array_agg(k ORDER BY o) FILTER (WHERE k IS NOT NULL),
           array_agg(q ORDER BY o) FILTER (WHERE k IS NOT NULL),
           array_agg(id ORDER BY o) FILTER (WHERE k IS NOT NULL)
    INTO v_n, v_t, v_k, v_q, v_id
    FROM (SELECT d.*, array_position(p_ids, d.id) AS o FROM done d) s;

    IF v_id IS NOT NULL THEN
        -- The rows of the keys whose head completed, one after the other in
        -- the order given (a nested loop over the arrays). FOR NO KEY
        -- UPDATE, as the settled trigger: a handoff queueing jobs behind a
        -- head (FOR KEY SHARE) does not hold this up.
        SELECT array_agg(u.o) INTO v_heads
        FROM unnest(v_t, v_k, v_q, v_id) WITH ORDINALITY AS u(t, k, q, id, o)
        CROSS JOIN LATERAL (SELECT 1 FROM outbox_ordering_key x
                            WHERE x.tenant_id = u.t AND x.ordering_key = u.k AND x.queue = u.q AND x.head_job_id = u.id
                            FOR NO KEY UPDATE) l;

        -- A new snapshot, taken with the rows locked: release the first in
        -- line of each of those keys where it waits as it was queued.
        -- Every lookup goes by primary key or by ctid (of rows this
        -- transaction has locked, or that only a release of their key,
        -- which it holds, deletes).
        WITH heads AS (
            SELECT u.t, u.k, u.q, u.o, h.kctid FROM unnest(v_t, v_k, v_q, v_id) WITH ORDINALITY AS u(t, k, q, id, o)
            CROSS JOIN LATERAL (SELECT x.ctid AS kctid FROM outbox_ordering_key x
                                WHERE x.tenant_id = u.t AND x.ordering_key = u.k AND x.queue = u.q AND x.head_job_id = u.id
                                LIMIT 1) h
        ), firsts AS MATERIALIZED (
            SELECT h.o, h.q, h.kctid, w.* FROM heads h
            CROSS JOIN LATERAL (SELECT y.ctid AS wctid, y.position, y.job_id, y.event_id,
                                       y.args, y.created_at, y.kind, y.max_attempts, y.metadata, y.priority, y.tags
                                FROM outbox_ordering_wait y
                                WHERE y.tenant_id = h.t AND y.ordering_key = h.k AND y.queue = h.q
                                ORDER BY y.position, y.job_id LIMIT 1) w
        ), released_in_line AS (
            -- 024: a job that waited in the line enters River, available,
            -- with the id the handoff gave it. The enqueue trigger skips
            -- it (this transaction's id is in outbox.ordering_release).
            INSERT INTO river_job (id, args, created_at, kind, max_attempts, metadata, priority, queue, scheduled_at, state, tags)
            SELECT f.job_id, f.args, f.created_at, f.kind, f.max_attempts, f.metadata, f.priority, f.q, now(), 'available', f.tags
            FROM firsts f WHERE f.kind IS NOT NULL
            ORDER BY f.o
            RETURNING id, queue
        ), released_pending AS (
            -- A job queued before 024, or not shaped as the handoff's:
            -- River's pending row, made available where it waits as it
            -- was queued.
            UPDATE river_job SET state = 'available', scheduled_at = now()
            WHERE id = ANY(ARRAY(SELECT job_id FROM firsts WHERE kind IS NULL)) AND state::text = 'pending'
            RETURNING id, queue
        ), released AS (
            SELECT id, queue FROM released_in_line UNION ALL SELECT id, queue FROM released_pending
        ), taken AS MATERIALIZED (
            SELECT f.* FROM firsts f JOIN released r ON r.id = f.job_id
        ), unqueued AS (
            DELETE FROM outbox_ordering_wait y USING taken t WHERE y.ctid = t.wctid
        ), heads_moved AS (
            UPDATE outbox_ordering_key x
            SET head_job_id = t.job_id, head_event_id = t.event_id, head_position = t.position, head_since = now(),
                parked_at = NULL, parked_state = NULL, idle_since = NULL
            FROM taken t WHERE x.ctid = t.kctid
        )
        SELECT (SELECT array_agg(DISTINCT queue) FROM released), (SELECT array_agg(o) FROM taken)
        INTO v_queues, v_moved;

        -- River's insert notification, once per queue: its workers fetch
        -- the released jobs at once.
        PERFORM pg_notify(current_schema() || '.river_insert', json_build_object('queue', q)::text)
        FROM unnest(v_queues) AS q;

        -- The keys locked above whose head did not move: their line is
        -- empty (as far as that snapshot saw) or its first job was changed
        -- by hand. outbox_ordering_advance takes the careful path, in the
        -- order given. (Taken from the arrays, not from the key table: a
        -- generic plan of a join with it, made while it was small, read
        -- the whole table.)
        FOR v_rest IN
            SELECT u.t, u.k, u.q FROM unnest(v_t, v_k, v_q) WITH ORDINALITY AS u(t, k, q, o)
            WHERE u.o = ANY(v_heads) AND NOT (u.o = ANY(coalesce(v_moved, '{}')))
            ORDER BY u.o
        LOOP
            PERFORM outbox_ordering_advance(v_rest.t, v_rest.k, v_rest.q, current_schema()::text);
        END LOOP;
    END IF;

    PERFORM set_config('outbox.ordering_release', '', true);
    RETURN v_n;
END
$$;

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'outbox_ordering_enqueue()',
        'outbox_ordering_advance(text, text, text, text)',
        'outbox_ordering_complete(bigint[])']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    ALTER FUNCTION outbox_ordering_complete(bigint[]) SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION outbox_ordering_complete(bigint[]) SET enable_seqscan = off;
END
$$;

COMMIT;
