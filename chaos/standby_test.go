package chaos

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// startStandby clones primary with pg_basebackup -R into a new temporary
// directory and starts it as a streaming hot standby on a free port. The
// test's cleanup stops it and removes its directory. It skips the test
// when pg_basebackup is not installed next to pg_ctl.
func startStandby(t *testing.T, primary *cluster) *cluster {
	t.Helper()
	basebackup := findBasebackup(primary.bin)
	if basebackup == "" {
		t.Skipf("chaos: no pg_basebackup next to %s/pg_ctl: cannot run the failover scenario", primary.bin)
	}
	dir, err := os.MkdirTemp("", "outbox-chaos-standby")
	if err != nil {
		t.Fatal(err)
	}
	s := &cluster{bin: primary.bin, dir: dir, run: primary.run}
	t.Cleanup(func() {
		_ = s.pgctl("-m", "immediate", "stop").Run()
		os.RemoveAll(dir)
	})
	if err := chownLike(dir, primary.dir); err != nil {
		t.Fatal(err)
	}
	// -c fast: do not wait for a spread checkpoint; -R: write
	// standby.signal and primary_conninfo; -X stream: WAL during the copy.
	out, err := s.command(basebackup, "-h", "127.0.0.1", "-p", fmt.Sprint(primary.port), "-U", "postgres",
		"-D", s.data(), "-R", "-X", "stream", "-c", "fast", "--no-sync").CombinedOutput()
	if err != nil {
		t.Fatalf("pg_basebackup: %v\n%s", err, out)
	}
	if s.port, err = freePort(); err != nil {
		t.Fatal(err)
	}
	if out, err := s.pgctl("start").CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "server.log"))
		t.Fatalf("pg_ctl start (standby): %v\n%s\n%s", err, out, tail(string(log), 3000))
	}
	s.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=5", s.port)
	return s
}

// findBasebackup finds pg_basebackup next to pg_ctl, following pg_ctl's
// symbolic link (PATH often holds only links to some server binaries).
func findBasebackup(bin string) string {
	dirs := []string{bin}
	if real, err := filepath.EvalSymlinks(filepath.Join(bin, "pg_ctl")); err == nil {
		dirs = append(dirs, filepath.Dir(real))
	}
	for _, d := range dirs {
		p := filepath.Join(d, "pg_basebackup")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// chownLike gives dir the owner of like (the postgres user when the suite
// runs as root).
func chownLike(dir, like string) error {
	fi, err := os.Stat(like)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	return os.Chown(dir, int(st.Uid), int(st.Gid))
}

// promote promotes a standby and waits until it accepts writes.
func (c *cluster) promote(t *testing.T) {
	t.Helper()
	if out, err := c.pgctl("promote").CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(c.dir, "server.log"))
		t.Fatalf("pg_ctl promote: %v\n%s\n%s", err, out, tail(string(log), 3000))
	}
}

// stopImmediate stops the server without a shutdown checkpoint, as a crash
// would (pg_ctl stop -m immediate: SIGQUIT to the postmaster, which kills
// every backend at once).
func (c *cluster) stopImmediate(t *testing.T) {
	t.Helper()
	if out, err := c.pgctl("-m", "immediate", "stop").CombinedOutput(); err != nil {
		t.Fatalf("pg_ctl stop -m immediate: %v\n%s", err, out)
	}
}

// fence makes a running server read-only for every session, open or new
// (default_transaction_read_only, by ALTER SYSTEM and a reload), as a
// switchover does to the old primary before the standby takes over.
func (c *cluster) fence(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, q := range []string{`ALTER SYSTEM SET default_transaction_read_only = on`, `SELECT pg_reload_conf()`} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("fence: %s: %v", q, err)
		}
	}
}

// cutReplication stops the primary c from sending WAL to its standbys while
// it keeps taking commits: pg_hba.conf rejects replication connections
// (first match wins), a reload applies it, and the WAL senders are
// terminated. Commits from then on are on the primary only, as with a
// standby that lags when the primary dies.
func (c *cluster) cutReplication(t *testing.T) {
	t.Helper()
	hba := filepath.Join(c.data(), "pg_hba.conf")
	old, err := os.ReadFile(hba)
	if err != nil {
		t.Fatal(err)
	}
	reject := "local replication all reject\nhost replication all 127.0.0.1/32 reject\nhost replication all ::1/128 reject\n"
	if err := os.WriteFile(hba, append([]byte(reject), old...), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, q := range []string{`SELECT pg_reload_conf()`, `SELECT pg_terminate_backend(pid) FROM pg_stat_replication`} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("cut replication: %s: %v", q, err)
		}
	}
}

// startReadOnly starts a stopped server with default_transaction_read_only
// on: an old primary that comes back fenced, still answering on its port
// (first in DATABASE_URL's host list) but refusing writes.
func (c *cluster) startReadOnly(t *testing.T) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(c.data(), "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.WriteString("\ndefault_transaction_read_only = on\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	if out, err := c.pgctl("start").CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(c.dir, "server.log"))
		t.Fatalf("pg_ctl start (read-only): %v\n%s\n%s", err, out, tail(string(log), 3000))
	}
}
