-- 020: a done or cancelled keyed event that is requeued takes a new
-- ordering position (docs/ordering.md, "Limits"), found in review.
--
-- outbox_operator_apply (outbox_requeue's body, 007) put a requeued event
-- back to pending with the position it was published with. The claim then
-- handed it off at once (nothing earlier of its key was unfinished), and
-- its job queued by that old position, ahead of the key's jobs that had
-- been handed off and were waiting: a replay (allow_replay) of a done event
-- ran before events published after it and already handed off. A
-- cancelled event requeued while a batch held a later event of its key
-- could be handed off beside it.
--
-- Now the requeue of a done or cancelled event with an ordering key takes
-- the key's lock (the one a publish holds until it commits) and a new
-- position from outbox_ordering_position_seq, as a publish does: the event
-- is ordered by when it was requeued, behind whatever its key has handed
-- off or pending. It takes the lock without waiting
-- (pg_try_advisory_xact_lock): an event whose key a producer holds right
-- now is skipped and reported as locked (run the requeue again), so a
-- requeue never waits for, or deadlocks with, a producer's transaction. A
-- failed or stuck event keeps its position: the key's later events wait
-- behind it, as they did. A dry run takes no lock.
--
-- The function below is 007's, restated whole (CREATE OR REPLACE takes
-- the whole body and resets the function's settings, set again at the
-- end), with those two changes. One transaction.

BEGIN;
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE FUNCTION outbox_operator_apply(
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
          -- A done or cancelled keyed event requeued takes a new position
          -- under its key's lock, as a publish does (migration 020); a key
          -- a producer holds right now is skipped, reported as locked.
          AND (p_action <> 'requeue' OR p_dry_run OR e.ordering_key IS NULL OR e.status NOT IN ('done', 'cancelled')
               OR pg_try_advisory_xact_lock(outbox_ordering_lock_key(current_schema()::text, e.tenant_id, e.ordering_key)))
        ORDER BY e.id
        LIMIT p_max_events
        FOR UPDATE SKIP LOCKED
    ), u AS (
        UPDATE outbox_event e
        SET status       = CASE WHEN p_action = 'requeue' THEN 'pending' ELSE 'cancelled' END::outbox_status,
            retries      = CASE WHEN p_action = 'requeue' THEN 0 ELSE e.retries END,
            scheduled_at = CASE WHEN p_action = 'requeue' THEN now() ELSE e.scheduled_at END,
            processed_at = CASE WHEN p_action = 'requeue' THEN NULL ELSE e.processed_at END,
            ordering_position = CASE WHEN p_action = 'requeue' AND e.ordering_key IS NOT NULL AND c.old_status IN ('done', 'cancelled')
                                     THEN nextval('outbox_ordering_position_seq') ELSE e.ordering_position END,
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

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_operator_apply(text, text, boolean, text[], bigint[], text, text, timestamptz, timestamptz, text, int, boolean, jsonb) SET search_path = %I, pg_temp', current_schema());
    REVOKE ALL ON FUNCTION outbox_operator_apply(text, text, boolean, text[], bigint[], text, text, timestamptz, timestamptz, text, int, boolean, jsonb) FROM PUBLIC;
END
$$;

COMMIT;
