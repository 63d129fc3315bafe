-- 008: strict routing at publish, and the rule for delayed events.
--
-- Delayed events. The publish functions take an optional, named
-- not_before timestamptz (outbox_publish) and not_befores timestamptz[]
-- (outbox_publish_many; a NULL element: that event is not delayed): they
-- are defined once with their final parameters in 010, which adds the trace
-- context beside it (this migration defines no publish function: a copy
-- here would be replaced two migrations later). The event's scheduled_at is
-- GREATEST(now(), not_before): NULL or a time in the past means now, and
-- the database's clock decides, never the producer's. The claim takes only
-- rows with scheduled_at <= now(), so a delayed event stays pending and
-- unclaimed until it is due. A not_before more than 8760 hours (365 days,
-- outbox.MaxDelay) ahead of the database's clock is refused with 22023
-- naming the field (not_before, not_befores[i]). A duplicate dispatch key
-- returns the stored event's id and ignores the new due time, as it
-- ignores the new payload.
--
-- Strict routing. outbox_route holds the prefixes of the routes file as
-- `outboxctl routes sync` last wrote them (prefix, queues), and
-- outbox_route_setting (one row) says whether strict routing is on. With
-- strict on, every INSERT into outbox_event whose event_type no synced
-- prefix matches is refused with 22023 naming the type and the fix: the
-- publish functions (010) check first, so that they can name the batch position
-- (event_types[3]); a trigger checks every inserted row, so a plain INSERT
-- by a producer is held to the same rule. A prefix matches
-- as route.PrefixMatches does: a prefix ending in a dot matches the types
-- that start with it, any other prefix (a complete type) matches only
-- itself. With strict off (the default) the trigger is disabled and the
-- cost is one read of the one-row setting per publish function call.
-- Producers need no new grant.
--
-- Every statement is idempotent (IF NOT EXISTS, OR REPLACE, IF EXISTS), so
-- that running it again is harmless.
--
-- Grants, in the style of 007: the operator changes the synced routes
-- through outbox_routes_sync, a SECURITY DEFINER function that replaces the
-- set, sets the mode and writes the audit row in one transaction (no
-- unaudited path: the operator gets SELECT on the tables, not DML). The
-- dispatcher reads them (outboxd warns at start-up when they differ from
-- its routes file).

CREATE TABLE IF NOT EXISTS outbox_route (
    -- a rule prefix as in the routes file: whole segments ending in a dot,
    -- or a complete event type (route.ValidatePrefix).
    prefix    text        PRIMARY KEY,
    -- the rule's River queues, in file order (for drift reports only).
    queues    text[]      NOT NULL,
    synced_at timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT outbox_route_prefix_format CHECK (
        octet_length(prefix) <= 255 AND (
            prefix ~ '^([a-z0-9]+(-[a-z0-9]+)*\.)+$'
            OR prefix ~ '^[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*){2,}$')),
    CONSTRAINT outbox_route_queues_present CHECK (cardinality(queues) >= 1)
);

-- The mode and the last sync. Exactly one row (id is always true).
CREATE TABLE IF NOT EXISTS outbox_route_setting (
    id        boolean     PRIMARY KEY DEFAULT true,
    strict    boolean     NOT NULL DEFAULT false,
    synced_at timestamptz,
    synced_by text,
    source    text,

    CONSTRAINT outbox_route_setting_one_row CHECK (id)
);
INSERT INTO outbox_route_setting (id) VALUES (true) ON CONFLICT DO NOTHING;

-- A synced prefix matches an event type as route.PrefixMatches says: the
-- same EXISTS is written out in the trigger and the publish functions
-- (a helper function with a pinned search_path is not inlined and costs a
-- configuration change per call, measured at tens of microseconds per row).
-- The table holds tens of rows: a scan is cheap.

-- The strict-routing hint, in one place.
CREATE OR REPLACE FUNCTION outbox_route_strict_hint() RETURNS text
LANGUAGE sql IMMUTABLE AS $$
SELECT 'add a route whose prefix matches it to the routes file and run `outboxctl routes sync --routes FILE`, '
    || 'or turn strict routing off with `outboxctl routes sync --routes FILE --strict off`'
