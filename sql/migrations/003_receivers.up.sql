-- 003: receivers. The receipts and claims of receiver-side idempotency
-- (package outboxriver: WithIdempotency and WithClaim), one row per
-- (receiver, event id).

CREATE TABLE outbox_receipt (
    -- the receiver's stable name (outboxriver.Receiver.Name).
    receiver     text        NOT NULL,
    -- the outbox event id. No foreign key: retention may purge the event
    -- before its receipts expire, and receipts must outlive redeliveries.
    event_id     bigint      NOT NULL,
    -- 'done': the effect is applied (a WithIdempotency receipt, or a
    -- WithClaim that finished, with its result).
    -- 'claimed': a WithClaim handler is applying the effect now.
    state        text        NOT NULL,
    -- the River job (and its attempt) that wrote the row.
    job_id       bigint,
    attempt      int,
    -- WithClaim: the handler's result, returned to duplicate deliveries.
    result       jsonb,
    -- WithClaim: the claim holder's random token, so that only the holder
    -- completes or releases its claim.
    token        text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    -- after this time the row no longer suppresses a delivery, and
    -- outboxriver.PurgeReceipts deletes it.
    expires_at   timestamptz NOT NULL,

    PRIMARY KEY (receiver, event_id),
    CONSTRAINT outbox_receipt_state_check CHECK (state IN ('claimed', 'done')),
    CONSTRAINT outbox_receipt_receiver_length CHECK (octet_length(receiver) BETWEEN 1 AND 128)
);

-- The purge deletes expired rows in expires_at order.
CREATE INDEX outbox_receipt_expires_idx ON outbox_receipt (expires_at);

-- `outboxctl explain <event-id>` lists an event's receipts.
CREATE INDEX outbox_receipt_event_idx ON outbox_receipt (event_id);
