-- 001: the outbox table, its status enum, the claim index, the wake trigger
-- and the SQL publish function. Everything lives in the schema that the
-- connection's search_path points at.

CREATE TYPE outbox_status AS ENUM ('pending', 'processing', 'done', 'failed', 'cancelled');

CREATE TABLE outbox_event (
    id            bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME outbox_event_id_seq) PRIMARY KEY,
    tenant_id     text,
    event_type    text          NOT NULL,
    payload       jsonb         NOT NULL,
    dispatch_key  text,
    status        outbox_status NOT NULL DEFAULT 'pending',
    retries       int           NOT NULL DEFAULT 0,
    scheduled_at  timestamptz   NOT NULL DEFAULT now(),
    locked_until  timestamptz,
    processed_at  timestamptz,
    last_error    text,
    created_at    timestamptz   NOT NULL DEFAULT now(),
    -- River job ids created for this event, in route order, written in the
    -- same transaction as status = 'done' (lineage for `outboxctl explain`).
    river_job_ids bigint[],

    -- <domain>.<entity>.<verb>: at least three lowercase segments of [a-z0-9]
    -- with inner single dashes.
    CONSTRAINT outbox_event_type_format CHECK (
        event_type ~ '^[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*){2,}$'
        AND octet_length(event_type) <= 255),
    CONSTRAINT outbox_event_tenant_length CHECK (octet_length(tenant_id) BETWEEN 1 AND 128),
    CONSTRAINT outbox_event_dispatch_key_length CHECK (octet_length(dispatch_key) BETWEEN 1 AND 256),
    -- Backstop for plain INSERTs. Publish and outbox_publish enforce 1 MiB;
    -- this bound is looser so that nothing they accept can fail it (jsonb's
    -- text form adds spaces after ':' and ',').
    CONSTRAINT outbox_event_payload_size CHECK (octet_length(payload::text) <= 2097152),
    CONSTRAINT outbox_event_retries_nonnegative CHECK (retries >= 0),
    CONSTRAINT outbox_event_error_length CHECK (octet_length(last_error) <= 8192)
);

-- dispatch_key is unique among stored rows. The index is partial: events
-- without a key (most of them) cost no entry, neither when published nor
-- when the dispatcher's UPDATE to done writes a new row version.
CREATE UNIQUE INDEX outbox_event_dispatch_key_key ON outbox_event (dispatch_key) WHERE dispatch_key IS NOT NULL;

-- The claim reads due pending rows in (scheduled_at, id) order. A partial
-- index holds only those rows, so it stays small however many done rows the
-- table keeps, and the ORDER BY ... LIMIT is an index range scan.
CREATE INDEX outbox_event_claim_idx ON outbox_event (scheduled_at, id) WHERE status = 'pending';

-- Rows stuck in 'processing' past locked_until are put back to pending by the
-- dispatcher's rescue pass; this index keeps that pass cheap.
CREATE INDEX outbox_event_processing_idx ON outbox_event (locked_until) WHERE status = 'processing';

-- Retention deletes old done rows by processed_at.
CREATE INDEX outbox_event_done_idx ON outbox_event (processed_at) WHERE status = 'done';

-- Operators filter failed/cancelled rows by type and time.
CREATE INDEX outbox_event_dead_idx ON outbox_event (event_type, created_at) WHERE status IN ('failed', 'cancelled');

-- outbox_wake_lock_key is the advisory lock key (with class 1868720215) that
-- an idle dispatcher holds exclusively on a dedicated session while it waits
-- for a notification. It is derived from the schema so that several outbox
-- schemas in one database do not share it.
CREATE FUNCTION outbox_wake_lock_key() RETURNS int
LANGUAGE sql STABLE AS $$ SELECT hashtext('outbox_wake:' || current_schema()) $$;

-- The wake trigger. NOTIFY takes a cluster-wide lock at commit, so a trigger
-- that always notifies serialises every producer's commit. Instead, at commit
-- time (the trigger is deferred) the producer tries a *shared* transaction
-- lock on the wake key:
--
--   * it succeeds when no dispatcher is idle-waiting (dispatchers are busy, or
--     none runs): nothing to wake, so no NOTIFY. The shared lock is held until
--     the producer's commit is visible, so a dispatcher that is about to go
--     idle (it takes the key exclusively, then re-checks the table) cannot
--     miss this row: its exclusive lock waits for the commit.
--   * it fails when a dispatcher holds the key exclusively (idle, listening)
--     or is queued for it: NOTIFY, which that dispatcher receives.
--
-- The payload is the schema name, constant per schema, so Postgres folds the
-- notifications of one transaction into one.
CREATE FUNCTION outbox_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(1868720215, hashtext('outbox_wake:' || TG_TABLE_SCHEMA)) THEN
        PERFORM pg_notify('outbox_wake', TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER outbox_event_wake
    AFTER INSERT ON outbox_event
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION outbox_wake();

-- A row that becomes pending again (an operator's requeue) wakes too.
CREATE CONSTRAINT TRIGGER outbox_event_wake_requeue
    AFTER UPDATE OF status ON outbox_event
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.status = 'pending' AND OLD.status <> 'pending')
    EXECUTE FUNCTION outbox_wake();

-- outbox_publish validates and inserts one event, for producers in any
-- language. A duplicate dispatch_key returns the existing event's id without
-- an error (ON CONFLICT, so the caller's transaction is never aborted by it).
-- Invalid input raises 22023 (invalid_parameter_value) naming the field and
-- the rule, before anything is written.
CREATE FUNCTION outbox_publish(
    event_type   text,
    payload      jsonb,
    tenant_id    text DEFAULT NULL,
    dispatch_key text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    event_id bigint;
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
    IF payload IS NULL THEN
        RAISE EXCEPTION 'outbox_publish: payload is required (use ''{}'' for an empty body)'
            USING ERRCODE = '22023';
    END IF;
    IF octet_length(payload::text) > 1048576 THEN
        RAISE EXCEPTION 'outbox_publish: payload is % bytes, the limit is 1048576', octet_length(payload::text)
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

    INSERT INTO outbox_event AS e (event_type, payload, tenant_id, dispatch_key)
    VALUES (outbox_publish.event_type, outbox_publish.payload, outbox_publish.tenant_id, outbox_publish.dispatch_key)
    ON CONFLICT (dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING
    RETURNING e.id INTO event_id;

    IF event_id IS NULL THEN
        SELECT e.id INTO event_id FROM outbox_event e WHERE e.dispatch_key = outbox_publish.dispatch_key;
    END IF;
    RETURN event_id;
END
$$;
