-- 007: each role can do its job, and nothing more. 004 gave the operator
-- full DML on outbox_event (changes without an audit row), let producers
-- choose event ids (one id ahead of the identity sequence breaks every
-- other producer's next insert) and read every tenant's dispatch keys, and
-- left the dispatcher without River's worker grants and both without the
-- receipts that retention purges. After this migration:
--
--   role               can                                       cannot
--   -----------------  ----------------------------------------  ---------------------------------------------
--   outbox_producer    INSERT (event_type, payload, tenant_id,   choose the id (INSERT (id, ...) OVERRIDING
--                      dispatch_key) into outbox_event; read     SYSTEM VALUE); read dispatch_key, payload,
--                      the id column (RETURNING id; ids reveal   tenant_id, status or any other column; UPDATE,
--                      nothing else); EXECUTE outbox_publish     DELETE, TRUNCATE; touch River, the audit,
--                      (and the publish functions of 005/006     receipts; call nextval on the id sequence
--                      where present)
--   outbox_dispatcher  outboxd: claim, mark done/failed (SELECT,  DELETE events directly (retention goes through
--                      UPDATE outbox_event); insert River jobs;  outbox_purge_done); INSERT events; write or
--                      River workers (SELECT, INSERT, UPDATE,    read outbox_audit; requeue or cancel; ALTER
--                      DELETE river_job, river_leader,           anything
--                      river_queue); receiver receipts (all DML
--                      on outbox_receipt); retention
--                      (outbox_purge_done, outbox_purge_receipts,
--                      outbox_job_run)
--   outbox_operator    outboxctl: read events, River jobs and    INSERT, UPDATE or DELETE outbox_event or
--                      receipts (stats, explain); requeue and    outbox_receipt directly; UPDATE or DELETE the
--                      cancel through outbox_requeue and         audit; change River jobs
--                      outbox_cancel (change + audit row in one
--                      transaction); retention (outbox_purge_*,
--                      outbox_job_run, INSERT outbox_audit);
--                      publish (outbox_publish and the publish
--                      functions of 005/006 where present); list
--                      the audit
--
-- River's worker grants were read from River's own migrations (riverpgxv5
-- v0.51.2, main line 001-008): at run time a River client working jobs
-- fetches, completes, snoozes, rescues, cancels and cleans river_job rows
-- (SELECT ... FOR UPDATE, INSERT for periodic jobs, UPDATE, DELETE), elects
-- its leader in river_leader and records its queues in river_queue (both
-- INSERT, UPDATE, DELETE by the leader's cleaners). river_migration is read
-- only by the migrator (the owner runs migrations); river_client and
-- river_client_queue were dropped by River's migration 007, and
-- river_notification is used by River's SQLite driver only. River's
-- reindexer (midnight UTC) runs REINDEX, which only the owner may do: as
-- outbox_dispatcher it logs a permission error and the indexes are left as
-- they are; schedule REINDEX as the owner if you need it.
--
-- Operator changes go through SECURITY DEFINER functions that apply the
-- change and write the audit row in one transaction: revoking the
-- operator's DML then leaves no unaudited path. Dry runs change nothing,
-- write no audit row and draw no audit id. Retention also goes through
-- SECURITY DEFINER functions (rather than DELETE grants) because a DELETE
-- grant cannot be limited to done rows: with it the dispatcher or the
-- operator could delete pending events, and the operator could do it
-- without an audit row. The functions delete only done rows processed more
-- than an hour ago (the smallest OUTBOX_DONE_RETENTION_HOURS) and expired
-- receipts, which is what retention did before. `outboxctl retention run`
-- records its audit row as before (outbox_audit INSERT).
--
-- Every SECURITY DEFINER function pins search_path to this schema and
-- pg_temp (last), so a caller's objects cannot stand in for the outbox's,
-- and EXECUTE is revoked from PUBLIC. They run as the owner of the
-- migrations.
--
-- outbox_audit.db_user now defaults to session_user (the login role): inside
-- the audited functions current_user is their owner, not the operator.

-- Producer: no chosen ids, no dispatch keys. SELECT (id) stays: a plain
-- `INSERT ... RETURNING id` needs it, and ids say nothing about an event.
-- The identity column draws its value without a sequence privilege, so
-- USAGE on the sequence (nextval, currval) goes too.
REVOKE INSERT (id) ON outbox_event FROM outbox_producer;
REVOKE SELECT (dispatch_key) ON outbox_event FROM outbox_producer;
REVOKE USAGE ON SEQUENCE outbox_event_id_seq FROM outbox_producer;

-- Dispatcher: River workers and receivers; retention through functions.
REVOKE DELETE ON outbox_event FROM outbox_dispatcher;
GRANT SELECT, INSERT, UPDATE, DELETE ON river_job TO outbox_dispatcher;
GRANT SELECT, INSERT, UPDATE, DELETE ON river_leader TO outbox_dispatcher;
GRANT SELECT, INSERT, UPDATE, DELETE ON river_queue TO outbox_dispatcher;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_receipt TO outbox_dispatcher;

-- Operator: read-only on events; changes through the functions below.
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON outbox_event FROM outbox_operator;
REVOKE USAGE ON SEQUENCE outbox_event_id_seq FROM outbox_operator;
GRANT SELECT ON outbox_receipt TO outbox_operator;
-- River's queue table: stats lists the queues workers reported.
GRANT SELECT ON river_queue TO outbox_operator;

ALTER TABLE outbox_audit ALTER COLUMN db_user SET DEFAULT session_user;

-- outbox_operator_apply is the body of outbox_requeue and outbox_cancel. It
-- is not granted to anyone: the two wrappers fix p_action.
--
-- The selection is the one outboxctl takes (internal/filter.Predicate):
-- NULL leaves a condition out; the type prefix matches with starts_with and
-- the error text with strpos (no wildcards). Statuses must be ones the
-- action may change:
--   requeue: failed, cancelled, processing (stuck only), done (p_allow_replay)
--   cancel:  pending, failed, processing (stuck only)
-- A processing row is stuck when its locked_until is NULL or past: no
-- dispatcher will finish it (the claim rescues only a past locked_until).
-- A processing row with a future lease is reported as skipped.
--
-- It counts what the selection matches per status (the ones it will not
-- change are reported as skipped, and with ids every status is reported),
-- changes up to p_max_events eligible rows in id order, skipping rows
-- locked right now (a dispatcher handing them off), and writes the audit
-- row. A dry run selects the same rows with the same locks and changes and
-- records nothing.
CREATE FUNCTION outbox_operator_apply(
    p_action         text,
    p_actor          text,
    p_dry_run        boolean,
    p_statuses       text[],
    p_ids            bigint[],
    p_type_prefix    text,
    p_tenant_id      text,
    p_since          timestamptz,
    p_until          timestamptz,
    p_error_contains text,
    p_max_events     int,
    p_allow_replay   boolean,
    p_extra          jsonb
) RETURNS TABLE (o_affected int, o_ids bigint[], o_from jsonb, o_skipped jsonb, o_remaining int, o_audit_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_eligible  text[];
    v_report    text[];
    v_statuses  text[];
    v_row       record;
    v_matched   int := 0;
    v_skipped   jsonb := '{}';
    v_from      jsonb := '{}';
    v_ids       bigint[];
    v_missing   int;
    v_affected  int;
    v_audit_id  bigint;
BEGIN
    IF p_action = 'requeue' THEN
        v_eligible := ARRAY['failed', 'cancelled', 'processing'];
        IF p_allow_replay THEN
            v_eligible := v_eligible || 'done'::text;
        END IF;
        v_report := ARRAY['pending', 'processing'];
        v_statuses := coalesce(p_statuses, CASE WHEN p_ids IS NULL THEN ARRAY['failed'] ELSE ARRAY['failed', 'cancelled', 'processing'] END);
    ELSIF p_action = 'cancel' THEN
        v_eligible := ARRAY['pending', 'failed', 'processing'];
        v_report := ARRAY['processing', 'done'];
        v_statuses := coalesce(p_statuses, CASE WHEN p_ids IS NULL THEN ARRAY['pending', 'failed'] ELSE ARRAY['pending', 'failed', 'processing'] END);
    ELSE
        RAISE EXCEPTION 'outbox_operator_apply: unknown action %', quote_literal(p_action) USING ERRCODE = '22023';
    END IF;
    IF cardinality(v_statuses) = 0 OR NOT v_statuses <@ v_eligible THEN
        RAISE EXCEPTION 'outbox_%: statuses % not allowed; it changes %', p_action, v_statuses, v_eligible
            USING ERRCODE = '22023',
                  HINT = CASE WHEN p_action = 'requeue' AND 'done' = ANY(v_statuses) THEN 'replaying done events needs allow_replay => true' END;
    END IF;
    IF p_max_events IS NULL OR p_max_events < 1 OR p_max_events > 100000 THEN
        RAISE EXCEPTION 'outbox_%: max_events must be 1 to 100000 (got %)', p_action, p_max_events USING ERRCODE = '22023';
    END IF;
    IF p_dry_run IS NULL THEN
        RAISE EXCEPTION 'outbox_%: dry_run is required', p_action USING ERRCODE = '22023';
    END IF;
    IF p_ids IS NOT NULL THEN
        v_report := enum_range(NULL::outbox_status)::text[]; -- account for every id
    END IF;

    -- What the selection matches, by status: '' is what this run may change.
    FOR v_row IN
        SELECT CASE WHEN e.status::text = ANY(v_statuses)
                     AND (e.status <> 'processing' OR e.locked_until IS NULL OR e.locked_until < now())
                    THEN '' ELSE e.status::text END AS cat,
               count(*)::int AS n
        FROM outbox_event e
        WHERE (p_ids IS NULL OR e.id = ANY(p_ids))
          AND (p_type_prefix IS NULL OR starts_with(e.event_type, p_type_prefix))
          AND (p_tenant_id IS NULL OR e.tenant_id = p_tenant_id)
          AND (p_since IS NULL OR e.created_at >= p_since)
          AND (p_until IS NULL OR e.created_at < p_until)
          AND (p_error_contains IS NULL OR strpos(e.last_error, p_error_contains) > 0)
          AND (e.status::text = ANY(v_statuses) OR e.status::text = ANY(v_report))
        GROUP BY 1
    LOOP
        IF v_row.cat = '' THEN
            v_matched := v_row.n;
        ELSE
            v_skipped := v_skipped || jsonb_build_object(v_row.cat, v_row.n);
        END IF;
    END LOOP;
    IF p_ids IS NOT NULL THEN
        SELECT (SELECT count(DISTINCT i) FROM unnest(p_ids) AS i) - count(*) INTO v_missing
        FROM outbox_event e WHERE e.id = ANY(p_ids);
        IF v_missing > 0 THEN
            v_skipped := v_skipped || jsonb_build_object('not_found', v_missing);
        END IF;
    END IF;

    -- The change. c locks exactly the rows it returns (SKIP LOCKED leaves a
    -- row a dispatcher holds); u changes them unless this is a dry run. A
    -- data-modifying CTE always runs, whether or not the outer query reads it.
    -- requeue: back to pending with the full retry budget, due now, unlocked,
    -- not processed; last_error stays; the wake trigger fires at commit.
    -- cancel: cancelled and unlocked; everything else stays.
    WITH c AS (
        SELECT e.id, e.status::text AS old_status FROM outbox_event e
        WHERE (p_ids IS NULL OR e.id = ANY(p_ids))
          AND (p_type_prefix IS NULL OR starts_with(e.event_type, p_type_prefix))
          AND (p_tenant_id IS NULL OR e.tenant_id = p_tenant_id)
          AND (p_since IS NULL OR e.created_at >= p_since)
          AND (p_until IS NULL OR e.created_at < p_until)
          AND (p_error_contains IS NULL OR strpos(e.last_error, p_error_contains) > 0)
          AND e.status::text = ANY(v_statuses)
          AND (e.status <> 'processing' OR e.locked_until IS NULL OR e.locked_until < now())
        ORDER BY e.id
        LIMIT p_max_events
        FOR UPDATE SKIP LOCKED
    ), u AS (
        UPDATE outbox_event e
        SET status       = CASE WHEN p_action = 'requeue' THEN 'pending' ELSE 'cancelled' END::outbox_status,
            retries      = CASE WHEN p_action = 'requeue' THEN 0 ELSE e.retries END,
            scheduled_at = CASE WHEN p_action = 'requeue' THEN now() ELSE e.scheduled_at END,
            processed_at = CASE WHEN p_action = 'requeue' THEN NULL ELSE e.processed_at END,
            locked_until = NULL
        FROM c WHERE e.id = c.id AND NOT p_dry_run
        RETURNING e.id
    )
    SELECT coalesce(array_agg(c.id ORDER BY c.id), '{}'),
           coalesce((SELECT jsonb_object_agg(s, n) FROM (SELECT old_status AS s, count(*) AS n FROM c GROUP BY 1) x), '{}')
    INTO v_ids, v_from
    FROM c;

    v_affected := cardinality(v_ids);
    IF least(v_matched, p_max_events) - v_affected > 0 THEN
        v_skipped := v_skipped || jsonb_build_object('locked', least(v_matched, p_max_events) - v_affected);
    END IF;

    IF NOT p_dry_run THEN
        INSERT INTO outbox_audit (actor, db_user, action, filter, affected, detail)
        VALUES (p_actor, session_user, p_action,
                jsonb_strip_nulls(jsonb_build_object(
                    'ids', p_ids, 'statuses', v_statuses, 'type_prefix', p_type_prefix, 'tenant', p_tenant_id,
                    'since', p_since, 'until', p_until, 'error_contains', p_error_contains, 'limit', p_max_events,
                    'allow_replay', CASE WHEN p_allow_replay THEN true END)),
                v_affected,
                coalesce(p_extra, '{}') || jsonb_build_object(
                    'skipped', v_skipped, 'from', v_from,
                    'remaining', greatest(v_matched - v_affected, 0), 'ids', v_ids[1:100]))
        RETURNING id INTO v_audit_id;
    END IF;

    RETURN QUERY SELECT v_affected, v_ids, v_from, v_skipped, greatest(v_matched - v_affected, 0), v_audit_id;
END
$$;

-- outbox_requeue puts failed, cancelled and stuck processing events (and,
-- with allow_replay, done events) back to pending and audits it; see
-- outbox_operator_apply. statuses NULL means failed (failed, cancelled and
-- processing when ids are given). The result's audit_id is NULL for a dry
-- run. From psql:
--
--   SELECT * FROM outbox_requeue('alice', dry_run => true, ids => '{42}');
CREATE FUNCTION outbox_requeue(
    actor          text,
    dry_run        boolean,
    statuses       text[]      DEFAULT NULL,
    ids            bigint[]    DEFAULT NULL,
    type_prefix    text        DEFAULT NULL,
    tenant_id      text        DEFAULT NULL,
    since          timestamptz DEFAULT NULL,
    until          timestamptz DEFAULT NULL,
    error_contains text        DEFAULT NULL,
    max_events     int         DEFAULT 1000,
    allow_replay   boolean     DEFAULT false,
    extra          jsonb       DEFAULT '{}'
) RETURNS TABLE (affected int, event_ids bigint[], from_statuses jsonb, skipped jsonb, remaining int, audit_id bigint)
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT * FROM outbox_operator_apply('requeue', actor, dry_run, statuses, ids, type_prefix, tenant_id,
                                        since, until, error_contains, max_events, allow_replay, extra)
$$;

-- outbox_cancel moves pending, failed and stuck processing events to
-- cancelled and audits it. statuses NULL means pending and failed (and
-- processing when ids are given).
CREATE FUNCTION outbox_cancel(
    actor          text,
    dry_run        boolean,
    statuses       text[]      DEFAULT NULL,
    ids            bigint[]    DEFAULT NULL,
    type_prefix    text        DEFAULT NULL,
    tenant_id      text        DEFAULT NULL,
    since          timestamptz DEFAULT NULL,
    until          timestamptz DEFAULT NULL,
    error_contains text        DEFAULT NULL,
    max_events     int         DEFAULT 1000,
    extra          jsonb       DEFAULT '{}'
) RETURNS TABLE (affected int, event_ids bigint[], from_statuses jsonb, skipped jsonb, remaining int, audit_id bigint)
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT * FROM outbox_operator_apply('cancel', actor, dry_run, statuses, ids, type_prefix, tenant_id,
                                        since, until, error_contains, max_events, false, extra)
$$;

-- outbox_purge_done deletes up to max_rows done events processed before
-- cutoff, oldest first, skipping rows locked right now (an operator
-- requeueing them), and returns how many it deleted. The status is part of
-- the predicate: pending, failed and cancelled rows can never match. The
-- cutoff must be at least an hour ago.
CREATE FUNCTION outbox_purge_done(cutoff timestamptz, max_rows int) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    n bigint;
BEGIN
    IF cutoff IS NULL OR cutoff > now() - interval '1 hour' THEN
        RAISE EXCEPTION 'outbox_purge_done: cutoff % is less than an hour ago', cutoff USING ERRCODE = '22023';
    END IF;
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > 10000 THEN
        RAISE EXCEPTION 'outbox_purge_done: max_rows must be 1 to 10000 (got %)', max_rows USING ERRCODE = '22023';
    END IF;
    WITH c AS (
        SELECT e.id FROM outbox_event e
        WHERE e.status = 'done' AND e.processed_at < cutoff
        ORDER BY e.processed_at
        LIMIT max_rows
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM outbox_event e USING c WHERE e.id = c.id;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- outbox_purge_receipts deletes up to max_rows receipts and claims past
-- their TTL (outboxriver.PurgeReceiptsSQL) and returns how many.
CREATE FUNCTION outbox_purge_receipts(max_rows int) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    n bigint;
BEGIN
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > 10000 THEN
        RAISE EXCEPTION 'outbox_purge_receipts: max_rows must be 1 to 10000 (got %)', max_rows USING ERRCODE = '22023';
    END IF;
    WITH expired AS (
        SELECT r.receiver, r.event_id FROM outbox_receipt r
        WHERE r.expires_at < now()
        ORDER BY r.expires_at
        LIMIT max_rows
        FOR UPDATE SKIP LOCKED)
    DELETE FROM outbox_receipt r USING expired x
    WHERE r.receiver = x.receiver AND r.event_id = x.event_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- Pin search_path, revoke PUBLIC, grant.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'outbox_operator_apply(text, text, boolean, text[], bigint[], text, text, timestamptz, timestamptz, text, int, boolean, jsonb)',
        'outbox_requeue(text, boolean, text[], bigint[], text, text, timestamptz, timestamptz, text, int, boolean, jsonb)',
        'outbox_cancel(text, boolean, text[], bigint[], text, text, timestamptz, timestamptz, text, int, jsonb)',
        'outbox_purge_done(timestamptz, int)',
        'outbox_purge_receipts(int)']::regprocedure[]
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

GRANT EXECUTE ON FUNCTION outbox_requeue(text, boolean, text[], bigint[], text, text, timestamptz, timestamptz, text, int, boolean, jsonb) TO outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_cancel(text, boolean, text[], bigint[], text, text, timestamptz, timestamptz, text, int, jsonb) TO outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_purge_done(timestamptz, int) TO outbox_dispatcher, outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_purge_receipts(int) TO outbox_dispatcher, outbox_operator;

-- The operator publishes (outboxctl publish) through the publish functions:
-- outbox_publish (001, granted in 004) and outbox_publish_many where a
-- migration before this one created it. Guarded, so that this migration
-- does not depend on it.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc p
        WHERE p.pronamespace = (SELECT n.oid FROM pg_namespace n WHERE n.nspname = current_schema())
          AND p.proname = 'outbox_publish_many'
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO outbox_producer, outbox_operator', f);
    END LOOP;
END
$$;
