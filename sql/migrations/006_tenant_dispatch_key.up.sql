-- outbox:no-transaction
-- 006: dispatch keys are unique per tenant. Until now dispatch_key was unique
-- across all tenants, so tenant B publishing key invoice-1 after tenant A got
-- A's event id back and its own event was dropped. The scope of a key is now
-- its tenant; events without a tenant form one scope of their own.
-- tenant_id is never '' (CHECK length >= 1), so COALESCE(tenant_id, '') is a
-- safe scope key for the events without one, and it works on every Postgres
-- version this project supports (NULLS NOT DISTINCT would need 15).
--
-- This migration runs outside a transaction, one statement at a time, so
-- that it is safe on a large, live table: the new unique index is built
-- CONCURRENTLY (no lock that blocks producers or the dispatcher), the
-- publish functions switch to it, and only then is the old index dropped,
-- CONCURRENTLY too. Every statement is idempotent, and the migrator drops an
-- INVALID index left by an interrupted build before building it again. On a
-- fresh install (the table created by the same run, so empty) the migrator
-- leaves CONCURRENTLY out: a concurrent build waits for every older
-- transaction in the database, whatever table it works on.
--
-- While both indexes exist, a key that another tenant holds conflicts on the
-- old index. The functions use ON CONFLICT DO NOTHING without a target, so
-- that conflict is skipped too, and the lookup falls back to the key alone:
-- for those few seconds the old behaviour holds, and nothing fails.
--
-- Upgrade note: binaries older than this migration run INSERT ... ON
-- CONFLICT (dispatch_key) from Go, which needs the old index: once it is
-- dropped, their Publish fails. Deploy producers built with this release
-- together with the migration. SQL producers (outbox_publish) are not
-- affected: the function is replaced here.

CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS outbox_event_tenant_dispatch_key_key
    ON outbox_event ((COALESCE(tenant_id, '')), dispatch_key)
    WHERE dispatch_key IS NOT NULL;

