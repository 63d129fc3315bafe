-- 017: outbox_ordering_complete releases a group's next jobs with a few
-- statements for the whole group, not one trigger call per job. Same
-- guarantee and same tables as 011-014 (docs/ordering.md, "Speed and
-- cost").
--
-- Until 017, outbox_ordering_complete updated its jobs one by one, and each
-- completion ran the settled trigger, which ran outbox_ordering_advance,
-- whose UPDATE of the released job ran the hold trigger: three SECURITY
-- DEFINER calls with their search_path setting and about ten statements
-- per job. Measured in one session on a production-like cluster (5,000
-- keys, each head completed in groups of 16 with its next job waiting):
-- 0.18-0.32 ms per job before, 0.07-0.12 ms with 017; in the bench's
-- many-keys drain, a quarter less of the database's CPU per event.
--
-- - outbox_ordering_complete(ids) of two jobs or more completes its
--   running jobs with one UPDATE, locks the key rows whose head they are
--   (in the order given: outboxriver's middleware sorts a group in byte
--   order, the order in which a handoff locks keys), and then, in a
--   statement of its own (a snapshot taken with the rows locked), takes
--   the first job in line of each key, makes it available, deletes it from
--   the line and makes it the key's head; then one NOTIFY per queue. A key
--   whose line is empty, or whose first job in line is no longer pending
--   (changed by hand), goes through outbox_ordering_advance as before,
--   which waits for handoffs still queueing behind it and then deletes the
--   key's row, or parks the key.
-- - A group of one job (a hot key's: one job at a time) is completed by
--   one UPDATE whose triggers release the next job, as before 017: for one
--   job the statements above cost more than the triggers (hot key, 10,000
--   events: 0.75 against 0.55 ms per call in the server).
-- - The settled and hold triggers skip the changes made by the group path:
--   their WHEN clauses compare the setting outbox.ordering_release with
--   the id of the transaction, and the function sets it to that id for the
--   length of its call (transaction-local, emptied before it returns).
--   Every other change of a job's state (River's completer, its executor,
--   River UI, outbox_unpark) fires them as before. A value set by hand, in
--   a session, a role's or a database's settings, disables nothing: only
--   the id of the very transaction that makes the change does.
-- - It is now SECURITY DEFINER: it reads and writes the ordering tables,
--   on which the worker's role has no rights, as the trigger functions
--   always did.
-- - Its statements take arrays and are planned once per session
--   (plan_cache_mode force_generic_plan: custom plans cost 0.2 ms of
--   planning per call) with enable_seqscan off. A generic plan is made with
--   the statistics of its first call: planned while River's table was
--   nearly empty, it read the whole table for each call ever after
--   (measured: 1.3 ms per call for a hot key). Every row it touches is
--   found by primary key or by ctid, whatever the statistics: River's rows
--   by `id = ANY(...)`, the key and wait rows by LATERAL lookups with
--   LIMIT or FOR NO KEY UPDATE, which stay nested loops (a semi-join with
--   the key table, planned while it held a few keys, scanned its whole
--   index; enable_seqscan off does not prevent that).
--
-- One transaction. Recreating the two triggers takes a SHARE ROW EXCLUSIVE
-- lock on river_job for a moment.

BEGIN;
SET LOCAL lock_timeout = '10s';

DROP TRIGGER outbox_ordering_hold ON river_job;
CREATE TRIGGER outbox_ordering_hold
    BEFORE UPDATE OF state ON river_job
    FOR EACH ROW WHEN (OLD.state IN ('pending', 'cancelled', 'discarded') AND NEW.state IN ('available', 'scheduled', 'retryable', 'running')
                       AND NEW.metadata ? 'outbox_ordering_key'
                       AND current_setting('outbox.ordering_release', true) IS DISTINCT FROM txid_current_if_assigned()::text)
    EXECUTE FUNCTION outbox_ordering_hold();

DROP TRIGGER outbox_ordering_settled ON river_job;
CREATE TRIGGER outbox_ordering_settled
    AFTER UPDATE OF state ON river_job
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state
                       AND (NEW.state IN ('completed', 'discarded', 'cancelled') OR OLD.state IN ('discarded', 'cancelled'))
                       AND NEW.metadata ? 'outbox_ordering_key'
                       AND current_setting('outbox.ordering_release', true) IS DISTINCT FROM txid_current_if_assigned()::text)
    EXECUTE FUNCTION outbox_ordering_settled();

-- Its transaction commits without waiting for the WAL flush, as 012's did
-- (012's comment says why that loses nothing). Called on its own
-- (autocommit), it is the whole transaction: one round trip. Returns how
-- many of the jobs it completed (those that were running).
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
            SELECT h.o, h.kctid, w.wctid, w.position, w.job_id, w.event_id FROM heads h
            CROSS JOIN LATERAL (SELECT y.ctid AS wctid, y.position, y.job_id, y.event_id FROM outbox_ordering_wait y
                                WHERE y.tenant_id = h.t AND y.ordering_key = h.k AND y.queue = h.q
                                ORDER BY y.position, y.job_id LIMIT 1) w
        ), released AS (
            UPDATE river_job SET state = 'available', scheduled_at = now()
            WHERE id = ANY(ARRAY(SELECT job_id FROM firsts)) AND state::text = 'pending'
            RETURNING id, queue
        ), taken AS MATERIALIZED (
            SELECT f.* FROM firsts f JOIN released r ON r.id = f.job_id
        ), unqueued AS (
            DELETE FROM outbox_ordering_wait y USING taken t WHERE y.ctid = t.wctid
        ), heads_moved AS (
            UPDATE outbox_ordering_key x
            SET head_job_id = t.job_id, head_event_id = t.event_id, head_position = t.position, head_since = now(),
                parked_at = NULL, parked_state = NULL
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
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_ordering_complete(bigint[]) SET search_path = %I, pg_temp', current_schema());
    ALTER FUNCTION outbox_ordering_complete(bigint[]) SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION outbox_ordering_complete(bigint[]) SET enable_seqscan = off;
    REVOKE ALL ON FUNCTION outbox_ordering_complete(bigint[]) FROM PUBLIC;
END
$$;

GRANT EXECUTE ON FUNCTION outbox_ordering_complete(bigint[]) TO outbox_dispatcher;

COMMIT;
