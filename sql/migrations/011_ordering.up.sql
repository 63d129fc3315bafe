-- outbox:no-transaction
-- 011: per-key ordering. An event may carry an ordering key; for the events
-- of one (tenant, ordering key), and for each River queue they are routed
-- to, the River jobs are worked one at a time and in order: the job of the
-- next event does not start until the job of the one before it is
-- finalized. docs/ordering.md states the guarantee; this header says how
-- the data enforces it.
--
-- Order. Each keyed event gets an ordering_position from one sequence,
-- taken by a BEFORE INSERT trigger (outbox_event_ordering) after it has
-- taken a transaction-scoped advisory lock on the (schema, tenant, key).
-- The lock is held until the producer's transaction ends, so two
-- transactions that publish to one key run their publishes one after the
-- other: positions within a key follow commit order across transactions and
-- publish order within one. Every path (outbox_publish, outbox_publish_many,
-- outbox.Publish, a plain INSERT) goes through the trigger. Events without a
-- key never fire it (WHEN clause) and have no position.
--
-- Handoff. The claim (package claim) hands an event with a key off only
-- when no earlier event of its key (lower position) is still pending,
-- processing or failed outside its own batch: a later event never overtakes
-- an earlier one that is locked by another batch, not yet due, backing off
-- or dead-lettered. Within a batch the jobs of a key are inserted in
-- position order. outbox_event_ordering_idx serves that check; it is
-- partial, so unkeyed events and handed-off ones cost it nothing.
--
-- Jobs. A River job whose metadata carries outbox_ordering_key is an
-- ordered job. A BEFORE INSERT trigger on river_job (outbox_ordering_enqueue)
-- makes it the head of its (tenant, key, queue) in outbox_ordering_key when
-- the key has no unfinished job, and otherwise inserts it in River's
-- 'pending' state (which River's producers never fetch) and queues it in
-- outbox_ordering_wait by position. An AFTER UPDATE trigger
-- (outbox_ordering_settled) runs in the transaction that finalizes the head:
--   completed            -> the next waiting job becomes 'available' and
--                           the head, and River's insert notification for
--                           its queue is sent in that transaction, so a
--                           worker fetches it at once; no job waiting ->
--                           the key's row is deleted.
--   discarded, cancelled -> the key is parked: its later jobs stay pending
--                           until an operator retries or skips the head
--                           (outbox_unpark, or River's own retry of the
--                           head job, which unparks it).
-- A retrying job (retryable, scheduled) holds its key. Both triggers have
-- WHEN clauses on the metadata key, so jobs without it (every job when
-- ordering is unused) run no trigger code and send no NOTIFY; ordered jobs
-- pay the NOTIFY only when a waiting job is released.
--
-- The steps: the columns (a short transaction), the index (CONCURRENTLY, on
-- a live table without blocking producers), then everything else in one
-- transaction. Every statement is idempotent: an interrupted run is
-- repeated from the start.

BEGIN;
SET LOCAL lock_timeout = '10s';
ALTER TABLE outbox_event ADD COLUMN IF NOT EXISTS ordering_key text;
ALTER TABLE outbox_event ADD COLUMN IF NOT EXISTS ordering_position bigint;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'outbox_event'::regclass AND conname = 'outbox_event_ordering_key_length') THEN
        ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_ordering_key_length
            CHECK (octet_length(ordering_key) BETWEEN 1 AND 256) NOT VALID;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'outbox_event'::regclass AND conname = 'outbox_event_ordering_position_set') THEN
        ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_ordering_position_set
            CHECK ((ordering_key IS NULL) = (ordering_position IS NULL)) NOT VALID;
    END IF;
END
$$;
COMMIT;

CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_event_ordering_idx
    ON outbox_event ((COALESCE(tenant_id, '')), ordering_key, ordering_position)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'processing', 'failed');

BEGIN;
SET LOCAL lock_timeout = '10s';

CREATE SEQUENCE IF NOT EXISTS outbox_ordering_position_seq AS bigint;

