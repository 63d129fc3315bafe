-- 002: operations. The audit trail of operator actions (outboxctl requeue,
-- cancel, retention run) and the run record of periodic jobs (retention), so
-- that "daily" survives restarts and is shared by every outboxd instance.

-- One row per operator action that changed (or would have changed) events.
-- Dry runs are rolled back together with their audit row: only what
-- happened is recorded.
CREATE TABLE outbox_audit (
    id         bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME outbox_audit_id_seq) PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT now(),
    -- who: the OS user running outboxctl, or its --actor.
    actor      text        NOT NULL,
    -- the database role that ran the action (current_user).
    db_user    text        NOT NULL DEFAULT current_user,
    -- requeue, cancel, retention, ...
    action     text        NOT NULL,
    -- the selection as the operator gave it (flags, normalised).
    filter     jsonb       NOT NULL DEFAULT '{}',
    -- how many events the action changed.
    affected   bigint      NOT NULL,
    -- anything else worth keeping: skipped counts, the first ids, a reason.
    detail     jsonb       NOT NULL DEFAULT '{}',

    CONSTRAINT outbox_audit_actor_length CHECK (octet_length(actor) BETWEEN 1 AND 256),
    CONSTRAINT outbox_audit_action_format CHECK (action ~ '^[a-z][a-z0-9_-]{0,63}$'),
    CONSTRAINT outbox_audit_affected_nonnegative CHECK (affected >= 0)
);

CREATE INDEX outbox_audit_at_idx ON outbox_audit (at DESC, id DESC);

-- The last run of each periodic job (one row per job name). The retention
-- runner reads and writes it while it holds the job's advisory lock.
CREATE TABLE outbox_job_run (
    name             text        PRIMARY KEY,
    last_started_at  timestamptz,
    last_finished_at timestamptz,
    -- rows the last finished run affected (deleted, for retention).
    last_affected    bigint      NOT NULL DEFAULT 0,
    last_error       text,
    -- who ran it: "outboxd pid@host" or "outboxctl <actor>".
    last_run_by      text,

    CONSTRAINT outbox_job_run_error_length CHECK (octet_length(last_error) <= 8192)
);
