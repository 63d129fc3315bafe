// Package console is the outbox's web console: an http.Handler that a
// service mounts (outboxd serves it at /console/, next to River UI at
// /riverui/).
//
// Pages:
//
//   - Overview: publish and handoff rates, backlog, oldest pending age,
//     failed and cancelled counts, a chart of the last minutes (sampled on the
//     server, served as JSON at api/series), and every routed River queue with
//     its depth; the count of parked ordering keys.
//   - Events: the list, newest first, with filters (status, type prefix,
//     tenant, time range) and keyset pagination (admin.ListEvents).
//   - One event: what admin.Explain says (routes, River jobs with states and
//     errors, receipts, the order of its ordering key) and the audit entries
//     that name it, with links to the jobs in River UI.
//   - Requeue and cancel, of a selection or of a filter: always a dry run
//     first (admin.Client.Requeue and Cancel with DryRun), then a
//     confirmation that changes at most the events the preview listed, with
//     the operator's name in the audit table. outboxctl calls the same
//     functions, so the page and the CLI cannot disagree.
//   - Keys: the ordering keys that wait for an operator (admin.Keys), with
//     links to the head event and River UI's job page, and, for a parked
//     key, unpark (retry or skip its head) through the same preview and
//     confirmation (admin.Client.Unpark).
//   - Audit: the recorded operator actions.
//
// Safety: read-only pages need no setup and show no connection details
// (a database error is logged; the page says only that one occurred).
// Mutations need Config.Token: an operator signs in with it and a name, and
// gets a session cookie (HttpOnly, SameSite=Strict, signed with a key drawn
// at start); every mutation also needs the session's CSRF token and a
// same-origin Origin (or Referer) header. Payloads are shown only with
// Config.ShowPayloads. GuardRiverUI applies the same rules to a mounted River
// UI, which shows job args (for the outbox's jobs, the payload).
//
// Call Start before serving (it starts the sampler) and Stop after.
package console