-- outbox_ordering_lock_key is the advisory lock key of one (schema, tenant,
-- key): producers of that key hold it until they commit.
CREATE OR REPLACE FUNCTION outbox_ordering_lock_key(schema_name text, tenant_id text, ordering_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT hashtextextended(
    'outbox_ordering' || chr(31) || schema_name || chr(31) || coalesce(tenant_id, '') || chr(31) || ordering_key,
    7304226)
$$;

-- outbox_event_ordering takes the key's lock and then the position.
CREATE OR REPLACE FUNCTION outbox_event_ordering() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(outbox_ordering_lock_key(TG_TABLE_SCHEMA, NEW.tenant_id, NEW.ordering_key));
    NEW.ordering_position := nextval('outbox_ordering_position_seq');
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_event_ordering ON outbox_event;
CREATE TRIGGER outbox_event_ordering
    BEFORE INSERT ON outbox_event
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL)
    EXECUTE FUNCTION outbox_event_ordering();

-- One row per (tenant, ordering key, queue) that has an unfinished ordered
-- job: its head, the job that holds the key (any state but pending and
-- completed). The jobs that wait behind it are in outbox_ordering_wait.
-- tenant_id is '' for events without a tenant (a tenant is never ''). The
-- row is written when the key gets a head, at each release and at parking,
-- never when a job is queued behind it: a transaction that queues many jobs
-- of one key would otherwise write a new version of the row for each.
CREATE TABLE IF NOT EXISTS outbox_ordering_key (
    tenant_id     text        NOT NULL,
    ordering_key  text        NOT NULL,
    queue         text        NOT NULL,
    head_job_id   bigint      NOT NULL,
    head_event_id bigint,
    head_position bigint      NOT NULL,
    -- when the head became the head.
    head_since    timestamptz NOT NULL DEFAULT now(),
    -- set when the head was discarded or cancelled (or, found missing when
    -- it should have become the head, deleted): the key waits for an
    -- operator.
    parked_at     timestamptz,
    parked_state  text,
    PRIMARY KEY (tenant_id, ordering_key, queue),
    CONSTRAINT outbox_ordering_key_parked CHECK ((parked_at IS NULL) = (parked_state IS NULL)),
    CONSTRAINT outbox_ordering_key_parked_state CHECK (parked_state IN ('discarded', 'cancelled', 'deleted'))
);
CREATE INDEX IF NOT EXISTS outbox_ordering_key_parked_idx ON outbox_ordering_key (parked_at) WHERE parked_at IS NOT NULL;

-- The pending jobs of a key, in position order.
CREATE TABLE IF NOT EXISTS outbox_ordering_wait (
    tenant_id     text        NOT NULL,
    ordering_key  text        NOT NULL,
    queue         text        NOT NULL,
    position      bigint      NOT NULL,
    job_id        bigint      NOT NULL,
    event_id      bigint,
    since         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, ordering_key, queue, position, job_id)
);

-- outbox_ordering_enqueue: an ordered job becomes its key's head or waits.
CREATE OR REPLACE FUNCTION outbox_ordering_enqueue() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    v_tenant text   := coalesce(NEW.metadata->>'outbox_tenant_id', '');
    v_key    text   := NEW.metadata->>'outbox_ordering_key';
    v_event  bigint := (NEW.metadata->>'outbox_event_id')::bigint;
    v_pos    bigint := coalesce((NEW.metadata->>'outbox_ordering_position')::bigint, NEW.id);
BEGIN
    -- The key's row is locked either way until this transaction ends (as
    -- its inserter, or FOR UPDATE), so that the release of its head, which
    -- locks it too, sees this job's wait row or runs before it is queued.
    -- The lock first: a busy key's jobs mostly wait, and a lock is cheaper
    -- than an insert that conflicts.
    LOOP
        PERFORM 1 FROM outbox_ordering_key k
        WHERE k.tenant_id = v_tenant AND k.ordering_key = v_key AND k.queue = NEW.queue
        FOR UPDATE;
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

DROP TRIGGER IF EXISTS outbox_ordering_enqueue ON river_job;
CREATE TRIGGER outbox_ordering_enqueue
    BEFORE INSERT ON river_job
    FOR EACH ROW WHEN (NEW.metadata ? 'outbox_ordering_key')
    EXECUTE FUNCTION outbox_ordering_enqueue();