$$;

-- outbox_event_strict_route refuses an inserted row whose event_type no
-- synced prefix matches. Its trigger is enabled only while strict routing
-- is on (outbox_routes_sync enables and disables it when the mode changes),
-- so with strict routing off a plain INSERT pays nothing for it: a per-row
-- read of the setting measured about 5 us per row, half again the cost of
-- an INSERT. SECURITY DEFINER so that it reads outbox_route on behalf of a
-- producer, who has no privilege on it; a trigger function cannot be
-- called directly, so this lends the producer nothing else.
CREATE OR REPLACE FUNCTION outbox_event_strict_route() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM outbox_route r WHERE r.prefix = NEW.event_type OR (right(r.prefix, 1) = '.' AND starts_with(NEW.event_type, r.prefix))) THEN
        RAISE EXCEPTION 'outbox_event: event_type % matches no synced route (strict routing is on)', quote_literal(NEW.event_type)
            USING ERRCODE = '22023', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'event_type',
                  CONSTRAINT = 'outbox_route_strict', HINT = outbox_route_strict_hint();
    END IF;
    RETURN NEW;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'outbox_event'::regclass AND tgname = 'outbox_event_strict_route') THEN
        CREATE TRIGGER outbox_event_strict_route
            BEFORE INSERT ON outbox_event
            FOR EACH ROW EXECUTE FUNCTION outbox_event_strict_route();
        ALTER TABLE outbox_event DISABLE TRIGGER outbox_event_strict_route;
    END IF;
END
$$;

-- outbox_routes_sync replaces the synced routes with routes (a JSON array
-- of {"prefix": "...", "queues": ["..."]}, as `outboxctl routes sync`
-- reads them from the routes file), sets strict routing when strict is not
-- NULL (NULL keeps the mode), and writes the audit row (action
-- routes-sync), all in one transaction. It returns what changed: the
-- prefixes added, removed and changed (other queues), how many stayed the
-- same, the mode before and after, and the audit id. A dry run changes and
-- records nothing (audit_id NULL). Concurrent syncs take turns (the setting
-- row is locked). Strict routing with no routes would refuse every event:
-- it is refused. From psql:
--
--   SELECT * FROM outbox_routes_sync('alice', dry_run => true,
--       routes => '[{"prefix": "mail.", "queues": ["outbox_mail"]}]', strict => true);
CREATE OR REPLACE FUNCTION outbox_routes_sync(
    actor   text,
    dry_run boolean,
    routes  jsonb,
    strict  boolean DEFAULT NULL,
    source  text    DEFAULT NULL
) RETURNS TABLE (added text[], removed text[], changed text[], unchanged int,
                 strict_before boolean, strict_after boolean, audit_id bigint)
LANGUAGE plpgsql SECURITY DEFINER AS $$
#variable_conflict use_variable
DECLARE
    v_before   boolean;
    v_after    boolean;
    v_added    text[];
    v_removed  text[];
    v_changed  text[];
    v_same     int;
    v_audit_id bigint;
