-- 004: least-privilege roles. Three NOLOGIN group roles, shared by every
-- outbox schema of the cluster, and the grants on this schema's objects.
-- Give an application's login role membership (GRANT outbox_producer TO
-- app_user) instead of connecting as the migrations' owner.
--
--   outbox_producer    publishes: INSERT into outbox_event (Publish,
--                      PublishMany, plain INSERTs) and EXECUTE outbox_publish.
--                      It can read two columns only, id and dispatch_key:
--                      RETURNING id and the ON CONFLICT lookup of the event
--                      holding a duplicate key need them. It cannot read
--                      payloads, types, tenants or statuses, nor UPDATE or
--                      DELETE anything.
--   outbox_dispatcher  outboxd: claims (SELECT ... FOR UPDATE), marks done or
--                      failed (UPDATE), purges old done rows (DELETE,
--                      retention), inserts River jobs (River's insert is
--                      INSERT ... ON CONFLICT DO UPDATE ... RETURNING, so
--                      SELECT, INSERT and UPDATE on river_job).
--   outbox_operator    outboxctl: reads and changes events (requeue,
--                      cancel, retention), reads River jobs (explain,
--                      stats), writes the audit trail, and publishes.
--
-- Migrations themselves run as the schema's owner; River workers need
-- River's own grants (they update, lock and delete river_job rows and use
-- river_leader, river_queue and river_client), which are not given here.
--
-- outbox_publish stays SECURITY INVOKER. A SECURITY DEFINER variant would
-- let producers publish with EXECUTE alone, but it would run as the owner of
-- the migrations (often a superuser), and Go's PublishMany, which runs its
-- own INSERT, would still need the column grants below. The two columns a
-- producer can read are the price: choose dispatch keys that reveal nothing
-- (an opaque id, or a hash) if other producers must not learn them.

-- Roles are cluster-wide and tests migrate many schemas at once: two
-- migrations may race to create the same role, and the loser gets either
-- duplicate_object or a unique violation on pg_authid.
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_producer', 'outbox_dispatcher', 'outbox_operator'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL; -- created concurrently by another migration
            END;
        END IF;
    END LOOP;
END
$$;

DO $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO outbox_producer, outbox_dispatcher, outbox_operator', current_schema());
END
$$;

-- Producer.
GRANT INSERT (id, event_type, payload, tenant_id, dispatch_key) ON outbox_event TO outbox_producer;
GRANT SELECT (id, dispatch_key) ON outbox_event TO outbox_producer;
GRANT USAGE ON SEQUENCE outbox_event_id_seq TO outbox_producer;
GRANT EXECUTE ON FUNCTION outbox_publish(text, jsonb, text, text) TO outbox_producer;

-- Dispatcher (outboxd).
GRANT SELECT, UPDATE, DELETE ON outbox_event TO outbox_dispatcher;
GRANT SELECT, INSERT, UPDATE ON river_job TO outbox_dispatcher;
GRANT USAGE ON SEQUENCE river_job_id_seq TO outbox_dispatcher;
GRANT SELECT, INSERT, UPDATE ON outbox_job_run TO outbox_dispatcher;
GRANT EXECUTE ON FUNCTION outbox_wake_lock_key() TO outbox_dispatcher;

-- Operator (outboxctl).
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_event TO outbox_operator;
GRANT USAGE ON SEQUENCE outbox_event_id_seq TO outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_publish(text, jsonb, text, text) TO outbox_operator;
GRANT SELECT ON river_job TO outbox_operator;
GRANT SELECT, INSERT ON outbox_audit TO outbox_operator;
GRANT USAGE ON SEQUENCE outbox_audit_id_seq TO outbox_operator;
GRANT SELECT, INSERT, UPDATE ON outbox_job_run TO outbox_operator;
GRANT SELECT ON outbox_schema_migration TO outbox_producer, outbox_dispatcher, outbox_operator;
