package chaos

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
	outboxsql "github.com/outboxhq/outbox/sql"
)

// cluster is a throwaway Postgres the suite starts, restarts and removes,
// for the scenarios that take the whole server down.
type cluster struct {
	bin  string // directory of initdb, pg_ctl
	dir  string
	port int
	run  []string // runuser prefix when root
	URL  string
}

// findPGBin returns the directory holding initdb and pg_ctl: PATH first,
// then the newest /usr/lib/postgresql/*/bin.
func findPGBin() string {
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		if _, err := exec.LookPath("initdb"); err == nil {
			return filepath.Dir(p)
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Strings(dirs)
	for i := len(dirs) - 1; i >= 0; i-- {
		if _, err := os.Stat(filepath.Join(dirs[i], "pg_ctl")); err == nil {
			return dirs[i]
		}
	}
	return ""
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startCluster initdb's and starts a cluster in a temporary directory (as
// the postgres user when running as root, since initdb and postgres refuse
// root), and stops and removes it when the test ends. It skips the test
// when the server binaries are not installed.
func startCluster(t *testing.T) *cluster {
	t.Helper()
	bin := findPGBin()
	if bin == "" {
		t.Skip("chaos: no Postgres server binaries (initdb, pg_ctl) in PATH or /usr/lib/postgresql/*/bin: cannot run the restart scenario (apt-get install postgresql)")
	}
	dir, err := os.MkdirTemp("", "outbox-chaos-pg")
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{bin: bin, dir: dir}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Skip("chaos: running as root and there is no postgres user to run the server as")
		}
		var uid, gid int
		fmt.Sscan(u.Uid, &uid)
		fmt.Sscan(u.Gid, &gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
		c.run = []string{"runuser", "-u", "postgres", "--"}
	}
	t.Cleanup(func() {
		_ = c.pgctl("-m", "immediate", "stop").Run()
		os.RemoveAll(dir)
	})
	if out, err := c.command(filepath.Join(bin, "initdb"), "-D", c.data(), "-U", "postgres", "-A", "trust", "--no-sync").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	if c.port, err = freePort(); err != nil {
		t.Fatal(err)
	}
	if out, err := c.pgctl("start").CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "server.log"))
		t.Fatalf("pg_ctl start: %v\n%s\n%s", err, out, log)
	}
	c.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=5", c.port)
	return c
}

func (c *cluster) data() string { return filepath.Join(c.dir, "data") }

func (c *cluster) command(name string, args ...string) *exec.Cmd {
	argv := append(append(append([]string{}, c.run...), name), args...)
	return exec.Command(argv[0], argv[1:]...)
}

// pgctl runs pg_ctl with the cluster's options. synchronous_commit stays
// on: an immediate shutdown must not lose commits that producers saw
// succeed (fsync=off is safe here because the OS does not crash).
func (c *cluster) pgctl(args ...string) *exec.Cmd {
	opts := fmt.Sprintf("-c listen_addresses=127.0.0.1 -p %d -k %s -c max_connections=200 -c fsync=off -c full_page_writes=off", c.port, c.dir)
	all := append([]string{"-D", c.data(), "-l", filepath.Join(c.dir, "server.log"), "-w", "-t", "120", "-o", opts}, args...)
	return c.command(filepath.Join(c.bin, "pg_ctl"), all...)
}

// restart stops the server with mode (fast or immediate), keeps it down for
// down, and starts it again.
func (c *cluster) restart(t *testing.T, mode string, down time.Duration) {
	t.Helper()
	if out, err := c.pgctl("-m", mode, "stop").CombinedOutput(); err != nil {
		t.Fatalf("pg_ctl stop -m %s: %v\n%s", mode, err, out)
	}
	time.Sleep(down) // the outage itself, not an assertion
	if out, err := c.pgctl("start").CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(c.dir, "server.log"))
		t.Fatalf("pg_ctl start after -m %s: %v\n%s\n%s", mode, err, out, tail(string(log), 3000))
	}
}

// schema creates a migrated schema on the cluster and returns its pool and
// URL (search_path and application_name set, as pgtest does).
func (c *cluster) schema(t *testing.T, name string) (*pgxpool.Pool, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	admin, err := pgxpool.New(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+name); err != nil {
		t.Fatal(err)
	}
	url := pgtest.WithSearchPath(c.URL, name)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := outboxsql.Migrate(ctx, pool, nil); err != nil {
		t.Fatal(err)
	}
	return pool, url
}