-- outbox_ordering_hold keeps a waiting job pending when something other
-- than outbox_ordering_advance (which takes it off outbox_ordering_wait
-- first) would make it runnable: River's retry (River UI, Client.JobRetry)
-- of a pending job, or of a waiting job cancelled by hand, would otherwise
-- let it overtake the head. It waits for its turn instead. Cancelling or
-- deleting a waiting job stays possible (the key parks when its turn
-- comes).
CREATE OR REPLACE FUNCTION outbox_ordering_hold() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_ordering_wait w
               WHERE w.tenant_id = coalesce(NEW.metadata->>'outbox_tenant_id', '')
                 AND w.ordering_key = NEW.metadata->>'outbox_ordering_key'
                 AND w.queue = NEW.queue AND w.job_id = NEW.id) THEN
        NEW.state := 'pending';
        NEW.scheduled_at := OLD.scheduled_at;
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_ordering_hold ON river_job;
CREATE TRIGGER outbox_ordering_hold
    BEFORE UPDATE OF state ON river_job
    FOR EACH ROW WHEN (OLD.state IN ('pending', 'cancelled', 'discarded') AND NEW.state IN ('available', 'scheduled', 'retryable', 'running')
                       AND NEW.metadata ? 'outbox_ordering_key')
    EXECUTE FUNCTION outbox_ordering_hold();