-- The publish functions, replaced in one transaction (the statements
-- between BEGIN and COMMIT run on one session). They are SECURITY DEFINER,
-- so that producers publish with EXECUTE alone: migration 007 takes away
-- their INSERT of id (a producer choosing ids could make other producers'
-- inserts fail) and their SELECT of dispatch_key (other tenants' keys). The
-- functions run as the owner of the migrations, so their search_path is
-- pinned to this schema and pg_temp (last, so a temporary object cannot
-- stand in for one of ours), and EXECUTE is granted to the producer and
-- operator roles only, not to PUBLIC.
BEGIN;

-- outbox_publish: a duplicate is a stored event with the same tenant (or
-- none) and the same key. It applies the payload rule of migration 005
-- first, so that it names it before the INSERT.
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

    INSERT INTO outbox_event AS e (event_type, payload, tenant_id, dispatch_key)
    VALUES (outbox_publish.event_type, outbox_publish.payload, outbox_publish.tenant_id, outbox_publish.dispatch_key)
    ON CONFLICT DO NOTHING
    RETURNING e.id INTO event_id;

    IF event_id IS NULL AND outbox_publish.dispatch_key IS NOT NULL THEN
        SELECT e.id INTO event_id FROM outbox_event e
        WHERE COALESCE(e.tenant_id, '') = COALESCE(outbox_publish.tenant_id, '')
          AND e.dispatch_key = outbox_publish.dispatch_key;
        IF event_id IS NULL THEN
            -- Only while migration 006 runs: the old, tenant-blind index.
            SELECT e.id INTO event_id FROM outbox_event e WHERE e.dispatch_key = outbox_publish.dispatch_key LIMIT 1;
        END IF;
    END IF;
    IF event_id IS NULL THEN
        RAISE EXCEPTION 'outbox_publish: the event conflicts with a stored row that holds neither its tenant and dispatch key nor its id'
            USING ERRCODE = '23505', HINT = 'an event id was taken outside the identity sequence (INSERT ... OVERRIDING SYSTEM VALUE)';
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
CREATE OR REPLACE FUNCTION outbox_publish(
    event_type   text,
    payload      text,
    tenant_id    text DEFAULT NULL,
    dispatch_key text DEFAULT NULL
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
    RETURN outbox_publish(event_type, body, tenant_id, dispatch_key);
END
$$;

-- outbox_publish_many publishes a batch (Go's PublishMany) in one call: the
-- arrays hold one element per event (tenant_ids and dispatch_keys may be
-- NULL for "none at all"). Every element is validated first, with the rules
-- of outbox_publish, and the first bad one raises 22023 naming the array and
-- the element (payloads[3]); nothing is written then. It returns one row per
-- event in input order: ord (1-based position), duplicate, and the event's id
-- or, for a duplicate key (stored earlier, or repeated in the batch), the id
-- of the event that holds it.
--
-- Ids are drawn from the identity sequence for each element up front, so
-- that each keeps its id whether it is inserted or skipped by ON CONFLICT.
-- Duplicates are then looked up in a second statement: under READ
-- COMMITTED it sees a key committed by another transaction while the insert
-- waited. Under REPEATABLE READ and SERIALIZABLE, such a key raises 40001
-- instead (see outbox_publish above): retry the transaction.
CREATE OR REPLACE FUNCTION outbox_publish_many(
    event_types   text[],
    payloads      jsonb[],
    tenant_ids    text[] DEFAULT NULL,
    dispatch_keys text[] DEFAULT NULL
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
       OR coalesce(cardinality(dispatch_keys), n) <> n THEN
        RAISE EXCEPTION 'outbox_publish_many: event_types, payloads, tenant_ids and dispatch_keys must have one element per event (got %, %, %, %)',
            n, coalesce(cardinality(payloads), 0), cardinality(tenant_ids), cardinality(dispatch_keys)
            USING ERRCODE = '22023', HINT = 'pass NULL for tenant_ids or dispatch_keys to leave them out';
    END IF;
    IF n > 10000 THEN
        RAISE EXCEPTION 'outbox_publish_many: % events, the limit is 10000; split the batch', n
            USING ERRCODE = '22023';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;

    SELECT t.i, t.event_type, t.tenant_id, t.dispatch_key, outbox_payload_problem(t.payload) AS problem
    INTO bad
    FROM unnest(event_types, payloads, tenant_ids, dispatch_keys) WITH ORDINALITY
         AS t(event_type, payload, tenant_id, dispatch_key, i)
    WHERE t.event_type IS NULL
       OR octet_length(t.event_type) > 255
       OR t.event_type !~ '^[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*){2,}$'
       OR outbox_payload_problem(t.payload) IS NOT NULL
       OR octet_length(t.tenant_id) NOT BETWEEN 1 AND 128
       OR octet_length(t.dispatch_key) NOT BETWEEN 1 AND 256
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
        ELSE
            RAISE EXCEPTION 'outbox_publish_many: dispatch_keys[%] must be 1 to 256 bytes (got %)', bad.i, octet_length(bad.dispatch_key)
                USING ERRCODE = '22023';
        END IF;
    END IF;

    WITH input AS (
        SELECT nextval('outbox_event_id_seq') AS id, t.i, t.event_type, t.payload, t.tenant_id, t.dispatch_key
        FROM unnest(event_types, payloads, tenant_ids, dispatch_keys) WITH ORDINALITY
             AS t(event_type, payload, tenant_id, dispatch_key, i)
    ),
    ins AS (
        INSERT INTO outbox_event AS e (id, event_type, payload, tenant_id, dispatch_key)
        OVERRIDING SYSTEM VALUE
        SELECT input.id, input.event_type, input.payload, input.tenant_id, input.dispatch_key FROM input ORDER BY input.i
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
                      AND e.dispatch_key = dispatch_keys[u.o]),
                   -- Only while migration 006 runs: the old, tenant-blind index.
                   (SELECT e.id FROM outbox_event e WHERE e.dispatch_key = dispatch_keys[u.o] LIMIT 1))
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
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'outbox_publish(text, jsonb, text, text)',
        'outbox_publish(text, text, text, text)',
        'outbox_publish_many(text[], jsonb[], text[], text[])'
    ] LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO outbox_producer, outbox_operator', f);
    END LOOP;
END
$$;

COMMIT;

DROP INDEX CONCURRENTLY IF EXISTS outbox_event_dispatch_key_key;
