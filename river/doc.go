// Package outboxriver is the River side of the outbox.
//
// The handoff: every handed-off event becomes one River job per routed
// queue (JobParams), with args EventArgs (kind "outbox_event") unless the
// route shapes them, inserted as River's InsertManyTx would in the
// statement that marks the event done (package claim). That statement also
// announces the queues it inserted into in River's format, so the workers
// fetch as soon as it commits; River's own insert notification is
// rate-limited. NewInsertClient, AnnounceSQL and a Silent client do the
// same for an application that inserts jobs with River's client.
//
// The receivers: a Worker for that kind hands each job's Event to the
// handler registered (Handlers) for the longest prefix of its type; a job
// without handler fails loudly. Decode and Typed turn the payload into a
// struct. River runs a job at least once, so effects are made idempotent
// per (receiver, event id):
//
//   - WithIdempotency, for effects in the same database: the effect's
//     writes, a receipt row and river.JobCompleteTx commit in one
//     transaction, so a redelivery is a no-op (exactly-once effects).
//   - WithClaim, for external effects (mail, HTTP): an atomic claim with a
//     TTL, released when the effect fails, and the effect's result
//     returned to duplicate deliveries.
//
// PurgeReceipts deletes receipts after their TTL.
//
// River's GIN pending lists: GINCleaner merges them in small pieces beside
// the dispatcher (outboxd runs one), so that no River insert or fetch on
// the outbox's path stalls merging a full list (docs/operations.md).
//
// Tracing: a job carries its producer's W3C trace context in its metadata
// (MetadataTraceParent, MetadataTraceState). Worker runs each handler in an
// "outbox.handle" span whose parent is the producer's span, and
// TraceMiddleware (installed by QueuesConfig) does the same for any worker
// and for River's OpenTelemetry middleware placed after it.
//
// The workers' River client: QueuesConfig builds a River client config for
// a set of queues (per-queue MaxWorkers, FetchCooldown, FetchPollInterval)
// with the outbox's low-latency defaults, and GroupClientID names the
// client after its group, host and process. (outboxd reads the same queues
// from OUTBOX_WORKER_QUEUES and OUTBOX_WORKER_GROUPS; that syntax belongs to
// its configuration, not to this package.)
//
// See docs/receivers.md for a worked example and the guarantees.
//
// The folder is named river; the package is named outboxriver so that it
// never shadows github.com/riverqueue/river.
package outboxriver
