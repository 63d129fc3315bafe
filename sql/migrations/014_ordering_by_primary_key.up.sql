-- 014: the ordered completion and release update River's row by its
-- primary key, whatever the statistics say. Same guarantee and same tables
-- as 011-013; two functions are replaced (docs/ordering.md, "Speed and
-- cost"):
--
-- - outbox_ordering_complete updated each job WHERE id = v_id AND state =
--   'running', and outbox_ordering_advance each released job WHERE r.id =
--   w.job_id AND r.state = 'pending'. Both are index conditions of River's
--   river_job_prioritized_fetching_index (state, queue, priority,
--   scheduled_at, id). PL/pgSQL plans such a statement with the job's id
--   known (a custom plan, which then stays cheaper than the generic one),
--   and where the statistics make the state rare, as 'running' always is,
--   the planner prefers that index to the primary key: the scan then reads
--   every entry of the state, the dead ones of every job that has left it
--   since the last vacuum included, to find one id. perf of a many-keys
--   drain put 12 % of the database's CPU there. Comparing state::text
--   leaves the primary key as the only index that serves the statement.
--
-- One transaction. CREATE OR REPLACE keeps the triggers and grants of the
-- functions it replaces but not their settings: search_path is set again
-- at the end, as in 011-013.

BEGIN;
SET LOCAL lock_timeout = '10s';

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
BEGIN
    LOOP
        -- The first in line, taken off the queue. The caller holds the
        -- key's row FOR NO KEY UPDATE (or FOR UPDATE): no other release
        -- runs; a handoff may be queueing jobs behind, all after this one.
        DELETE FROM outbox_ordering_wait x
        WHERE x.ctid = (SELECT y.ctid FROM outbox_ordering_wait y
                        WHERE y.tenant_id = v_tenant AND y.ordering_key = v_key AND y.queue = v_queue
                        ORDER BY y.position, y.job_id LIMIT 1)
        RETURNING x.position, x.job_id, x.event_id INTO w;
        IF NOT FOUND THEN
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
        -- The common case: the job waits as it was queued.
        -- By primary key only: state::text is no index condition (014's
        -- header).
        UPDATE river_job r SET state = 'available', scheduled_at = now() WHERE r.id = w.job_id AND r.state::text = 'pending';
        IF FOUND THEN
            UPDATE outbox_ordering_key k
            SET head_job_id = w.job_id, head_event_id = w.event_id, head_position = w.position, head_since = now(),
                parked_at = NULL, parked_state = NULL
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
            parked_state = CASE WHEN NOT v_found THEN 'deleted' WHEN v_state IN ('cancelled', 'discarded') THEN v_state END
        WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue;
        RETURN;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION outbox_ordering_complete(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
    v_n  integer := 0;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    FOREACH v_id IN ARRAY p_ids LOOP
        -- By primary key only: state::text is no index condition (014's
        -- header).
        UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = v_id AND state::text = 'running';
        IF FOUND THEN
            v_n := v_n + 1;
        END IF;
    END LOOP;
    RETURN v_n;
END
$$;

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'outbox_ordering_advance(text, text, text, text)',
        'outbox_ordering_complete(bigint[])']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

COMMIT;
