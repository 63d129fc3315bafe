// Package chaos proves the outbox's promise under faults: nothing lost,
// nothing handed off twice, nothing stuck. It has no API; its tests start
// real outboxd processes against a real Postgres, publish a known set of
// events while injecting faults (kill -9 of dispatchers, terminated
// backends, a Postgres restart, lock and statement timeouts on the claim,
// producers that roll back or commit late), and then check the ledger.
//
// The ordering scenarios (ordering_test.go) publish events with ordering
// keys and run real River worker processes (ledgerworker, a plain worker
// built with outboxriver.QueuesConfig) that record every run of a job in
// an append-only file. Under kill -9 of dispatchers, kill -9 of workers in
// the middle of jobs and Postgres restarts, the ordering ledger proves,
// for every key and queue: the successful runs start in the defined order,
// no run starts before its predecessor's successful run ended, no two runs
// overlap (a killed run ends when its process died), and every event is
// worked exactly once successfully (a killed attempt may be retried, as
// the same job).
//
// `go test ./chaos` runs the short form (a few thousand events);
// `make chaos` runs the long form (CHAOS_EVENTS, at least 50,000 events in
// all) and prints a per-scenario report. `make soak` runs the soak test for
// SOAK_DURATION. See docs/reliability.md.
package chaos
