-- 025: the dispatcher writes the rows of a key's line itself. Since this
-- migration the handoff's statement (package claim, handoffLineSQL) sends
-- only the first job of each (tenant, ordering key, queue) of a batch
-- through River's insert and the enqueue trigger (024), which makes it the
-- key's head or queues it, and locks the key's row either way until the
-- batch commits; it inserts the key's later jobs of the batch into
-- outbox_ordering_wait itself, in one set-based insert, with the columns
-- the trigger writes. That needs INSERT on outbox_ordering_wait, which
-- outbox_dispatcher did not hold (011 granted it SELECT). Nothing else
-- changes: the trigger, the release and the guarantee are 024's.
--
-- An outboxd that finds no migration 025, a role without INSERT on the
-- table, or an enqueue trigger that does not fire for its session, hands
-- every job off through the trigger, as before (Handoff.canLine looks
-- again once a minute).
--
-- Measured on the bench's 10,000-event hot key (twelve interleaved pairs of
-- the ordering scenario on fresh production-like clusters, 2026-12-04):
-- the walk hands the backlog off in 0.68-0.92 s against 0.95-1.49 s
-- (docs/ordering-measurements.md, "The walk writes the line itself").

BEGIN;

GRANT INSERT ON outbox_ordering_wait TO outbox_dispatcher;

COMMIT;
