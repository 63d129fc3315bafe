-- 013: the handoff no longer makes a key's release wait for it. Same
-- guarantee and same tables as 011 and 012; four functions are replaced
-- (docs/ordering.md, "How it works"):
--
-- - outbox_ordering_enqueue locks an existing key row FOR KEY SHARE, not
--   FOR UPDATE. A handoff that queues jobs behind a head holds that lock
--   until its batch commits; under 011 and 012 the release of the key's
--   head (which locked the row FOR UPDATE) waited for that commit, and a
--   hot key's next job started a whole handoff batch late.
-- - outbox_ordering_settled locks the head's row FOR NO KEY UPDATE, which
--   a handoff's FOR KEY SHARE does not block, and the release's updates of
--   the row (it changes no key column) take the same lock.
-- - outbox_ordering_advance, when it finds no job in line, locks the row
--   FOR UPDATE, which waits for every handoff still queueing behind the
--   head, and then looks again in a new statement (a new snapshot: the
--   jobs those handoffs queued are visible once they commit). Only then
--   does it delete the key's row. A released job is always the first in
--   line of the committed queue: the claim hands an event off only when
--   every earlier event of its key was handed off before (011's header), so
--   a handoff still in flight only queues jobs behind those already
--   committed.
--
-- - outbox_unpark locks a key's parked rows in byte order (COLLATE "C"),
--   the order in which a handoff locks them (internal/lockorder); 011
--   sorted them by the database's collation, in which two queue names can
--   sort the other way round.
--
-- Deadlock freedom is unchanged: a release waits for a handoff only in the
-- FOR UPDATE of a key it is about to delete, a handoff waits for a release
-- only at a key that release holds FOR UPDATE (to delete it), and both take
-- their keys in internal/lockorder's order.
--
-- One transaction. CREATE OR REPLACE keeps the triggers and grants of the
-- functions it replaces but not their settings: search_path is set again
-- at the end, as in 011 and 012.

BEGIN;
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE FUNCTION outbox_ordering_enqueue() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    v_tenant text   := coalesce(NEW.metadata->>'outbox_tenant_id', '');
    v_key    text   := NEW.metadata->>'outbox_ordering_key';
    v_event  bigint := (NEW.metadata->>'outbox_event_id')::bigint;
    v_pos    bigint := coalesce((NEW.metadata->>'outbox_ordering_position')::bigint, NEW.id);
BEGIN
    -- The key's row is locked until this transaction ends, as its inserter
    -- or FOR KEY SHARE: the release of its head may update the row
    -- meanwhile, but cannot delete it (outbox_ordering_advance locks it FOR
    -- UPDATE before it does, and looks for waiting jobs again once this
    -- transaction has committed).
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
    INSERT INTO outbox_ordering_wait (tenant_id, ordering_key, queue, position, job_id, event_id)
    VALUES (v_tenant, v_key, NEW.queue, v_pos, NEW.id, v_event);
    NEW.state := 'pending';
    RETURN NEW;
END
$$;

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
        UPDATE river_job r SET state = 'available', scheduled_at = now() WHERE r.id = w.job_id AND r.state = 'pending';
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

CREATE OR REPLACE FUNCTION outbox_ordering_settled() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    v_tenant text := coalesce(NEW.metadata->>'outbox_tenant_id', '');
    v_key    text := NEW.metadata->>'outbox_ordering_key';
    v_parked timestamptz;
BEGIN
    -- Only the head's row matters; a waiting job cancelled by hand is dealt
    -- with when its turn comes (outbox_ordering_advance). FOR NO KEY
    -- UPDATE: a handoff queueing jobs behind the head (FOR KEY SHARE) does
    -- not hold this up.
    SELECT x.parked_at INTO v_parked FROM outbox_ordering_key x
    WHERE x.tenant_id = v_tenant AND x.ordering_key = v_key AND x.queue = NEW.queue AND x.head_job_id = NEW.id
    FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NEW.state = 'completed' THEN
        PERFORM outbox_ordering_advance(v_tenant, v_key, NEW.queue, TG_TABLE_SCHEMA::text);
    ELSIF NEW.state IN ('discarded', 'cancelled') THEN
        UPDATE outbox_ordering_key x SET parked_at = coalesce(x.parked_at, now()), parked_state = NEW.state::text
        WHERE x.tenant_id = v_tenant AND x.ordering_key = v_key AND x.queue = NEW.queue;
    ELSIF v_parked IS NOT NULL THEN
        -- The parked head runs again (River's retry, or outbox_unpark).
        UPDATE outbox_ordering_key x SET parked_at = NULL, parked_state = NULL
        WHERE x.tenant_id = v_tenant AND x.ordering_key = v_key AND x.queue = NEW.queue;
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION outbox_unpark(
    actor        text,
    dry_run      boolean,
    ordering_key text,
    action       text,
    tenant_id    text DEFAULT NULL,
    queue        text DEFAULT NULL,
    reason       text DEFAULT NULL
) RETURNS TABLE (o_queue text, o_head_job_id bigint, o_head_event_id bigint, o_parked_state text, o_waiting bigint, o_audit_id bigint)
LANGUAGE plpgsql SECURITY DEFINER AS $$
#variable_conflict use_variable
DECLARE
    k          record;
    v_affected int := 0;
    v_rows     jsonb := '[]';
    v_audit_id bigint;
    v_schema   text := current_schema();
BEGIN
    IF actor IS NULL OR octet_length(actor) NOT BETWEEN 1 AND 256 THEN
        RAISE EXCEPTION 'outbox_unpark: actor must be 1 to 256 bytes' USING ERRCODE = '22023';
    END IF;
    IF dry_run IS NULL THEN
        RAISE EXCEPTION 'outbox_unpark: dry_run is required' USING ERRCODE = '22023';
    END IF;
    IF ordering_key IS NULL THEN
        RAISE EXCEPTION 'outbox_unpark: ordering_key is required' USING ERRCODE = '22023';
    END IF;
    IF action IS NULL OR action NOT IN ('retry', 'skip') THEN
        RAISE EXCEPTION 'outbox_unpark: action must be retry or skip (got %)', coalesce(quote_literal(action), 'NULL')
            USING ERRCODE = '22023', HINT = 'retry runs the parked head job again; skip leaves it and releases the next job of the key';
    END IF;
    FOR k IN
        SELECT x.*, (SELECT count(*) FROM outbox_ordering_wait w
                     WHERE w.tenant_id = x.tenant_id AND w.ordering_key = x.ordering_key AND w.queue = x.queue) AS waiting
        FROM outbox_ordering_key x
        WHERE x.tenant_id = coalesce(outbox_unpark.tenant_id, '') AND x.ordering_key = outbox_unpark.ordering_key
          AND (outbox_unpark.queue IS NULL OR x.queue = outbox_unpark.queue)
          AND x.parked_at IS NOT NULL
        -- Byte order (COLLATE "C"), the order in which a handoff locks
        -- the key's rows (internal/lockorder): under the database's
        -- collation two queues can sort the other way, and an unpark of
        -- every queue of a key could deadlock with a handoff into them.
        ORDER BY x.queue COLLATE "C"
        FOR UPDATE
    LOOP
        IF action = 'retry' AND k.parked_state = 'deleted' THEN
            RAISE EXCEPTION 'outbox_unpark: the head job % of key % in queue % was deleted and cannot be retried', k.head_job_id, quote_literal(k.ordering_key), quote_literal(k.queue)
                USING ERRCODE = '22023', HINT = 'skip it, and requeue its event (allow replay) if it must still run';
        END IF;
        IF NOT dry_run THEN
            IF action = 'retry' THEN
                -- The settled trigger clears the parking when the state changes.
                UPDATE river_job r
                SET state = 'available', scheduled_at = now(), finalized_at = NULL,
                    max_attempts = greatest(r.max_attempts, r.attempt + 1),
                    -- River's own retry drops its cancel mark too: left in
                    -- place, River cancels the job at its next failure.
                    metadata = r.metadata - 'cancel_attempted_at'
                WHERE r.id = k.head_job_id;
                IF NOT FOUND THEN
                    RAISE EXCEPTION 'outbox_unpark: the head job % of key % in queue % no longer exists (River''s cleaner deletes old discarded jobs) and cannot be retried', k.head_job_id, quote_literal(k.ordering_key), quote_literal(k.queue)
                        USING ERRCODE = '22023', HINT = 'skip it, and requeue its event (allow replay) if it must still run';
                END IF;
                PERFORM pg_notify(v_schema || '.river_insert', json_build_object('queue', k.queue)::text);
            ELSE
                PERFORM outbox_ordering_advance(k.tenant_id, k.ordering_key, k.queue, v_schema);
            END IF;
        END IF;
        v_affected := v_affected + 1;
        v_rows := v_rows || jsonb_build_object('queue', k.queue, 'head_job_id', k.head_job_id, 'head_event_id', k.head_event_id,
                                               'parked_state', k.parked_state, 'waiting', k.waiting);
    END LOOP;
    IF NOT dry_run AND v_affected > 0 THEN
        INSERT INTO outbox_audit (actor, db_user, action, filter, affected, detail)
        VALUES (actor, session_user, 'unpark',
                jsonb_strip_nulls(jsonb_build_object('ordering_key', ordering_key, 'tenant', tenant_id, 'queue', queue, 'action', action)),
                v_affected,
                jsonb_strip_nulls(jsonb_build_object('keys', v_rows, 'reason', reason)))
        RETURNING id INTO v_audit_id;
    END IF;
    RETURN QUERY
    SELECT r.queue, r.head_job_id, r.head_event_id, r.parked_state, r.waiting, v_audit_id
    FROM jsonb_to_recordset(v_rows) AS r(queue text, head_job_id bigint, head_event_id bigint, parked_state text, waiting bigint);
END
$$;

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'outbox_ordering_enqueue()',
        'outbox_ordering_advance(text, text, text, text)',
        'outbox_ordering_settled()',
        'outbox_unpark(text, boolean, text, text, text, text, text)']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

COMMIT;
