-- 010: trace context. An event may carry the W3C Trace Context of the code
-- that published it, so that the River job that delivers it, and the
-- receiver's span, continue the producer's trace.
--
-- The column trace_context holds the W3C traceparent header value, alone
-- or followed by one space and the tracestate header value:
--
--   00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
--   00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 congo=t61rcWkgMzE,rojo=00f067aa0ba902b7
--
-- The traceparent is version 00 (the only version W3C defines): 00, a
-- 32-digit trace id and a 16-digit parent id in lowercase hex, neither all
-- zeros, and 2 hex digits of flags. The tracestate is 1 to 512 bytes of
-- printable ASCII (W3C asks every system to pass on at least 512), not
-- starting or ending with a space. A plain text column rather than JSON, so
-- that the rule is two regular expressions that every supported Postgres
-- (13 and newer) checks without a cast that could fail. NULL means none.
-- The handoff copies it into the River job's metadata under the keys
-- "traceparent" and "tracestate" (outboxriver.JobParams).
--
-- The rule is written once in SQL, in outbox_trace_context_problem, an
-- IMMUTABLE SQL function that Postgres inlines; Go's copy is in event.go
-- (traceContextPattern), and rules_test.go checks that they agree. The
-- publish functions apply it first, so that they name the field (and the
-- batch position) with 22023; a CHECK constraint holds a plain INSERT to it
-- (23514, outbox_event_trace_context_rule).
--
-- The column is added without a default, and the CHECK as NOT VALID (every
-- existing row is NULL, which the rule accepts), so neither rewrites nor
-- scans the table: the migration is instant on a big table. Both still take
-- an ACCESS EXCLUSIVE lock on outbox_event for the length of this
-- migration's transaction; lock_timeout keeps it from queueing producers
-- and the dispatcher behind a long transaction: if it cannot get the lock
-- within 10 s it fails, changes nothing, and `outboxctl migrate` can be run
-- again.
--
-- The publish functions, with their final parameters. Two optional, named
-- parameters join the four of 006: not_before (delayed events; the rule is
-- in 008's header) and trace_context: outbox_publish(..., not_before
-- timestamptz DEFAULT NULL, trace_context text DEFAULT NULL) (both
-- overloads) and outbox_publish_many(..., not_befores timestamptz[] DEFAULT
-- NULL, trace_contexts text[] DEFAULT NULL; a NULL element: that event is
-- not delayed, or has no trace context). They also check strict routing
-- (008) first, so that they name the batch position. The functions of 006
-- are dropped and recreated with the parameters last (a second function
-- with the old four parameters would make every existing call ambiguous),
-- in this migration's transaction, so positional and named calls written
-- for the old signatures resolve to the new ones unchanged; SECURITY
-- DEFINER, search_path pinned, EXECUTE revoked from PUBLIC and granted to
-- the producer and operator roles, as in 006. Every behaviour of 006 (the
-- rules, duplicate keys per tenant) is kept.
--
-- Every statement is idempotent, so that running it again is harmless and
-- repairs the functions if 006 (which creates the older signatures) is ever
-- run again after it.

SET LOCAL lock_timeout = '10s';

ALTER TABLE outbox_event ADD COLUMN IF NOT EXISTS trace_context text;

-- outbox_trace_context_problem says what is wrong with a trace context, or
-- NULL when it is acceptable (NULL is). Everything in the body is
-- immutable, so Postgres inlines it into the CHECK and the publish
-- functions.
CREATE OR REPLACE FUNCTION outbox_trace_context_problem(trace_context text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE
    WHEN trace_context IS NULL THEN
        NULL
    WHEN octet_length(trace_context) > 568 THEN
        'is ' || octet_length(trace_context)::text || ' bytes, the limit is 568 (a 55-byte traceparent, a space and a tracestate of at most 512 bytes)'
    WHEN trace_context !~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}( |$)' THEN
        'must start with a W3C traceparent of version 00: 00-<trace id: 32 lowercase hex digits>-<parent id: 16 lowercase hex digits>-<flags: 2 hex digits>'
    WHEN substr(trace_context, 4, 32) = '00000000000000000000000000000000' OR substr(trace_context, 37, 16) = '0000000000000000' THEN
        'has an all-zero trace id or parent id, which W3C Trace Context forbids'
    WHEN trace_context !~ '^.{55}( [!-~]([ -~]*[!-~])?)?$' THEN
        'has a tracestate (after the space that follows the traceparent) that is not 1 to 512 bytes of printable ASCII without a leading or trailing space'
END
$$;

CREATE OR REPLACE FUNCTION outbox_trace_context_hint() RETURNS text
LANGUAGE sql IMMUTABLE AS $$
SELECT 'pass the W3C traceparent header value, optionally followed by one space and the tracestate header value, '
    || 'e.g. 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01, or NULL for none'
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'outbox_event'::regclass AND conname = 'outbox_event_trace_context_rule') THEN
        ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_trace_context_rule
            CHECK (outbox_trace_context_problem(trace_context) IS NULL) NOT VALID;
    END IF;
END
$$;

