-- 018: a release above READ COMMITTED no longer strands a job. A key whose
-- line looks empty to such a release is marked idle instead of deleted, and
-- outboxd wakes it at READ COMMITTED (docs/ordering.md, "Limits").
--
-- The release of a key whose line looks empty (outbox_ordering_advance)
-- waits for the handoffs that hold the key's row FOR KEY SHARE, which may
-- have queued jobs that its snapshot does not show, and then looks again.
-- Only a READ COMMITTED statement, whose snapshot is taken after that wait,
-- sees those jobs. At REPEATABLE READ or SERIALIZABLE (a role or database
-- with default_transaction_isolation set so, River's completer or River UI
-- running there, a worker's own transaction completing its job) the
-- release deleted the key's row and left the job pending with nothing to
-- release it, and the key's next event became a head of its own and ran
-- before it. The outbox's own transactions run at READ COMMITTED since the
-- commit before this migration; this one covers everything else:
--
-- - outbox_ordering_advance, above READ COMMITTED, leaves the key's row
--   where it is and sets its new column idle_since (and ends a parking:
--   the parked head is done, as when the row was deleted), when the line
--   looks empty. A handoff that queues a job behind the key later finds
--   the row and queues behind it, as before: nothing overtakes a stranded
--   job. (Postgres runs READ UNCOMMITTED as READ COMMITTED: both count as
--   READ COMMITTED here.)
-- - outbox_ordering_wake(tenant, key, queue), at READ COMMITTED only, takes
--   an idle key (SKIP LOCKED), clears idle_since and runs the release again
--   there: the first job in line becomes the head, or, with none, the row
--   goes. The dispatcher runs it every second for the idle keys, keys with
--   jobs in line first, and again at once while it finds a full batch
--   (outbox_ordering_key_idle_idx: nothing to read when there are none), so
--   such a key's next job starts about a second late rather than never.
-- - At READ COMMITTED nothing changes: the release never marks a key idle.
--
-- outbox_ordering_advance below is 014's, restated whole (CREATE OR
-- REPLACE takes the whole body) with two changes: the idle branch when the
-- line looks empty above READ COMMITTED, and idle_since = NULL where the
-- head moves.
--
-- One transaction. ADD COLUMN of a nullable column without a default
-- takes an ACCESS EXCLUSIVE lock on outbox_ordering_key for a moment, and
-- the index is built in the transaction (the table holds one row per key
-- with unfinished jobs). The index is not unique: the release's updates of
-- the row keep their FOR NO KEY UPDATE lock, which handoffs do not wait
-- for (013).

BEGIN;
SET LOCAL lock_timeout = '10s';

ALTER TABLE outbox_ordering_key ADD COLUMN IF NOT EXISTS idle_since timestamptz;
CREATE INDEX IF NOT EXISTS outbox_ordering_key_idle_idx ON outbox_ordering_key (idle_since) WHERE idle_since IS NOT NULL;

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
        -- The common case: the job waits as it was queued.
        -- By primary key only: state::text is no index condition (014's
        -- header).
        UPDATE river_job r SET state = 'available', scheduled_at = now() WHERE r.id = w.job_id AND r.state::text = 'pending';
        IF FOUND THEN
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

-- outbox_ordering_wake releases an idle key again, at READ COMMITTED:
-- returns false when the key is not idle or another session holds it.
CREATE OR REPLACE FUNCTION outbox_ordering_wake(p_tenant text, p_key text, p_queue text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    v_tenant text COLLATE "default" := p_tenant;
    v_key    text COLLATE "default" := p_key;
    v_queue  text COLLATE "default" := p_queue;
BEGIN
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
        RAISE EXCEPTION 'outbox_ordering_wake needs READ COMMITTED, not %', current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    PERFORM 1 FROM outbox_ordering_key k
    WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue AND k.idle_since IS NOT NULL
    FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE outbox_ordering_key k SET idle_since = NULL
    WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = v_queue;
    PERFORM outbox_ordering_advance(v_tenant, v_key, v_queue, current_schema()::text);
    RETURN true;
END
$$;

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'outbox_ordering_advance(text, text, text, text)',
        'outbox_ordering_wake(text, text, text)']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

GRANT EXECUTE ON FUNCTION outbox_ordering_wake(text, text, text) TO outbox_dispatcher, outbox_operator;

COMMIT;
