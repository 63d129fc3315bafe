// Package chaos proves the outbox's promise under faults: nothing lost,
// nothing handed off twice, nothing stuck. It has no API; its tests start
// real outboxd processes against a real Postgres, publish a known set of
// events while injecting faults (kill -9 of dispatchers, terminated
// backends, a Postgres restart, lock and statement timeouts on the claim,
// producers that roll back or commit late), and then check the ledger.
//
// `go test ./chaos` runs the short form (a few thousand events);
// `make chaos` runs the long form (CHAOS_EVENTS, at least 50,000 events in
// all) and prints a per-scenario report. `make soak` runs the soak test for
// SOAK_DURATION. See docs/reliability.md.
package chaos
