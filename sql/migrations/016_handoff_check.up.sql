-- 016: outbox_handoff_check(), the check that lets the dispatcher's
-- one-statement handoff commit in its own round trip.
--
-- The dispatcher hands a batch of common events off in one statement that
-- claims them, inserts their River jobs and marks them done (package claim,
-- fastSQL). Sent without BEGIN, the statement is its own transaction and
-- commits with it: one round trip per batch instead of the claim, the
-- handoff and the COMMIT. Before it commits, the dispatcher must know that
-- every claimed event it handed off got every job of its route and its
-- job ids; in its batch transaction it compares the statement's counts
-- before COMMIT. Sent on its own, the statement checks them itself: it
-- calls this function with what it wrote and what it meant to write, and
-- the function raises (SQLSTATE XX000, internal_error), which rolls the
-- statement back whole, when they differ. A trigger on river_job or
-- outbox_event that skips rows (a BEFORE trigger returning NULL) is what
-- could make them differ; the dispatcher then hands the batch off in its
-- batch transaction, where the Go handoff isolates the event at fault.
--
-- It returns jobs, so that the statement can select it. VOLATILE (the
-- default): it must run once, where the statement reads it.

BEGIN;
SET LOCAL lock_timeout = '10s';

CREATE FUNCTION outbox_handoff_check(jobs bigint, want_jobs bigint, done bigint, want_done bigint, recorded bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF jobs IS DISTINCT FROM want_jobs OR done IS DISTINCT FROM want_done OR recorded IS DISTINCT FROM want_jobs THEN
        RAISE EXCEPTION 'outbox handoff: % River jobs inserted for %, % events marked done for %, % job ids recorded for %; nothing is committed',
            jobs, want_jobs, done, want_done, recorded, want_jobs
            USING ERRCODE = 'internal_error',
                  HINT = 'A trigger on river_job or outbox_event that skips rows can cause this; the dispatcher retries the batch in its batch transaction.';
    END IF;
    RETURN jobs;
END
$$;

REVOKE ALL ON FUNCTION outbox_handoff_check(bigint, bigint, bigint, bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_handoff_check(bigint, bigint, bigint, bigint, bigint) TO outbox_dispatcher, outbox_operator;

COMMIT;
