-- 012: a cheaper release of ordered jobs. Same guarantee and same tables as
-- 011; three of its functions are replaced with ones that do less work per
-- job, and one is added (docs/ordering.md, "Speed and cost"):
--
-- - outbox_ordering_advance compares the key in the default collation.
--   011's trigger called it with TG_TABLE_SCHEMA (type name, collation
--   "C") among the arguments, so its text parameters took collation "C",
--   no index served its lookups, and every release read the whole wait
--   queue and key table: the cost of a release grew with the number of
--   waiting jobs (about 15 ms each at 90,000).
-- - outbox_ordering_hold probes outbox_ordering_wait by the job's whole
--   primary key (its position is in the job's metadata). 011 looked for the
--   job among all the waiting jobs of its key, and it runs at every release
--   (the released job's own state change fires it): a hot key with n
--   waiting jobs paid n index entries per release, n²/2 for its backlog.
-- - outbox_ordering_advance takes the first job in line off the wait
--   queue in one statement and makes it available with one UPDATE that
--   checks its state, instead of a read, a delete, a row lock and an
--   update; the unusual cases (a waiting job cancelled, completed or deleted
--   by hand) still take the careful path.
-- - outbox_ordering_settled reads and locks the key's row only for the
--   head, in one statement.
-- - outbox_ordering_complete(ids), new, completes running jobs in the
--   order given, in one call: outboxriver's completion middleware writes a
--   group of ordered jobs with it instead of one River completion
--   statement per job.
--
-- One transaction. CREATE OR REPLACE keeps the triggers and grants of the
-- functions it replaces but not their settings: search_path is set again
-- at the end, as in 011.

BEGIN;
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE FUNCTION outbox_ordering_hold() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    -- The position is the one outbox_ordering_enqueue queued the job with
    -- (the same expression).
    IF EXISTS (SELECT 1 FROM outbox_ordering_wait w
               WHERE w.tenant_id = coalesce(NEW.metadata->>'outbox_tenant_id', '')
                 AND w.ordering_key = NEW.metadata->>'outbox_ordering_key'
                 AND w.queue = NEW.queue
                 AND w.position = coalesce((NEW.metadata->>'outbox_ordering_position')::bigint, NEW.id)
                 AND w.job_id = NEW.id) THEN
        NEW.state := 'pending';
        NEW.scheduled_at := OLD.scheduled_at;
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION outbox_ordering_advance(p_tenant text, p_key text, p_queue text, p_schema text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    -- The keys in the database's default collation, whatever the call's:
    -- a function's text parameters take the collation of its arguments,
    -- and TG_TABLE_SCHEMA (type name, collation "C") among them made 011's
    -- comparisons "C", which no index of the default collation serves.
    v_tenant text COLLATE "default" := p_tenant;
    v_key    text COLLATE "default" := p_key;
    v_queue  text COLLATE "default" := p_queue;
    w        record;
    v_state  text;
    v_found  boolean;
BEGIN
    LOOP
        -- The first in line, taken off the queue. No other transaction
        -- changes the key's wait rows meanwhile: each holds the key's row
        -- lock, as the caller does.
        DELETE FROM outbox_ordering_wait x
        WHERE x.ctid = (SELECT y.ctid FROM outbox_ordering_wait y
                        WHERE y.tenant_id = v_tenant AND y.ordering_key = v_key AND y.queue = v_queue
                        ORDER BY y.position, y.job_id LIMIT 1)
        RETURNING x.position, x.job_id, x.event_id INTO w;
        IF NOT FOUND THEN
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
    -- with when its turn comes (outbox_ordering_advance).
    SELECT x.parked_at INTO v_parked FROM outbox_ordering_key x
    WHERE x.tenant_id = v_tenant AND x.ordering_key = v_key AND x.queue = NEW.queue AND x.head_job_id = NEW.id
    FOR UPDATE;
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

-- outbox_ordering_complete completes the jobs of p_ids that are running,
-- one after the other in the order given (the caller sorts them by key, so
-- that the key rows the release trigger locks are taken in the order the
-- handoff takes them), and returns how many it completed: outboxriver's
-- completion middleware writes a group of ordered jobs with one call
-- instead of one River completion statement per job. It runs as its
-- caller (who must be allowed to update river_job, as River's workers
-- are); the release is the trigger's, as for any completion. finalized_at
-- is the transaction's time. A job that is not running is left as it is;
-- the work's metadata updates (River's RecordOutput) are merged by River's
-- completer afterwards, which writes them to a finalized job too.
--
-- Its transaction commits without waiting for the WAL flush
-- (synchronous_commit off, until the transaction ends): a job that the
-- trigger releases can only start after River's fetch of it commits, and
-- that commit (synchronous, as River's are) flushes the WAL up to and
-- including this one. A crash before that loses the completions and the
-- releases together: the jobs run again (River's at-least-once, as when a
-- worker dies before River's completer writes), and the next jobs of their
-- keys have not started. Called on its own (autocommit), it is the whole
-- transaction: one round trip.
CREATE OR REPLACE FUNCTION outbox_ordering_complete(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
    v_n  integer := 0;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    FOREACH v_id IN ARRAY p_ids LOOP
        UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = v_id AND state = 'running';
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
        'outbox_ordering_hold()',
        'outbox_ordering_advance(text, text, text, text)',
        'outbox_ordering_settled()',
        'outbox_ordering_complete(bigint[])']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

GRANT EXECUTE ON FUNCTION outbox_ordering_complete(bigint[]) TO outbox_dispatcher;

COMMIT;
