-- 023: events put back by the unhold trigger wake a dispatcher at commit,
-- not in the middle of the statement's transaction.
--
-- 021's and 022's outbox_event_unhold called outbox_wake's lock check
-- itself, in the statement that put held events back: when no dispatcher
-- was idle it took the wake lock's shared form there and kept it until the
-- transaction ended. An operator who left that transaction open (a requeue
-- or cancel in psql, not yet committed) kept every dispatcher from going
-- idle: each found the lock shared, gave up after 250 ms, and ran another
-- claim pass, four a second, until the transaction ended. outbox_wake
-- itself runs from deferred triggers, at commit, for that reason.
--
-- The wake now comes from a deferred constraint trigger on the rows the
-- unhold puts back (held_from set, then cleared with the row pending and
-- due), like outbox_event_wake_requeue for a requeued row; the function
-- no longer notifies. Its body is 022's restated whole (CREATE OR REPLACE
-- needs the whole body) without the notify.

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
    -- The events put back wake a dispatcher at commit: outbox_event_wake_unheld.
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_event_wake_unheld ON outbox_event;
CREATE CONSTRAINT TRIGGER outbox_event_wake_unheld
    AFTER UPDATE OF scheduled_at ON outbox_event
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.held_from IS NOT NULL AND NEW.held_from IS NULL
                       AND NEW.status = 'pending' AND NEW.scheduled_at <= now())
    EXECUTE FUNCTION outbox_wake();

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_event_unhold() SET search_path = %I, pg_temp', current_schema());
    REVOKE ALL ON FUNCTION outbox_event_unhold() FROM PUBLIC;
END
$$;

COMMIT;