-- outbox_ordering_advance makes the next waiting job of a key its head
-- (the caller holds the key's row lock). A waiting job that is no longer
-- pending (cancelled or deleted by hand while it waited) becomes the head
-- as it is, and a cancelled or missing one parks the key: nothing is
-- skipped silently.
CREATE OR REPLACE FUNCTION outbox_ordering_advance(p_tenant text, p_key text, p_queue text, p_schema text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    w       record;
    v_state text;
    v_found boolean;
BEGIN
    LOOP
        -- The first in line, by the primary key. No other transaction
        -- changes the key's wait rows meanwhile: each holds the key's row
        -- lock, as the caller does.
        SELECT x.position, x.job_id, x.event_id INTO w FROM outbox_ordering_wait x
        WHERE x.tenant_id = p_tenant AND x.ordering_key = p_key AND x.queue = p_queue
        ORDER BY x.position, x.job_id LIMIT 1;
        IF NOT FOUND THEN
            DELETE FROM outbox_ordering_key k WHERE k.tenant_id = p_tenant AND k.ordering_key = p_key AND k.queue = p_queue;
            RETURN;
        END IF;
        DELETE FROM outbox_ordering_wait x
        WHERE x.tenant_id = p_tenant AND x.ordering_key = p_key AND x.queue = p_queue
          AND x.position = w.position AND x.job_id = w.job_id;
        SELECT r.state::text INTO v_state FROM river_job r WHERE r.id = w.job_id FOR UPDATE;
        v_found := FOUND;
        IF v_found AND v_state = 'completed' THEN
            CONTINUE;
        END IF;
        UPDATE outbox_ordering_key k
        SET head_job_id = w.job_id, head_event_id = w.event_id, head_position = w.position, head_since = now(),
            parked_at = CASE WHEN NOT v_found OR v_state IN ('cancelled', 'discarded') THEN now() END,
            parked_state = CASE WHEN NOT v_found THEN 'deleted' WHEN v_state IN ('cancelled', 'discarded') THEN v_state END
        WHERE k.tenant_id = p_tenant AND k.ordering_key = p_key AND k.queue = p_queue;
        IF v_found AND v_state = 'pending' THEN
            UPDATE river_job r SET state = 'available', scheduled_at = now() WHERE r.id = w.job_id;
            PERFORM pg_notify(p_schema || '.river_insert', json_build_object('queue', p_queue)::text);
        END IF;
        RETURN;
    END LOOP;
END
$$;

-- The publish functions, with a last optional, named parameter each:
-- outbox_publish(..., ordering_key text DEFAULT NULL) (both overloads) and
-- outbox_publish_many(..., ordering_keys text[] DEFAULT NULL). As in 010,
-- the old signatures are dropped and the functions recreated in this
-- transaction, so existing positional and named calls resolve to the new
-- ones unchanged.
DROP FUNCTION IF EXISTS outbox_publish(text, jsonb, text, text, timestamptz, text);
DROP FUNCTION IF EXISTS outbox_publish(text, text, text, text, timestamptz, text);
DROP FUNCTION IF EXISTS outbox_publish_many(text[], jsonb[], text[], text[], timestamptz[], text[]);

-- outbox_publish: as in 010, plus ordering_key.
CREATE OR REPLACE FUNCTION outbox_publish(
    event_type    text,
    payload       jsonb,
    tenant_id     text        DEFAULT NULL,
    dispatch_key  text        DEFAULT NULL,
    not_before    timestamptz DEFAULT NULL,
    trace_context text        DEFAULT NULL,
    ordering_key  text        DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER AS $$
#variable_conflict use_column
DECLARE
    event_id bigint;
    problem  text;
BEGIN
    IF event_type IS NULL THEN
        RAISE EXCEPTION 'outbox_publish: event_type is required'
            USING ERRCODE = '22023', HINT = 'use <domain>.<entity>.<verb>, e.g. billing.invoice.paid';
    END IF;
    IF octet_length(event_type) > 255 THEN
        RAISE EXCEPTION 'outbox_publish: event_type is % bytes, the limit is 255', octet_length(event_type)
            USING ERRCODE = '22023';
    END IF;
    IF event_type !~ '^[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*){2,}$' THEN
        RAISE EXCEPTION 'outbox_publish: event_type % must be at least three dot-separated segments of lowercase [a-z0-9] with inner dashes', quote_literal(event_type)
            USING ERRCODE = '22023', HINT = 'e.g. billing.invoice.paid or plugin.capability-use.granted';
    END IF;
    problem := outbox_payload_problem(payload);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'outbox_publish: payload %', problem
            USING ERRCODE = '22023';
    END IF;
    IF tenant_id IS NOT NULL AND (octet_length(tenant_id) < 1 OR octet_length(tenant_id) > 128) THEN
        RAISE EXCEPTION 'outbox_publish: tenant_id must be 1 to 128 bytes (got %)', octet_length(tenant_id)
            USING ERRCODE = '22023';
    END IF;
    IF dispatch_key IS NOT NULL AND (octet_length(dispatch_key) < 1 OR octet_length(dispatch_key) > 256) THEN
        RAISE EXCEPTION 'outbox_publish: dispatch_key must be 1 to 256 bytes (got %)', octet_length(dispatch_key)
            USING ERRCODE = '22023';
    END IF;
    IF ordering_key IS NOT NULL AND (octet_length(ordering_key) < 1 OR octet_length(ordering_key) > 256) THEN
        RAISE EXCEPTION 'outbox_publish: ordering_key must be 1 to 256 bytes (got %)', octet_length(ordering_key)
            USING ERRCODE = '22023', COLUMN = 'ordering_key', CONSTRAINT = 'outbox_event_ordering_key_length';
    END IF;
    IF not_before > now() + interval '8760 hours' THEN
        RAISE EXCEPTION 'outbox_publish: not_before % is more than 365 days (8760 hours) after the database''s now() (%), the limit is 365 days', not_before, now()
            USING ERRCODE = '22023', COLUMN = 'not_before', CONSTRAINT = 'outbox_max_delay',
                  HINT = 'keep far-future due times in your own table and publish within a year of them';
    END IF;
    problem := outbox_trace_context_problem(trace_context);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'outbox_publish: trace_context %', problem
            USING ERRCODE = '22023', COLUMN = 'trace_context', CONSTRAINT = 'outbox_trace_context',
                  HINT = outbox_trace_context_hint();
    END IF;
    IF (SELECT s.strict FROM outbox_route_setting s) AND NOT EXISTS (SELECT 1 FROM outbox_route r WHERE r.prefix = event_type OR (right(r.prefix, 1) = '.' AND starts_with(event_type, r.prefix))) THEN
        RAISE EXCEPTION 'outbox_publish: event_type % matches no synced route (strict routing is on)', quote_literal(event_type)
            USING ERRCODE = '22023', COLUMN = 'event_type', CONSTRAINT = 'outbox_route_strict', HINT = outbox_route_strict_hint();
    END IF;

    INSERT INTO outbox_event AS e (event_type, payload, tenant_id, dispatch_key, scheduled_at, trace_context, ordering_key)
    VALUES (outbox_publish.event_type, outbox_publish.payload, outbox_publish.tenant_id, outbox_publish.dispatch_key,
            GREATEST(now(), outbox_publish.not_before), outbox_publish.trace_context, outbox_publish.ordering_key)
    ON CONFLICT DO NOTHING
    RETURNING e.id INTO event_id;

    IF event_id IS NULL AND outbox_publish.dispatch_key IS NOT NULL THEN
        SELECT e.id INTO event_id FROM outbox_event e
        WHERE COALESCE(e.tenant_id, '') = COALESCE(outbox_publish.tenant_id, '')
          AND e.dispatch_key = outbox_publish.dispatch_key;
    END IF;
    IF event_id IS NULL THEN
        RAISE EXCEPTION 'outbox_publish: the event conflicts with a stored row that holds neither its tenant and dispatch key nor its id'
            USING ERRCODE = '23505', HINT = 'an event id was taken outside the identity sequence (INSERT ... OVERRIDING SYSTEM VALUE)';
    END IF;
    RETURN event_id;
END
$$;

-- outbox_publish(text, text, ...): as in 010, plus ordering_key.
CREATE OR REPLACE FUNCTION outbox_publish(
    event_type    text,
    payload       text,
    tenant_id     text        DEFAULT NULL,
    dispatch_key  text        DEFAULT NULL,
    not_before    timestamptz DEFAULT NULL,
    trace_context text        DEFAULT NULL,
    ordering_key  text        DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    body   jsonb;
    detail text;
BEGIN
    BEGIN
        body := payload::jsonb;
    EXCEPTION
        WHEN untranslatable_character THEN
            RAISE EXCEPTION 'outbox_publish: payload contains \u0000, which Postgres'' jsonb cannot store'
                USING ERRCODE = '22023', HINT = 'remove the NUL character, or encode binary data (base64)';
        WHEN invalid_text_representation THEN
            GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL;
            IF detail ILIKE '%surrogate%' THEN
                RAISE EXCEPTION 'outbox_publish: payload has an unpaired surrogate escape, which Postgres'' jsonb cannot store (%)', detail
                    USING ERRCODE = '22023';
            END IF;
            RAISE EXCEPTION 'outbox_publish: payload is not valid JSON (%)', coalesce(detail, SQLERRM)
                USING ERRCODE = '22023';
        WHEN numeric_value_out_of_range THEN
            RAISE EXCEPTION 'outbox_publish: payload has a number outside the range of Postgres'' numeric'
                USING ERRCODE = '22023';
        WHEN statement_too_complex THEN
            RAISE EXCEPTION 'outbox_publish: payload is nested too deep to parse, the limit is 1000'
                USING ERRCODE = '22023';
    END;
    RETURN outbox_publish(event_type, body, tenant_id, dispatch_key, not_before, trace_context, ordering_key);
END
$$;

-- outbox_publish_many: as in 010, plus ordering_keys.
CREATE OR REPLACE FUNCTION outbox_publish_many(
    event_types    text[],
    payloads       jsonb[],
    tenant_ids     text[]        DEFAULT NULL,
    dispatch_keys  text[]        DEFAULT NULL,
    not_befores    timestamptz[] DEFAULT NULL,
    trace_contexts text[]        DEFAULT NULL,
    ordering_keys  text[]        DEFAULT NULL
) RETURNS TABLE (ord bigint, duplicate boolean, id bigint)
LANGUAGE plpgsql SECURITY DEFINER AS $$
#variable_conflict use_column
DECLARE
    n    int := coalesce(cardinality(event_types), 0);
    bad  record;
    ords bigint[];
    dups boolean[];
    ids  bigint[];
    at   int;
BEGIN
    IF coalesce(cardinality(payloads), 0) <> n
       OR coalesce(cardinality(tenant_ids), n) <> n
       OR coalesce(cardinality(dispatch_keys), n) <> n
       OR coalesce(cardinality(not_befores), n) <> n
       OR coalesce(cardinality(trace_contexts), n) <> n
       OR coalesce(cardinality(ordering_keys), n) <> n THEN
        RAISE EXCEPTION 'outbox_publish_many: event_types, payloads, tenant_ids, dispatch_keys, not_befores, trace_contexts and ordering_keys must have one element per event (got %, %, %, %, %, %, %)',
            n, coalesce(cardinality(payloads), 0), cardinality(tenant_ids), cardinality(dispatch_keys), cardinality(not_befores), cardinality(trace_contexts), cardinality(ordering_keys)
            USING ERRCODE = '22023', HINT = 'pass NULL for tenant_ids, dispatch_keys, not_befores, trace_contexts or ordering_keys to leave them out';
    END IF;
    IF n > 10000 THEN
        RAISE EXCEPTION 'outbox_publish_many: % events, the limit is 10000; split the batch', n
            USING ERRCODE = '22023';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;

    SELECT t.i, t.event_type, t.tenant_id, t.dispatch_key, t.not_before, outbox_payload_problem(t.payload) AS problem,
           outbox_trace_context_problem(t.trace_context) AS trace_problem, t.ordering_key
    INTO bad
    FROM unnest(event_types, payloads, tenant_ids, dispatch_keys, not_befores, trace_contexts, ordering_keys) WITH ORDINALITY
         AS t(event_type, payload, tenant_id, dispatch_key, not_before, trace_context, ordering_key, i)
    WHERE t.event_type IS NULL
       OR octet_length(t.event_type) > 255
       OR t.event_type !~ '^[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*){2,}$'
       OR outbox_payload_problem(t.payload) IS NOT NULL
       OR octet_length(t.tenant_id) NOT BETWEEN 1 AND 128
       OR octet_length(t.dispatch_key) NOT BETWEEN 1 AND 256
       OR t.not_before > now() + interval '8760 hours'
       OR outbox_trace_context_problem(t.trace_context) IS NOT NULL
       OR octet_length(t.ordering_key) NOT BETWEEN 1 AND 256
    ORDER BY t.i
    LIMIT 1;
    IF FOUND THEN
        IF bad.event_type IS NULL THEN
            RAISE EXCEPTION 'outbox_publish_many: event_types[%] is required', bad.i
                USING ERRCODE = '22023', HINT = 'use <domain>.<entity>.<verb>, e.g. billing.invoice.paid';
        ELSIF octet_length(bad.event_type) > 255 THEN
            RAISE EXCEPTION 'outbox_publish_many: event_types[%] is % bytes, the limit is 255', bad.i, octet_length(bad.event_type)
                USING ERRCODE = '22023';
        ELSIF bad.event_type !~ '^[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*){2,}$' THEN
            RAISE EXCEPTION 'outbox_publish_many: event_types[%] % must be at least three dot-separated segments of lowercase [a-z0-9] with inner dashes', bad.i, quote_literal(bad.event_type)
                USING ERRCODE = '22023', HINT = 'e.g. billing.invoice.paid or plugin.capability-use.granted';
        ELSIF bad.problem IS NOT NULL THEN
            RAISE EXCEPTION 'outbox_publish_many: payloads[%] %', bad.i, bad.problem
                USING ERRCODE = '22023';
        ELSIF bad.tenant_id IS NOT NULL AND octet_length(bad.tenant_id) NOT BETWEEN 1 AND 128 THEN
            RAISE EXCEPTION 'outbox_publish_many: tenant_ids[%] must be 1 to 128 bytes (got %)', bad.i, octet_length(bad.tenant_id)
                USING ERRCODE = '22023';
        ELSIF bad.dispatch_key IS NOT NULL AND octet_length(bad.dispatch_key) NOT BETWEEN 1 AND 256 THEN
            RAISE EXCEPTION 'outbox_publish_many: dispatch_keys[%] must be 1 to 256 bytes (got %)', bad.i, octet_length(bad.dispatch_key)
                USING ERRCODE = '22023';
        ELSIF bad.ordering_key IS NOT NULL AND octet_length(bad.ordering_key) NOT BETWEEN 1 AND 256 THEN
            RAISE EXCEPTION 'outbox_publish_many: ordering_keys[%] must be 1 to 256 bytes (got %)', bad.i, octet_length(bad.ordering_key)
                USING ERRCODE = '22023', COLUMN = 'ordering_key', CONSTRAINT = 'outbox_event_ordering_key_length';
        ELSIF bad.trace_problem IS NOT NULL THEN
            RAISE EXCEPTION 'outbox_publish_many: trace_contexts[%] %', bad.i, bad.trace_problem
                USING ERRCODE = '22023', COLUMN = 'trace_context', CONSTRAINT = 'outbox_trace_context',
                      HINT = outbox_trace_context_hint();
        ELSE
            RAISE EXCEPTION 'outbox_publish_many: not_befores[%] % is more than 365 days (8760 hours) after the database''s now() (%), the limit is 365 days', bad.i, bad.not_before, now()
                USING ERRCODE = '22023', COLUMN = 'not_before', CONSTRAINT = 'outbox_max_delay',
                      HINT = 'keep far-future due times in your own table and publish within a year of them';
        END IF;
    END IF;

    IF (SELECT s.strict FROM outbox_route_setting s) THEN
        SELECT t.i, t.event_type INTO bad
        FROM unnest(event_types) WITH ORDINALITY AS t(event_type, i)
        WHERE NOT EXISTS (SELECT 1 FROM outbox_route r WHERE r.prefix = t.event_type OR (right(r.prefix, 1) = '.' AND starts_with(t.event_type, r.prefix)))
        ORDER BY t.i
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'outbox_publish_many: event_types[%] % matches no synced route (strict routing is on)', bad.i, quote_literal(bad.event_type)
                USING ERRCODE = '22023', COLUMN = 'event_type', CONSTRAINT = 'outbox_route_strict', HINT = outbox_route_strict_hint();
        END IF;
    END IF;

    -- The ordering keys' locks, all at once and in one order (see
    -- outbox_event_ordering), so that two batches that share keys queue
    -- behind each other instead of deadlocking.
    IF ordering_keys IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(l.k)
        FROM (SELECT DISTINCT outbox_ordering_lock_key(current_schema(), t.tenant_id, t.ordering_key) AS k
              FROM unnest(tenant_ids, ordering_keys) AS t(tenant_id, ordering_key)
              WHERE t.ordering_key IS NOT NULL) l
        ORDER BY l.k;
    END IF;

    WITH input AS (
        SELECT nextval('outbox_event_id_seq') AS id, t.i, t.event_type, t.payload, t.tenant_id, t.dispatch_key, t.not_before, t.trace_context, t.ordering_key
        FROM unnest(event_types, payloads, tenant_ids, dispatch_keys, not_befores, trace_contexts, ordering_keys) WITH ORDINALITY
             AS t(event_type, payload, tenant_id, dispatch_key, not_before, trace_context, ordering_key, i)
    ),
    ins AS (
        INSERT INTO outbox_event AS e (id, event_type, payload, tenant_id, dispatch_key, scheduled_at, trace_context, ordering_key)
        OVERRIDING SYSTEM VALUE
        SELECT input.id, input.event_type, input.payload, input.tenant_id, input.dispatch_key, GREATEST(now(), input.not_before), input.trace_context, input.ordering_key
        FROM input ORDER BY input.i
        ON CONFLICT DO NOTHING
        RETURNING e.id
    )
    SELECT array_agg(input.i ORDER BY input.i), array_agg(ins.id IS NULL ORDER BY input.i), array_agg(ins.id ORDER BY input.i)
    INTO ords, dups, ids
    FROM input LEFT JOIN ins ON ins.id = input.id;

    IF array_position(ids, NULL) IS NOT NULL THEN
        -- A new statement: it sees keys stored earlier in this batch, and
        -- (READ COMMITTED) keys committed while the insert waited.
        SELECT array_agg(COALESCE(u.i,
                   (SELECT e.id FROM outbox_event e
                    WHERE COALESCE(e.tenant_id, '') = COALESCE(tenant_ids[u.o], '')
                      AND e.dispatch_key = dispatch_keys[u.o]))
               ORDER BY u.o)
        INTO ids
        FROM unnest(ords, ids) AS u(o, i);
        at := array_position(ids, NULL);
        IF at IS NOT NULL THEN
            RAISE EXCEPTION 'outbox_publish_many: event % conflicts with a stored row that holds neither its tenant and dispatch key nor its id', at
                USING ERRCODE = '23505', HINT = 'an event id was taken outside the identity sequence (INSERT ... OVERRIDING SYSTEM VALUE)';
        END IF;
    END IF;

    RETURN QUERY SELECT u.o, u.d, u.i FROM unnest(ords, dups, ids) AS u(o, d, i);
END
$$;

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'outbox_publish(text, jsonb, text, text, timestamptz, text, text)',
        'outbox_publish(text, text, text, text, timestamptz, text, text)',
        'outbox_publish_many(text[], jsonb[], text[], text[], timestamptz[], text[], text[])']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

GRANT EXECUTE ON FUNCTION outbox_publish(text, jsonb, text, text, timestamptz, text, text) TO outbox_producer, outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_publish(text, text, text, text, timestamptz, text, text) TO outbox_producer, outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_publish_many(text[], jsonb[], text[], text[], timestamptz[], text[], text[]) TO outbox_producer, outbox_operator;


-- outbox_ordering_settled: the head of a key was finalized, or revived.
CREATE OR REPLACE FUNCTION outbox_ordering_settled() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    v_tenant text := coalesce(NEW.metadata->>'outbox_tenant_id', '');
    v_key    text := NEW.metadata->>'outbox_ordering_key';
    k        record;
BEGIN
    SELECT * INTO k FROM outbox_ordering_key x
    WHERE x.tenant_id = v_tenant AND x.ordering_key = v_key AND x.queue = NEW.queue
    FOR UPDATE;
    IF NOT FOUND OR k.head_job_id <> NEW.id THEN
        -- Not the head: a waiting job cancelled by hand is dealt with when
        -- its turn comes (outbox_ordering_advance).
        RETURN NULL;
    END IF;
    IF NEW.state = 'completed' THEN
        PERFORM outbox_ordering_advance(k.tenant_id, k.ordering_key, k.queue, TG_TABLE_SCHEMA);
    ELSIF NEW.state IN ('discarded', 'cancelled') THEN
        UPDATE outbox_ordering_key x SET parked_at = coalesce(x.parked_at, now()), parked_state = NEW.state::text
        WHERE x.tenant_id = k.tenant_id AND x.ordering_key = k.ordering_key AND x.queue = k.queue;
    ELSIF k.parked_at IS NOT NULL THEN
        -- The parked head runs again (River's retry, or outbox_unpark).
        UPDATE outbox_ordering_key x SET parked_at = NULL, parked_state = NULL
        WHERE x.tenant_id = k.tenant_id AND x.ordering_key = k.ordering_key AND x.queue = k.queue;
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_ordering_settled ON river_job;
CREATE TRIGGER outbox_ordering_settled
    AFTER UPDATE OF state ON river_job
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state
                       AND (NEW.state IN ('completed', 'discarded', 'cancelled') OR OLD.state IN ('discarded', 'cancelled'))
                       AND NEW.metadata ? 'outbox_ordering_key')
    EXECUTE FUNCTION outbox_ordering_settled();

-- outbox_ordering_deleted: the head of a key was deleted before it was
-- finalized (River UI's delete, Client.JobDelete, of a retryable or
-- scheduled head; or River's cleaner, of a parked discarded one): the key
-- parks as deleted, so that it shows, alerts and an operator skips it,
-- instead of waiting unseen for a job that no longer exists.
CREATE OR REPLACE FUNCTION outbox_ordering_deleted() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    UPDATE outbox_ordering_key x SET parked_at = coalesce(x.parked_at, now()), parked_state = 'deleted'
    WHERE x.tenant_id = coalesce(OLD.metadata->>'outbox_tenant_id', '') AND x.ordering_key = OLD.metadata->>'outbox_ordering_key'
      AND x.queue = OLD.queue AND x.head_job_id = OLD.id;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_ordering_deleted ON river_job;
CREATE TRIGGER outbox_ordering_deleted
    AFTER DELETE ON river_job
    FOR EACH ROW WHEN (OLD.state <> 'completed' AND OLD.metadata ? 'outbox_ordering_key')
    EXECUTE FUNCTION outbox_ordering_deleted();

-- outbox_unpark lets a parked key go on, audited. action 'retry' makes the
-- head job available again (one more attempt if it had none left); 'skip'
-- leaves the head as it is (discarded, cancelled or deleted) and releases
-- the next waiting job. queue NULL means every parked queue of the key.
-- Only parked keys are touched; a dry run changes nothing and records no
-- audit row. From psql:
--
--   SELECT * FROM outbox_unpark('alice', true, 'order-42', 'retry', tenant_id => 'acme');
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
        ORDER BY x.queue
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
        'outbox_event_ordering()',
        'outbox_ordering_enqueue()',
        'outbox_ordering_hold()',
        'outbox_ordering_advance(text, text, text, text)',
        'outbox_ordering_settled()',
        'outbox_ordering_deleted()',
        'outbox_unpark(text, boolean, text, text, text, text, text)']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

GRANT EXECUTE ON FUNCTION outbox_unpark(text, boolean, text, text, text, text, text) TO outbox_operator;
-- A producer that writes plain INSERTs may set the ordering key (never the
-- position: the trigger does).
GRANT INSERT (ordering_key) ON outbox_event TO outbox_producer;
-- The dispatcher reads the keys for its metrics and alerts, the operator
-- for outboxctl keys, explain and the console.
GRANT SELECT ON outbox_ordering_key, outbox_ordering_wait TO outbox_dispatcher, outbox_operator;

COMMIT;