DROP FUNCTION IF EXISTS outbox_publish(text, text, text, text);
DROP FUNCTION IF EXISTS outbox_publish(text, jsonb, text, text);
DROP FUNCTION IF EXISTS outbox_publish_many(text[], jsonb[], text[], text[]);

-- outbox_publish: as in 006, plus not_before, strict routing and trace_context.
CREATE OR REPLACE FUNCTION outbox_publish(
    event_type    text,
    payload       jsonb,
    tenant_id     text        DEFAULT NULL,
    dispatch_key  text        DEFAULT NULL,
    not_before    timestamptz DEFAULT NULL,
    trace_context text        DEFAULT NULL
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

    INSERT INTO outbox_event AS e (event_type, payload, tenant_id, dispatch_key, scheduled_at, trace_context)
    VALUES (outbox_publish.event_type, outbox_publish.payload, outbox_publish.tenant_id, outbox_publish.dispatch_key,
            GREATEST(now(), outbox_publish.not_before), outbox_publish.trace_context)
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

-- outbox_publish(text, text, ...): as in 006, plus not_before and trace_context.
CREATE OR REPLACE FUNCTION outbox_publish(
    event_type    text,
    payload       text,
    tenant_id     text        DEFAULT NULL,
    dispatch_key  text        DEFAULT NULL,
    not_before    timestamptz DEFAULT NULL,
    trace_context text        DEFAULT NULL
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
    RETURN outbox_publish(event_type, body, tenant_id, dispatch_key, not_before, trace_context);
END
$$;

-- outbox_publish_many: as in 006, plus not_befores, strict routing and trace_contexts.
CREATE OR REPLACE FUNCTION outbox_publish_many(
    event_types    text[],
    payloads       jsonb[],
    tenant_ids     text[]        DEFAULT NULL,
    dispatch_keys  text[]        DEFAULT NULL,
    not_befores    timestamptz[] DEFAULT NULL,
    trace_contexts text[]        DEFAULT NULL
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
       OR coalesce(cardinality(trace_contexts), n) <> n THEN
        RAISE EXCEPTION 'outbox_publish_many: event_types, payloads, tenant_ids, dispatch_keys, not_befores and trace_contexts must have one element per event (got %, %, %, %, %, %)',
            n, coalesce(cardinality(payloads), 0), cardinality(tenant_ids), cardinality(dispatch_keys), cardinality(not_befores), cardinality(trace_contexts)
            USING ERRCODE = '22023', HINT = 'pass NULL for tenant_ids, dispatch_keys, not_befores or trace_contexts to leave them out';
    END IF;
    IF n > 10000 THEN
        RAISE EXCEPTION 'outbox_publish_many: % events, the limit is 10000; split the batch', n
            USING ERRCODE = '22023';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;

    SELECT t.i, t.event_type, t.tenant_id, t.dispatch_key, t.not_before, outbox_payload_problem(t.payload) AS problem,
           outbox_trace_context_problem(t.trace_context) AS trace_problem
    INTO bad
    FROM unnest(event_types, payloads, tenant_ids, dispatch_keys, not_befores, trace_contexts) WITH ORDINALITY
         AS t(event_type, payload, tenant_id, dispatch_key, not_before, trace_context, i)
    WHERE t.event_type IS NULL
       OR octet_length(t.event_type) > 255
       OR t.event_type !~ '^[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*){2,}$'
       OR outbox_payload_problem(t.payload) IS NOT NULL
       OR octet_length(t.tenant_id) NOT BETWEEN 1 AND 128
       OR octet_length(t.dispatch_key) NOT BETWEEN 1 AND 256
       OR t.not_before > now() + interval '8760 hours'
       OR outbox_trace_context_problem(t.trace_context) IS NOT NULL
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

    WITH input AS (
        SELECT nextval('outbox_event_id_seq') AS id, t.i, t.event_type, t.payload, t.tenant_id, t.dispatch_key, t.not_before, t.trace_context
        FROM unnest(event_types, payloads, tenant_ids, dispatch_keys, not_befores, trace_contexts) WITH ORDINALITY
             AS t(event_type, payload, tenant_id, dispatch_key, not_before, trace_context, i)
    ),
    ins AS (
        INSERT INTO outbox_event AS e (id, event_type, payload, tenant_id, dispatch_key, scheduled_at, trace_context)
        OVERRIDING SYSTEM VALUE
        SELECT input.id, input.event_type, input.payload, input.tenant_id, input.dispatch_key, GREATEST(now(), input.not_before), input.trace_context
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
        'outbox_publish(text, jsonb, text, text, timestamptz, text)',
        'outbox_publish(text, text, text, text, timestamptz, text)',
        'outbox_publish_many(text[], jsonb[], text[], text[], timestamptz[], text[])']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

GRANT EXECUTE ON FUNCTION outbox_publish(text, jsonb, text, text, timestamptz, text) TO outbox_producer, outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_publish(text, text, text, text, timestamptz, text) TO outbox_producer, outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_publish_many(text[], jsonb[], text[], text[], timestamptz[], text[]) TO outbox_producer, outbox_operator;

-- A producer that writes plain INSERTs may set the trace context too.
GRANT INSERT (trace_context) ON outbox_event TO outbox_producer;
