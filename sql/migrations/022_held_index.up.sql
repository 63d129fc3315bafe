-- outbox:no-transaction
-- 022: the unhold trigger (migration 021) looks for held events in an index
-- of their own before anything else.
--
-- 021's outbox_event_unhold first looked for an earlier unfinished event
-- of the key, then for the key's held events after OLD, both through
-- outbox_event_ordering_idx. A statement that cancels or deletes many
-- unfinished events of one key (100,000 delayed reminders of one order)
-- fires the trigger for each row, after the statement: every probe walked
-- the index entries of the rows the statement had already changed, whose
-- old versions stay in the index, so the statement's cost grew with the
-- square of the key's events.
--
-- outbox_event_held_idx holds only held events (held_from set: a few, for
-- as long as a key is held), and the trigger now asks it first: with
-- nothing held after OLD, which is the rule for such a statement, it
-- returns after one probe of a small index. Only when held events exist
-- does it go on to the earlier-event check and the update, as before.
--
-- The function's body is 021's restated whole (CREATE OR REPLACE needs the
-- whole body), with the first probe added before 021's two steps.
--
-- The index is built CONCURRENTLY (no lock that blocks producers or the
-- dispatcher); on a fresh install the migrator leaves CONCURRENTLY out. An
-- event is in the index only while it is held: the updates of events that
-- are never held (nearly all) evaluate its predicate and add nothing.

CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_event_held_idx
    ON outbox_event ((COALESCE(tenant_id, '')), ordering_key, ordering_position)
    WHERE held_from IS NOT NULL;

BEGIN;
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE FUNCTION outbox_event_unhold() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    -- Nothing held after OLD: nothing to put back. One probe of
    -- outbox_event_held_idx, whatever else the statement changed.
    PERFORM 1 FROM outbox_event h
    WHERE COALESCE(h.tenant_id, '') = COALESCE(OLD.tenant_id, '') AND h.ordering_key = OLD.ordering_key
      AND h.held_from IS NOT NULL
      AND h.ordering_position > OLD.ordering_position
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Held events wait for the earliest unfinished event of their key. An
    -- earlier one than OLD holds them still; and of the rows of one
    -- statement (a requeue of a key's failed events), only the earliest
    -- goes on to the key's range.
    PERFORM 1 FROM outbox_event p
    WHERE COALESCE(p.tenant_id, '') = COALESCE(OLD.tenant_id, '') AND p.ordering_key = OLD.ordering_key
      AND p.status IN ('pending', 'processing', 'failed')
      AND p.ordering_position < OLD.ordering_position
    LIMIT 1;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    -- SKIP LOCKED: two operator statements that each hold one key's head
    -- and another key's held event must not wait for each other (a
    -- deadlock); a held event locked by another transaction (a batch that
    -- holds it again, an operator's cancel of it) is left to the minute's
    -- bound.
    UPDATE outbox_event e
    SET scheduled_at = e.held_from, held_from = NULL
    WHERE e.id IN (
        SELECT h.id FROM outbox_event h
        WHERE COALESCE(h.tenant_id, '') = COALESCE(OLD.tenant_id, '') AND h.ordering_key = OLD.ordering_key
          AND h.status = 'pending' AND h.held_from IS NOT NULL
          AND h.ordering_position > OLD.ordering_position
        FOR UPDATE SKIP LOCKED);
    -- As outbox_wake: notify only when a dispatcher is idle-waiting.
    IF FOUND AND NOT pg_try_advisory_xact_lock_shared(1868720215, hashtext('outbox_wake:' || TG_TABLE_SCHEMA)) THEN
        PERFORM pg_notify('outbox_wake', TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_event_unhold() SET search_path = %I, pg_temp', current_schema());
    REVOKE ALL ON FUNCTION outbox_event_unhold() FROM PUBLIC;
END
$$;

COMMIT;
