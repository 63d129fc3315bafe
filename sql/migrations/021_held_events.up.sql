-- 021: events held back for their ordering key leave the claim until the
-- event they wait for can move (docs/ordering.md, "Held in the outbox").
--
-- An event of a key is handed off only after every earlier event of its
-- key (migration 011). When the earliest unfinished one is dead-lettered,
-- backs off after a failed attempt, or is delayed, the key's later events
-- are due but held, and every claim that reached them locked them, found
-- them held and let them go: a backlog of 10,000 held events was claimed
-- about 16,000 times a second, as long as the key stayed held.
--
-- The claim now moves such an event's due time, by at most a minute
-- (claim.holdSQL):
--
-- - behind a pending event that is not due (delayed, or backing off), to
--   that event's due time;
-- - behind a dead-lettered (failed) or processing event, a minute on: it
--   moves by an operator's hand (requeue, cancel) or the rescue, which the
--   trigger below answers at once.
--
-- The minute bounds what a move the trigger cannot answer costs: one in a
-- race with the hold's own commit (the trigger does not see a hold that
-- is not committed), or one its WHEN clause leaves out.
--
-- held_from keeps the event's own due time, the first time it is moved.
-- When the event it waits for changes status from failed or processing
-- (requeued, cancelled, rescued), is cancelled while pending and not due,
-- gets an earlier due time, or is deleted, outbox_event_unhold puts the
-- key's held events back to their own due time and wakes a dispatcher. The
-- handoff of a pending event (pending to done) fires nothing: the events
-- held behind it were moved to its own due time at the latest. Neither
-- does the cancel or delete of a held event: the event it waits for still
-- holds the key. A statement that changes many events of one key (a bulk
-- requeue) does the key's work once, for its earliest event.
--
-- outbox_event_held_clear (a BEFORE trigger) ends held_from when the
-- event's status or retries are written by anything but a hold.
--
-- The column is nullable without a default: adding it rewrites nothing.

BEGIN;
SET LOCAL lock_timeout = '10s';

ALTER TABLE outbox_event ADD COLUMN IF NOT EXISTS held_from timestamptz;

COMMENT ON COLUMN outbox_event.held_from IS
    'the event''s own due time, set when the dispatcher moved scheduled_at to wait for an earlier event of its ordering key (migration 021)';

CREATE OR REPLACE FUNCTION outbox_event_unhold() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
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

DROP TRIGGER IF EXISTS outbox_event_unhold ON outbox_event;
CREATE TRIGGER outbox_event_unhold
    AFTER UPDATE OF status, scheduled_at ON outbox_event
    FOR EACH ROW WHEN (
        OLD.ordering_key IS NOT NULL
        -- not an update that ends a hold: the trigger's own, or a write
        -- of a held event's status (outbox_event_held_clear), which an
        -- earlier event of its key still holds back
        AND NOT (OLD.held_from IS NOT NULL AND NEW.held_from IS NULL)
        AND ((OLD.status IN ('failed', 'processing') AND NEW.status IS DISTINCT FROM OLD.status)
             -- a pending event cancelled before it was due, unless it is
             -- held itself (then an earlier event holds the key)
             OR (OLD.status = 'pending' AND NEW.status = 'cancelled' AND OLD.scheduled_at > now() AND OLD.held_from IS NULL)
             OR NEW.scheduled_at < OLD.scheduled_at))
    EXECUTE FUNCTION outbox_event_unhold();

DROP TRIGGER IF EXISTS outbox_event_unhold_deleted ON outbox_event;
CREATE TRIGGER outbox_event_unhold_deleted
    AFTER DELETE ON outbox_event
    FOR EACH ROW WHEN (OLD.ordering_key IS NOT NULL AND OLD.status IN ('pending', 'processing', 'failed') AND OLD.held_from IS NULL)
    EXECUTE FUNCTION outbox_event_unhold();

-- outbox_event_held_clear ends held_from when anything but a hold or an
-- unhold writes a held event's status or retries: its handoff, a failed
-- attempt, a dead letter, an operator's requeue or cancel. So held_from is
-- set only on a pending event whose due time the dispatcher moved and that
-- nothing has written since: what the held count and explain show, and
-- what the unhold trigger's WHEN clauses read. The handoff of an event
-- that was never held (nearly all) stops at the WHEN clause.
CREATE OR REPLACE FUNCTION outbox_event_held_clear() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.held_from := NULL;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_event_held_clear ON outbox_event;
CREATE TRIGGER outbox_event_held_clear
    BEFORE UPDATE OF status, retries ON outbox_event
    FOR EACH ROW WHEN (
        OLD.held_from IS NOT NULL AND NEW.held_from IS NOT DISTINCT FROM OLD.held_from
        AND (NEW.status IS DISTINCT FROM OLD.status OR NEW.retries IS DISTINCT FROM OLD.retries))
    EXECUTE FUNCTION outbox_event_held_clear();

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_event_unhold() SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_event_held_clear() SET search_path = %I, pg_temp', current_schema());
    REVOKE ALL ON FUNCTION outbox_event_unhold() FROM PUBLIC;
    REVOKE ALL ON FUNCTION outbox_event_held_clear() FROM PUBLIC;
END
$$;

COMMIT;
