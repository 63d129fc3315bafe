package config_test

import (
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/config"
)

// Tests here set environment variables, so they do not run in parallel.

func TestDefaults(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://u@h/db")
	c, err := config.Load()
	if err != nil {
		t.Fatal(err)
	}
	if c.DispatcherEnabled || c.DispatchIntervalMS != 1000 || c.DispatchBatchSize != 100 || c.DispatchConcurrency != 10 ||
		c.MaxRetries != 6 || c.DoneRetentionHours != 720 || c.DoneRetentionBatchSize != 1000 || !c.ListenEnabled ||
		c.RiverGINCleanIntervalMS != 200 {
		t.Fatalf("defaults = %+v", c)
	}
	d := c.Dispatcher()
	if d.PollInterval != time.Second || d.BatchSize != 100 || d.BatchBytes != 4<<20 || d.Concurrency != 10 || d.MaxRetries != 6 || d.ListenDisabled {
		t.Fatalf("dispatcher config = %+v", d)
	}
}

func TestInvalidValuesNameTheVariable(t *testing.T) {
	cases := []struct{ key, value, want string }{
		{"OUTBOX_DISPATCH_INTERVAL_MS", "abc", `OUTBOX_DISPATCH_INTERVAL_MS="abc" is not a valid int`},
		{"OUTBOX_DISPATCH_INTERVAL_MS", "0", "OUTBOX_DISPATCH_INTERVAL_MS=0 is out of range"},
		{"OUTBOX_DISPATCH_INTERVAL_MS", "-5", "OUTBOX_DISPATCH_INTERVAL_MS=-5 is out of range"},
		{"OUTBOX_DISPATCH_BATCH_SIZE", "0", "OUTBOX_DISPATCH_BATCH_SIZE=0 is out of range"},
		{"OUTBOX_DISPATCH_BATCH_SIZE", "100000", "OUTBOX_DISPATCH_BATCH_SIZE=100000 is out of range"},
		{"OUTBOX_DISPATCH_BATCH_SIZE", "1.5", `OUTBOX_DISPATCH_BATCH_SIZE="1.5" is not a valid int`},
		{"OUTBOX_DISPATCH_BATCH_BYTES", "100", "OUTBOX_DISPATCH_BATCH_BYTES=100 is out of range: it must be between 1024 and 1073741824"},
		{"OUTBOX_DISPATCH_BATCH_BYTES", "4MiB", `OUTBOX_DISPATCH_BATCH_BYTES="4MiB" is not a valid int`},
		{"OUTBOX_DISPATCH_CONCURRENCY", "0", "OUTBOX_DISPATCH_CONCURRENCY=0"},
		{"OUTBOX_DISPATCH_CONCURRENCY", "-1", "OUTBOX_DISPATCH_CONCURRENCY=-1"},
		{"OUTBOX_MAX_RETRIES", "-1", "OUTBOX_MAX_RETRIES=-1"},
		{"OUTBOX_MAX_RETRIES", "six", `OUTBOX_MAX_RETRIES="six"`},
		{"OUTBOX_DONE_RETENTION_HOURS", "0", "OUTBOX_DONE_RETENTION_HOURS=0"},
		{"OUTBOX_DONE_RETENTION_BATCH_SIZE", "x", `OUTBOX_DONE_RETENTION_BATCH_SIZE="x"`},
		{"OUTBOX_DISPATCHER_ENABLED", "yes please", `OUTBOX_DISPATCHER_ENABLED="yes please" is not a valid bool`},
		{"OUTBOX_LISTEN_ENABLED", "maybe", `OUTBOX_LISTEN_ENABLED="maybe"`},
		{"OUTBOX_RIVER_FETCH_COOLDOWN_MS", "0", "OUTBOX_RIVER_FETCH_COOLDOWN_MS=0"},
		{"OUTBOX_RIVER_FETCH_POLL_INTERVAL_MS", "0", "OUTBOX_RIVER_FETCH_POLL_INTERVAL_MS=0"},
		{"OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS", "-1", "OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS=-1 is out of range"},
		{"OUTBOX_LISTEN_PING_INTERVAL_MS", "10", "OUTBOX_LISTEN_PING_INTERVAL_MS=10"},
		{"OUTBOX_WORKER_JOB_TIMEOUT_S", "0", "OUTBOX_WORKER_JOB_TIMEOUT_S=0 is out of range"},
		{"OUTBOX_WORKER_RESCUE_AFTER_S", "30", "OUTBOX_WORKER_RESCUE_AFTER_S=30 must not be shorter than OUTBOX_WORKER_JOB_TIMEOUT_S=60"},
		{"OUTBOX_LOG_FORMAT", "xml", `OUTBOX_LOG_FORMAT="xml"`},
		{"OUTBOX_LOG_LEVEL", "loud", `OUTBOX_LOG_LEVEL="loud"`},
	}
	for _, c := range cases {
		t.Run(c.key+"="+c.value, func(t *testing.T) {
			t.Setenv(c.key, c.value)
			_, err := config.Load()
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want %q", err, c.want)
			}
		})
	}
}

