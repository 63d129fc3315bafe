package outboxsql_test

import (
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestWakeLockKeyIsTheTableSchemas: outbox_wake_lock_key() is the key the
// wake trigger uses (the schema holding outbox_event), whatever schema the
// caller's search_path puts first.
func TestWakeLockKeyIsTheTableSchemas(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	conn, err := s.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// A schema of its own first in the search_path: current_schema() is
	// no longer the table's.
	other := s.Name + "_other"
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+other); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pgtest.Admin(t).Exec(ctx, `DROP SCHEMA IF EXISTS `+other+` CASCADE`) })
	if _, err := conn.Exec(ctx, `SET search_path = `+other+`, `+s.Name); err != nil {
		t.Fatal(err)
	}
	var key, want int32
	var current string
	err = conn.QueryRow(ctx, `SELECT outbox_wake_lock_key(), hashtext('outbox_wake:' || $1), current_schema()`, s.Name).Scan(&key, &want, &current)
	if err != nil {
		t.Fatal(err)
	}
	if current != other {
		t.Fatalf("current_schema() = %s, want %s", current, other)
	}
	if key != want {
		t.Errorf("outbox_wake_lock_key() = %d, want the table schema's key %d", key, want)
	}
}
