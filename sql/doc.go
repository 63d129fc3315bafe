// Package outboxsql holds the outbox's embedded, numbered SQL migrations and
// the code that applies them together with River's own.
//
// The folder is named sql after its contents; the package is named outboxsql
// so that it never shadows database/sql.
//
// Migrate is idempotent and safe to run from several processes at once: it
// holds a session advisory lock (derived from the target schema) for the whole
// run, applies River's migrations through rivermigrate, then applies each
// pending outbox migration in its own transaction and records it in
// outbox_schema_migration.
package outboxsql
