package main_test

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/internal/proctest"
)

// plainBinary is outboxd built without -race: the race detector's shadow
// memory would dominate a memory measurement.
var plainBinary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "outboxd-plain")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "outboxd")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		return "", &buildError{err: err, out: string(out)}
	}
	return bin, nil
})

type buildError struct {
	err error
	out string
}

func (e *buildError) Error() string { return e.err.Error() + "\n" + e.out }

// peakRSS reads VmHWM (the resident set's high-water mark) of pid, in KiB.
func peakRSS(t *testing.T, pid int) int {
	t.Helper()
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(rest), " kB"))
			if err != nil {
				t.Fatal(err)
			}
			return kb
		}
	}
	t.Fatal("no VmHWM in /proc/<pid>/status")
	return 0
}

// TestLargePayloadBacklogStaysUnder256MiB drains a backlog of 300 payloads
// of about 1 MiB each with the default batch size, concurrency and byte
// budget, and checks outboxd's peak RSS. Bounded by count alone, one batch
// held 100 MiB of payloads, and several were in flight.
func TestLargePayloadBacklogStaysUnder256MiB(t *testing.T) {
	if testing.Short() {
		t.Skip("inserts 300 MiB of payloads")
	}
	t.Parallel()
	bin, err := plainBinary()
	if err != nil {
		t.Fatalf("build outboxd: %v", err)
	}
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 5*time.Minute)
	// Incompressible payloads (md5 hex), so that TOAST compression does not
	// shrink them: about 960,000 bytes of JSON text each.
	const n = 300
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO outbox_event (event_type, payload)
		SELECT 'mail.big.sent', jsonb_build_object('d', (SELECT string_agg(md5(i::text || ':' || g::text), '') FROM generate_series(1, 30000) g))
		FROM generate_series(1, $1) i`, n); err != nil {
		t.Fatal(err)
	}

	routes, _ := filepath.Abs("../../docs/examples/routes.yaml")
	cmd := exec.Command(bin)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "OUTBOX_DISPATCHER_ENABLED=true", "OUTBOX_ROUTES_FILE=" + routes,
		"DATABASE_URL=" + s.URL, "OUTBOX_LOG_FORMAT=json"}
	out := &proctest.SyncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

	pgtest.WaitFor(t, 4*time.Minute, "the backlog drained", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'done'`) == n
	})
	peak := peakRSS(t, cmd.Process.Pid)
	t.Logf("outboxd peak RSS draining %d payloads of ~1 MiB: %d MiB", n, peak/1024)
	if peak > 256*1024 {
		t.Fatalf("outboxd peak RSS %d MiB, want under 256 MiB", peak/1024)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 30*time.Second); code != 0 {
		t.Fatalf("exit %d:\n%s", code, out.String())
	}
}