func TestDispatcherNeedsRoutesAndDatabase(t *testing.T) {
	t.Setenv("OUTBOX_DISPATCHER_ENABLED", "true")
	t.Setenv("DATABASE_URL", "")
	t.Setenv("OUTBOX_ROUTES_FILE", "")
	_, err := config.Load()
	if err == nil || !strings.Contains(err.Error(), "OUTBOX_ROUTES_FILE is required") || !strings.Contains(err.Error(), "DATABASE_URL is required") {
		t.Fatalf("err = %v", err)
	}
}

func TestRetentionBatchSizeIsClamped(t *testing.T) {
	for in, want := range map[string]int{"0": 1, "-7": 1, "50000": 10000, "500": 500} {
		t.Setenv("OUTBOX_DONE_RETENTION_BATCH_SIZE", in)
		c, err := config.Load()
		if err != nil {
			t.Fatal(err)
		}
		if c.DoneRetentionBatchSize != want {
			t.Errorf("%s → %d, want %d", in, c.DoneRetentionBatchSize, want)
		}
	}
}

func TestMaxRetriesZeroMeansDeadLetterAtOnce(t *testing.T) {
	t.Setenv("OUTBOX_MAX_RETRIES", "0")
	c, err := config.Load()
	if err != nil {
		t.Fatal(err)
	}
	if c.Dispatcher().MaxRetries >= 0 {
		t.Fatalf("MaxRetries = %d, want negative (none)", c.Dispatcher().MaxRetries)
	}
}

func TestPollOnly(t *testing.T) {
	t.Setenv("OUTBOX_LISTEN_ENABLED", "false")
	c, err := config.Load()
	if err != nil {
		t.Fatal(err)
	}
	if !c.Dispatcher().ListenDisabled {
		t.Fatal("OUTBOX_LISTEN_ENABLED=false did not select poll-only mode")
	}
}

// TestHTTPListenerOnByDefaultOnLoopback: unset, OUTBOX_HTTP_ADDR is
// 127.0.0.1:9090 (and marked as the default); off or empty turns it off; a
// short console token is refused with its name.
func TestHTTPListenerOnByDefaultOnLoopback(t *testing.T) {
	c, err := config.Load()
	if err != nil {
		t.Fatal(err)
	}
	if c.HTTPAddr != "127.0.0.1:9090" || !c.HTTPAddrDefaulted || !c.ConsoleEnabled || !c.RiverUIEnabled || c.ConsolePayloads || c.ConsoleToken != "" {
		t.Fatalf("defaults: %+v", c)
	}
	for _, off := range []string{"off", ""} {
		t.Setenv("OUTBOX_HTTP_ADDR", off)
		if c, err = config.Load(); err != nil || c.HTTPAddr != "" || c.HTTPAddrDefaulted {
			t.Fatalf("OUTBOX_HTTP_ADDR=%q: %v %+v", off, err, c)
		}
	}
	t.Setenv("OUTBOX_CONSOLE_TOKEN", "short")
	if _, err = config.Load(); err == nil || !strings.Contains(err.Error(), "OUTBOX_CONSOLE_TOKEN is 5 bytes") {
		t.Fatalf("short token: %v", err)
	}
}
