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
-- INVALID index left by an interrupted build before building it again.
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

-- outbox_publish: a duplicate is a stored event with the same tenant (or
-- none) and the same key. Everything else is as in migration 005.
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

DROP INDEX CONCURRENTLY IF EXISTS outbox_event_dispatch_key_key;
