// Package outboxriver is the River side of the outbox: the job args every
// handed-off event becomes (EventArgs, kind "outbox_event"), the insert-only
// River client the dispatcher uses, and the latency settings shared by that
// client and the workers.
//
// The folder is named river; the package is named outboxriver so that it
// never shadows github.com/riverqueue/river.
package outboxriver
