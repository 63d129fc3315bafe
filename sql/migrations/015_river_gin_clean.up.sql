-- 015: outbox_river_gin_clean() moves the pending entries of River's GIN
-- indexes into the indexes, off the handoff's and the workers' path
-- (docs/operations.md, "River's GIN pending lists").
--
-- River's river_job has two GIN indexes (river_job_args_index and
-- river_job_metadata_index). A GIN index with fastupdate on (Postgres'
-- default, and River's) appends every new entry to a pending list, and the
-- statement that makes the list exceed gin_pending_list_limit (4 MB by
-- default) merges the whole list into the index before it returns. Every
-- version of a job's row adds entries (its insert, River's fetch, its
-- completion), and the outbox's metadata names the event in each job, so
-- at 1,000 jobs/s the list fills every few seconds and one statement that
-- writes river_job stalls for 50-100 ms: the dispatcher's River insert, or
-- a worker's fetch, whose jobs then wait for River's 100 ms poll
-- (measured: pg_stat_statements max 78 ms for River's JobInsertFastMany
-- and JobGetAvailable, mean 0.13-0.18 ms). outboxd calls this function
-- every OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS, so the merge runs in small
-- pieces in a session of its own (gin_clean_pending_list, as VACUUM does
-- at the end of each run) and the list never reaches the limit.
--
-- SECURITY DEFINER: gin_clean_pending_list needs the index's owner, and
-- the dispatcher's role (outbox_dispatcher) owns nothing. The function runs
-- as the role that applied this migration, which must own River's tables
-- (as it does when one role migrates both); otherwise a call fails with
-- 42501 and outboxd stops calling it (and says so). It takes no argument:
-- it cleans only the GIN indexes of river_job in this schema, and returns
-- how many pending-list pages it merged (0 without River's table). Its
-- transaction commits without waiting for the WAL flush.

BEGIN;
SET LOCAL lock_timeout = '10s';

CREATE FUNCTION outbox_river_gin_clean() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    v_index regclass;
    v_pages bigint := 0;
BEGIN
    -- Nothing here needs its commit flushed: a merge lost in a crash is
    -- done again by the next call (or by VACUUM), and the WAL keeps each
    -- index page consistent either way. Not waiting for the flush keeps
    -- the cleaner's commits out of the way of those that must wait.
    PERFORM set_config('synchronous_commit', 'off', true);
    FOR v_index IN
        SELECT i.indexrelid::regclass
        FROM pg_index i
        JOIN pg_class c ON c.oid = i.indexrelid
        JOIN pg_am am ON am.oid = c.relam
        WHERE i.indrelid = to_regclass('river_job') AND am.amname = 'gin' AND i.indisvalid
        ORDER BY c.relname
    LOOP
        v_pages := v_pages + gin_clean_pending_list(v_index);
    END LOOP;
    RETURN v_pages;
END
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_river_gin_clean() SET search_path = %I, pg_temp', current_schema());
END
$$;
REVOKE ALL ON FUNCTION outbox_river_gin_clean() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_river_gin_clean() TO outbox_dispatcher, outbox_operator;

COMMIT;
