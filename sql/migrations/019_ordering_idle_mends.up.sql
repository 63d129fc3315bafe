-- 019: two mends of 018's idle keys (docs/ordering.md, "Limits"), found in
-- review. Same tables and guarantee.
--
-- - outbox_ordering_complete's group path (017) moves a key's head without
--   clearing idle_since, which 018 clears wherever outbox_ordering_advance
--   moves a head. A key goes idle only when its head is done, so the group
--   path meets an idle key only when that head was retried by hand (River
--   UI, Client.JobRetry) and completed again; it then released the first
--   job in line and left the mark, and the dispatcher's wake released the
--   next one beside it. The function below is 017's, restated whole
--   (CREATE OR REPLACE takes the whole body and resets the function's
--   settings, set again at the end), with idle_since = NULL where the head
--   moves.
-- - outbox_ordering_wake releases the next job only when the key's head is
--   done (completed, cancelled or discarded, or deleted) and the key is not
--   parked. A head retried by hand while its key was idle runs again: its
--   own completion releases the next job, as before the key went idle. A
--   key parked after it went idle (by such a retried head) stays parked
--   for outboxctl unpark. In both cases the wake only clears the mark.
--
-- One transaction.

BEGIN;
SET LOCAL lock_timeout = '10s';

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

-- outbox_ordering_wake releases an idle key again, at READ COMMITTED:
-- returns false when the key is not idle or another session holds it.
CREATE OR REPLACE FUNCTION outbox_ordering_wake(p_tenant text, p_key text, p_queue text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    v_tenant text COLLATE "default" := p_tenant;
    v_key    text COLLATE "default" := p_key;
    v_queue  text COLLATE "default" := p_queue;
    v_head   bigint;
    v_parked boolean;
    v_state  text;
BEGIN
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
        RAISE EXCEPTION 'outbox_ordering_wake needs READ COMMITTED, not %', current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    SELECT k.head_job_id, k.parked_at IS NOT NULL INTO v_head, v_parked FROM outbox_ordering_key k
    WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue AND k.idle_since IS NOT NULL
    FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE outbox_ordering_key k SET idle_since = NULL
    WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue;
    IF v_parked THEN
        RETURN true; -- parked after it went idle: unpark decides
    END IF;
    SELECT r.state::text INTO v_state FROM river_job r WHERE r.id = v_head;
    IF FOUND AND v_state NOT IN ('completed', 'cancelled', 'discarded') THEN
        RETURN true; -- the head runs again: its completion releases
    END IF;
    PERFORM outbox_ordering_advance(v_tenant, v_key, v_queue, current_schema()::text);
    RETURN true;
END
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_ordering_complete(bigint[]) SET search_path = %I, pg_temp', current_schema());
    ALTER FUNCTION outbox_ordering_complete(bigint[]) SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION outbox_ordering_complete(bigint[]) SET enable_seqscan = off;
    REVOKE ALL ON FUNCTION outbox_ordering_complete(bigint[]) FROM PUBLIC;
    EXECUTE format('ALTER FUNCTION outbox_ordering_wake(text, text, text) SET search_path = %I, pg_temp', current_schema());
    REVOKE ALL ON FUNCTION outbox_ordering_wake(text, text, text) FROM PUBLIC;
END
$$;

COMMIT;
