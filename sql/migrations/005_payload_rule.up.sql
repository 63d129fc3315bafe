-- 005: one rule for an acceptable payload, enforced the same way by
-- Publish (Go), outbox_publish and a plain INSERT from any producer:
--
--   * size: at most 1 MiB (1048576 bytes) as Postgres prints the jsonb;
--   * depth: objects and arrays nested at most 1000 levels deep
--     (outbox.MaxPayloadDepth). encoding/json refuses documents deeper than
--     10,000 levels and the River job args that carry a payload add one
--     level, so a bound well below that keeps every handed-off payload
--     decodable by any worker. A row deeper than that stalled the claim.

-- outbox_payload_problem says what is wrong with a payload, or NULL when it
-- is acceptable. The depth test asks for an object or array at level 1000
-- below the root ('strict': lax mode would unwrap arrays on its own); the
-- root is level 0 and depth 1, so such an item means depth 1001 or more.
-- jsonb_path_exists stops descending at level 1000, so hostile nesting costs
-- no more than that; on a 1 MiB payload of 30,000 small objects it takes
-- about 4 ms, against about 12 ms for the payload::text of the size test
-- (and about 1 µs on a small payload). Everything in the body is immutable
-- (no format(), which is only stable), so Postgres inlines the function into
-- the queries that call it instead of running it as a query of its own per
-- row.
CREATE FUNCTION outbox_payload_problem(payload jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE
    WHEN payload IS NULL THEN
        'is required (use ''{}'' for an empty body)'
    WHEN octet_length(payload::text) > 1048576 THEN
        'is ' || octet_length(payload::text)::text || ' bytes as Postgres prints it, the limit is 1048576'
    WHEN jsonb_path_exists(payload, 'strict $.**{1000} ? (@.type() == "object" || @.type() == "array")') THEN
        'is nested more than 1000 levels deep, the limit is 1000'
END
$$;

-- The table enforces the rule with a trigger rather than a CHECK constraint
-- on purpose. A CHECK is evaluated again on every UPDATE of a row, whatever
-- the UPDATE changes: a row stored before this migration (or before a
-- change of the rule) that breaks it could then never be marked 'failed' or
-- 'done' by the dispatcher, nor cancelled by an operator, and would stall
-- the claim again. The trigger runs only when a payload is written (INSERT,
-- or an UPDATE that sets payload). The 2 MiB CHECK of migration 001 stays
-- as the backstop it was.
CREATE FUNCTION outbox_event_payload_rule() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    problem text;
BEGIN
    problem := outbox_payload_problem(NEW.payload);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'outbox_event: payload %', problem
            USING ERRCODE = '22023', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'payload';
    END IF;
    RETURN NEW;
END
$$;

-- Trigger functions resolve names through the caller's search_path, which
-- need not contain this schema (INSERT INTO app.outbox_event ...): pin it.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_event_payload_rule() SET search_path = %I, pg_temp', current_schema());
END
$$;

CREATE TRIGGER outbox_event_payload_rule
    BEFORE INSERT OR UPDATE OF payload ON outbox_event
    FOR EACH ROW EXECUTE FUNCTION outbox_event_payload_rule();

-- The publish functions apply the same rule before their INSERT, so that
-- they name it (migration 006 defines them).
