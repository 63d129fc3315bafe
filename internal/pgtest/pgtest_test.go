package pgtest

import (
	"context"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestSweepDropsSchemasOfDeadProcesses: a schema left by a test process of
// this host that died before its cleanup is dropped by the next Sweep; one
// of a live process (this one) and an unmarked one are kept.
func TestSweepDropsSchemasOfDeadProcesses(t *testing.T) {
	t.Parallel()
	admin := Admin(t)
	ctx := Context(t, 60*time.Second)
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	deadOwner := strings.Replace(owner(), strings.SplitN(owner(), " pid=", 2)[1], itoa(dead.Process.Pid), 1)
	schemas := map[string]string{
		"t_sweep_dead_" + itoa(dead.Process.Pid):  deadOwner,
		"t_sweep_live_" + itoa(dead.Process.Pid):  owner(),
		"t_sweep_other_" + itoa(dead.Process.Pid): "somebody else",
	}
	for name, comment := range schemas {
		if _, err := admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+name+" CASCADE; CREATE SCHEMA "+name+"; COMMENT ON SCHEMA "+name+" IS '"+comment+"'"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+name+" CASCADE") })
	}
	Sweep(ctx, admin)
	for name := range schemas {
		exists := Count(t, admin, `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, name) == 1
		if want := !strings.HasPrefix(name, "t_sweep_dead_"); exists != want {
			t.Errorf("schema %s exists=%v after Sweep, want %v", name, exists, want)
		}
	}
}

// TestNewSchemaCleanupDropsTheSchema: the cleanups NewSchema registers drop
// its schema, and the schema carries this process's mark.
func TestNewSchemaCleanupDropsTheSchema(t *testing.T) {
	t.Parallel()
	tb := &cleanupTB{TB: t}
	s := NewSchema(tb, &Options{NoMigrate: true})
	var comment string
	if err := Admin(t).QueryRow(context.Background(), `SELECT obj_description($1::regnamespace, 'pg_namespace')`, s.Name).Scan(&comment); err != nil || comment != owner() {
		t.Fatalf("schema comment %q (%v), want %q", comment, err, owner())
	}
	tb.runCleanups()
	if n := Count(t, Admin(t), `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, s.Name); n != 0 {
		t.Fatalf("schema %s still exists after cleanup", s.Name)
	}
}

// TestRedactUsesTheSharedRedaction: pgtest hides malformed passwords too.
func TestRedactUsesTheSharedRedaction(t *testing.T) {
	t.Parallel()
	if got := Redact("postgres://u:p@ss@host/db"); strings.Contains(got, "p@ss") || strings.Contains(got, "ss@") {
		t.Fatalf("Redact = %q", got)
	}
}

// cleanupTB collects cleanups to run them before the test ends.
type cleanupTB struct {
	testing.TB
	cleanups []func()
}

func (c *cleanupTB) Cleanup(f func()) { c.cleanups = append(c.cleanups, f) }

func (c *cleanupTB) runCleanups() {
	for i := len(c.cleanups) - 1; i >= 0; i-- {
		c.cleanups[i]()
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