BEGIN
    IF dry_run IS NULL THEN
        RAISE EXCEPTION 'outbox_routes_sync: dry_run is required' USING ERRCODE = '22023';
    END IF;
    IF routes IS NULL OR jsonb_typeof(routes) <> 'array' THEN
        RAISE EXCEPTION 'outbox_routes_sync: routes must be a JSON array of {"prefix": ..., "queues": [...]}' USING ERRCODE = '22023';
    END IF;
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(routes) r
               WHERE jsonb_typeof(r) <> 'object' OR coalesce(jsonb_typeof(r -> 'prefix'), '') <> 'string'
                  OR coalesce(jsonb_typeof(r -> 'queues'), '') <> 'array' OR jsonb_array_length(r -> 'queues') = 0) THEN
        RAISE EXCEPTION 'outbox_routes_sync: every route needs a "prefix" string and a non-empty "queues" array' USING ERRCODE = '22023';
    END IF;

    SELECT s.strict INTO v_before FROM outbox_route_setting s FOR UPDATE;
    v_after := coalesce(strict, v_before);
    IF v_after AND jsonb_array_length(routes) = 0 THEN
        RAISE EXCEPTION 'outbox_routes_sync: strict routing with no routes would refuse every event'
            USING ERRCODE = '22023', HINT = 'sync a routes file with at least one route, or turn strict routing off';
    END IF;

    IF EXISTS (SELECT 1 FROM jsonb_array_elements(routes) r GROUP BY r ->> 'prefix' HAVING count(*) > 1) THEN
        RAISE EXCEPTION 'outbox_routes_sync: a prefix appears more than once' USING ERRCODE = '22023';
    END IF;

    WITH n AS (
        SELECT r ->> 'prefix' AS prefix, ARRAY(SELECT jsonb_array_elements_text(r -> 'queues')) AS queues
        FROM jsonb_array_elements(routes) r
    )
    SELECT coalesce(array_agg(n.prefix ORDER BY n.prefix) FILTER (WHERE o.prefix IS NULL), '{}'),
           coalesce(array_agg(o.prefix ORDER BY o.prefix) FILTER (WHERE n.prefix IS NULL), '{}'),
           coalesce(array_agg(n.prefix ORDER BY n.prefix) FILTER (WHERE n.prefix IS NOT NULL AND o.prefix IS NOT NULL AND n.queues <> o.queues), '{}'),
           count(*) FILTER (WHERE n.queues = o.queues)
    INTO v_added, v_removed, v_changed, v_same
    FROM n FULL JOIN outbox_route o ON o.prefix = n.prefix;

    IF NOT dry_run THEN
        DELETE FROM outbox_route;
        INSERT INTO outbox_route (prefix, queues)
        SELECT r ->> 'prefix', ARRAY(SELECT jsonb_array_elements_text(r -> 'queues'))
        FROM jsonb_array_elements(routes) r;
        UPDATE outbox_route_setting s
        SET strict = v_after, synced_at = now(), synced_by = actor, source = outbox_routes_sync.source;
        IF v_after IS DISTINCT FROM v_before THEN
            -- ALTER TABLE takes a SHARE ROW EXCLUSIVE lock on outbox_event
            -- until this transaction ends: it waits for writers in flight
            -- and blocks new ones meanwhile, so it gives up after 5 s
            -- rather than queue producers behind a long transaction.
            PERFORM set_config('lock_timeout', '5s', true);
            BEGIN
                EXECUTE format('ALTER TABLE outbox_event %s TRIGGER outbox_event_strict_route',
                               CASE WHEN v_after THEN 'ENABLE' ELSE 'DISABLE' END);
            EXCEPTION WHEN lock_not_available THEN
                RAISE EXCEPTION 'outbox_routes_sync: could not switch strict routing % within 5 s: a long transaction holds outbox_event',
                    CASE WHEN v_after THEN 'on' ELSE 'off' END
                    USING ERRCODE = '55P03', HINT = 'find it in pg_stat_activity (xact_start), then run the sync again';
            END;
        END IF;
        INSERT INTO outbox_audit (actor, db_user, action, filter, affected, detail)
        VALUES (actor, session_user, 'routes-sync',
                jsonb_strip_nulls(jsonb_build_object('source', source, 'strict', strict)),
                cardinality(v_added) + cardinality(v_removed) + cardinality(v_changed),
                jsonb_build_object('added', v_added, 'removed', v_removed, 'changed', v_changed,
                                   'unchanged', v_same, 'strict_before', v_before, 'strict_after', v_after))
        RETURNING id INTO v_audit_id;
    END IF;

    RETURN QUERY SELECT v_added, v_removed, v_changed, v_same, v_before, v_after, v_audit_id;
END
$$;

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'outbox_routes_sync(text, boolean, jsonb, boolean, text)',
        'outbox_event_strict_route()']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

GRANT EXECUTE ON FUNCTION outbox_routes_sync(text, boolean, jsonb, boolean, text) TO outbox_operator;
GRANT SELECT ON outbox_route, outbox_route_setting TO outbox_operator, outbox_dispatcher;
