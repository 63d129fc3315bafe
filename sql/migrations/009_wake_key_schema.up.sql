-- 009: outbox_wake_lock_key() hashed current_schema(), the first schema of
-- the caller's search_path, while the wake trigger hashes the schema that
-- holds outbox_event (TG_TABLE_SCHEMA). With a `$user` schema present the
-- two differ. The dispatcher no longer calls the function (it derives the
-- key from the table's schema itself), but tools and tests that take the
-- wake lock by hand do: pin it to this migration's schema, which is the
-- table's.
DO $$
BEGIN
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION outbox_wake_lock_key() RETURNS int
        LANGUAGE sql IMMUTABLE AS $b$ SELECT hashtext(%L) $b$
    $f$, 'outbox_wake:' || current_schema());
END
$$;
