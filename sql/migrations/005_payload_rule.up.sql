-- 005: one rule for an acceptable payload, enforced the same way by
-- Publish (Go), outbox_publish and a plain INSERT from any producer:
--
--   * size: at most 1 MiB (1048576 bytes) as Postgres prints the jsonb;
--   * depth: objects and arrays nested at most 1000 levels deep
--     (outbox.MaxPayloadDepth). encoding/json refuses documents deeper than
--     10,000 levels and the River job args that carry a payload add one
--     level, so a bound well below that keeps every handed-off payload
--     decodable by any worker. A row deeper than that stalled the claim.

-- outbox_payload_problem says what is wrong with a payload, or NULL when it
-- is acceptable. The depth test asks for an object or array at level 1000
-- below the root ('strict': lax mode would unwrap arrays on its own); the
-- root is level 0 and depth 1, so such an item means depth 1001 or more.
-- jsonb_path_exists stops descending at level 1000, so hostile nesting costs
-- no more than that; on a 1 MiB payload of 30,000 small objects it takes
-- about 4 ms, against about 12 ms for the payload::text of the size test
-- (and about 1 µs on a small payload). Everything in the body is immutable
-- (no format(), which is only stable), so Postgres inlines the function into
-- the queries that call it instead of running it as a query of its own per
-- row.
CREATE FUNCTION outbox_payload_problem(payload jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE
    WHEN payload IS NULL THEN
        'is required (use ''{}'' for an empty body)'
    WHEN octet_length(payload::text) > 1048576 THEN
        'is ' || octet_length(payload::text)::text || ' bytes as Postgres prints it, the limit is 1048576'
    WHEN jsonb_path_exists(payload, 'strict $.**{1000} ? (@.type() == "object" || @.type() == "array")') THEN
        'is nested more than 1000 levels deep, the limit is 1000'
END
$$;

-- The table enforces the rule with a trigger rather than a CHECK constraint
-- on purpose. A CHECK is evaluated again on every UPDATE of a row, whatever
-- the UPDATE changes: a row stored before this migration (or before a
-- change of the rule) that breaks it could then never be marked 'failed' or
-- 'done' by the dispatcher, nor cancelled by an operator, and would stall
-- the claim again. The trigger runs only when a payload is written (INSERT,
-- or an UPDATE that sets payload). The 2 MiB CHECK of migration 001 stays
-- as the backstop it was.
CREATE FUNCTION outbox_event_payload_rule() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    problem text;
BEGIN
    problem := outbox_payload_problem(NEW.payload);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'outbox_event: payload %', problem
            USING ERRCODE = '22023', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'payload';
    END IF;
    RETURN NEW;
END
$$;

-- Trigger functions resolve names through the caller's search_path, which
-- need not contain this schema (INSERT INTO app.outbox_event ...): pin it.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_event_payload_rule() SET search_path = %I, pg_temp', current_schema());
END
$$;

CREATE TRIGGER outbox_event_payload_rule
    BEFORE INSERT OR UPDATE OF payload ON outbox_event
    FOR EACH ROW EXECUTE FUNCTION outbox_event_payload_rule();

-- outbox_publish applies the same rule (and so names it before the INSERT).
--
-- Duplicate dispatch keys and isolation levels. The duplicate gets the
-- first event's id when that event is visible to the caller: committed
-- before the caller's snapshot (any isolation level), written earlier in the
-- same transaction, or, under READ COMMITTED, committed while this INSERT
-- waited for it (the lookup after the INSERT is a new statement with a new
-- snapshot). Under REPEATABLE READ and SERIALIZABLE, a first event that
-- commits after the caller's snapshot was taken (before or while this
-- INSERT runs) is invisible to the caller for the rest of its transaction:
-- ON CONFLICT raises 40001 (serialization_failure), and no function can
-- return an id its caller's snapshot cannot see. Retry the transaction: the
-- retry sees the first event and gets its id. The error is not caught here
-- on purpose: catching it needs a subtransaction on every call, and the
-- caller's retry loop must see 40001 to retry.
CREATE OR REPLACE FUNCTION outbox_publish(
    event_type   text,
    payload      jsonb,
    tenant_id    text DEFAULT NULL,
    dispatch_key text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql AS $$
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

-- outbox_publish with the payload as text, so that the function, not the
-- cast to jsonb, refuses a bad payload and names it: malformed JSON, a
-- \u0000 escape, an unpaired surrogate escape, a number outside numeric's
-- range or nesting too deep to parse each raise 22023 naming "payload" and
-- the rule (the cast's error is caught inside the function and re-raised, so
-- the caller's transaction sees that one error and nothing else). Then it
-- calls the jsonb version, which applies every other rule.
--
-- Which overload runs: a call with an untyped string literal
-- (outbox_publish('a.b.c', '{"a": 1}')), with NULL, or with a parameter of
-- unspecified type ($2 from a driver) resolves to this text version,
-- because Postgres prefers the string category for an unknown argument; a
-- payload typed jsonb ('{}'::jsonb, a jsonb column, jsonb_build_object)
-- resolves to the jsonb version. Named arguments resolve the same way.
--
-- A raw NUL byte never reaches this function: Postgres text cannot hold it,
-- and the server refuses the parameter or query text itself with 22021
-- (invalid byte sequence for encoding "UTF8": 0x00), before any function
-- runs, and without naming the field. Invalid UTF-8 fails the same way.
CREATE FUNCTION outbox_publish(
    event_type   text,
    payload      text,
    tenant_id    text DEFAULT NULL,
    dispatch_key text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql AS $$
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
    RETURN outbox_publish(event_type, body, tenant_id, dispatch_key);
END
$$;

GRANT EXECUTE ON FUNCTION outbox_publish(text, text, text, text) TO outbox_producer, outbox_operator;
