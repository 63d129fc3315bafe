// Package config reads outboxd's and outboxctl's settings from the
// environment with envconfig. Every variable has a documented default, and a
// bad value is an error that names the variable.
//
// It also owns the syntax of the worker variables (ParseQueues,
// ParseGroups for OUTBOX_WORKER_QUEUES and OUTBOX_WORKER_GROUPS) and the
// checks of groups against routes (UnworkedQueues, UnroutedQueues) and
// against the queues River clients report working (ActiveQueues), which
// outboxd runs at start-up and `outboxctl stats` reports.
package config

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/kelseyhightower/envconfig"

	"github.com/outboxhq/outbox/dispatcher"
)

// Config is the environment of outboxd. See docs/configuration.md.
type Config struct {
	DatabaseURL string `envconfig:"DATABASE_URL"`

	DispatcherEnabled   bool `envconfig:"OUTBOX_DISPATCHER_ENABLED" default:"false"`
	DispatchIntervalMS  int  `envconfig:"OUTBOX_DISPATCH_INTERVAL_MS" default:"1000"`
	DispatchBatchSize   int  `envconfig:"OUTBOX_DISPATCH_BATCH_SIZE" default:"100"`
	DispatchBatchBytes  int  `envconfig:"OUTBOX_DISPATCH_BATCH_BYTES" default:"4194304"`
	DispatchConcurrency int  `envconfig:"OUTBOX_DISPATCH_CONCURRENCY" default:"10"`
	DispatchTimeoutMS   int  `envconfig:"OUTBOX_DISPATCH_TIMEOUT_MS" default:"30000"`
	MaxRetries          int  `envconfig:"OUTBOX_MAX_RETRIES" default:"6"`
	DispatchSyncCommit  bool `envconfig:"OUTBOX_DISPATCH_SYNCHRONOUS_COMMIT" default:"false"`
	DispatchLingerMS    int  `envconfig:"OUTBOX_DISPATCH_LINGER_MS" default:"1"`

	DoneRetentionHours     int `envconfig:"OUTBOX_DONE_RETENTION_HOURS" default:"720"`
	DoneRetentionBatchSize int `envconfig:"OUTBOX_DONE_RETENTION_BATCH_SIZE" default:"1000"`

	RoutesFile string `envconfig:"OUTBOX_ROUTES_FILE"`

	ListenEnabled          bool `envconfig:"OUTBOX_LISTEN_ENABLED" default:"true"`
	ListenReconnectDelayMS int  `envconfig:"OUTBOX_LISTEN_RECONNECT_DELAY_MS" default:"1000"`
	ListenPingIntervalMS   int  `envconfig:"OUTBOX_LISTEN_PING_INTERVAL_MS" default:"2000"`

	RiverFetchCooldownMS     int `envconfig:"OUTBOX_RIVER_FETCH_COOLDOWN_MS" default:"1"`
	RiverFetchPollIntervalMS int `envconfig:"OUTBOX_RIVER_FETCH_POLL_INTERVAL_MS" default:"100"`
	// How often River's GIN pending lists are merged (outboxriver.GINCleaner);
	// 0 turns the cleaner off.
	RiverGINCleanIntervalMS int `envconfig:"OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS" default:"200"`
	// The workers' job timeout and River's rescue of jobs left running by
	// a dead worker process (River's JobTimeout and RescueStuckJobsAfter).
	// A job of an ordering key holds its key until it is finalized, so a
	// worker killed mid-job holds the key until the rescue retries it.
	WorkerJobTimeoutS  int `envconfig:"OUTBOX_WORKER_JOB_TIMEOUT_S" default:"60"`
	WorkerRescueAfterS int `envconfig:"OUTBOX_WORKER_RESCUE_AFTER_S" default:"3600"`

	DatabaseMaxConns  int    `envconfig:"OUTBOX_DATABASE_MAX_CONNS" default:"0"`
	ShutdownTimeoutMS int    `envconfig:"OUTBOX_SHUTDOWN_TIMEOUT_MS" default:"30000"`
	LogFormat         string `envconfig:"OUTBOX_LOG_FORMAT" default:"text"`
	LogLevel          string `envconfig:"OUTBOX_LOG_LEVEL" default:"info"`
	SentryDSN         string `envconfig:"SENTRY_DSN"`

	// Operations (docs/operations.md).
	HTTPAddr             string `envconfig:"OUTBOX_HTTP_ADDR" default:"127.0.0.1:9090"`
	RetentionEnabled     bool   `envconfig:"OUTBOX_RETENTION_ENABLED" default:"true"`
	ListenerAlertAfterMS int    `envconfig:"OUTBOX_LISTENER_ALERT_AFTER_MS" default:"60000"`
	SentryIncludePayload bool   `envconfig:"OUTBOX_SENTRY_INCLUDE_PAYLOAD" default:"false"`
	SentryEnvironment    string `envconfig:"SENTRY_ENVIRONMENT"`

	// The console and River UI on the HTTP listener (docs/console.md).
	ConsoleEnabled  bool   `envconfig:"OUTBOX_CONSOLE_ENABLED" default:"true"`
	ConsoleToken    string `envconfig:"OUTBOX_CONSOLE_TOKEN"`
	ConsolePayloads bool   `envconfig:"OUTBOX_CONSOLE_PAYLOADS" default:"false"`
	RiverUIEnabled  bool   `envconfig:"OUTBOX_RIVERUI_ENABLED" default:"true"`
	// HTTPAddrDefaulted is true when OUTBOX_HTTP_ADDR is unset (the default
	// address is used): a taken port is then a warning, not a failure.
	HTTPAddrDefaulted bool `ignored:"true"`

	// River workers and queue groups (workers.go).
	Workers
}

// Load reads the environment and validates it.
func Load() (*Config, error) {
	var c Config
	if err := envconfig.Process("", &c); err != nil {
		return nil, explain(err)
	}
	_, set := os.LookupEnv("OUTBOX_HTTP_ADDR")
	c.HTTPAddrDefaulted = !set
	if c.HTTPAddr == "off" {
		c.HTTPAddr = ""
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// explain turns envconfig's error into one that leads with the variable.
func explain(err error) error {
	var perr *envconfig.ParseError
	if errors.As(err, &perr) {
		return fmt.Errorf("configuration: %s=%q is not a valid %s", perr.KeyName, perr.Value, perr.TypeName)
	}
	return fmt.Errorf("configuration: %w", err)
}

type intRule struct {
	name     string
	value    int
	min, max int
}

// Validate checks ranges; each error names the variable.
func (c *Config) Validate() error {
	rules := []intRule{
		{"OUTBOX_DISPATCH_INTERVAL_MS", c.DispatchIntervalMS, 1, 3_600_000},
		{"OUTBOX_DISPATCH_BATCH_SIZE", c.DispatchBatchSize, 1, 10_000},
		{"OUTBOX_DISPATCH_BATCH_BYTES", c.DispatchBatchBytes, 1024, 1 << 30},
		{"OUTBOX_DISPATCH_CONCURRENCY", c.DispatchConcurrency, 1, 1000},
		{"OUTBOX_DISPATCH_TIMEOUT_MS", c.DispatchTimeoutMS, 100, 3_600_000},
		{"OUTBOX_MAX_RETRIES", c.MaxRetries, 0, 1000},
		{"OUTBOX_DISPATCH_LINGER_MS", c.DispatchLingerMS, 0, 10_000},
		{"OUTBOX_DONE_RETENTION_HOURS", c.DoneRetentionHours, 1, 1_000_000},
		{"OUTBOX_LISTEN_RECONNECT_DELAY_MS", c.ListenReconnectDelayMS, 1, 600_000},
		{"OUTBOX_LISTEN_PING_INTERVAL_MS", c.ListenPingIntervalMS, 100, 600_000},
		{"OUTBOX_RIVER_FETCH_COOLDOWN_MS", c.RiverFetchCooldownMS, 1, 60_000},
		{"OUTBOX_RIVER_FETCH_POLL_INTERVAL_MS", c.RiverFetchPollIntervalMS, 1, 600_000},
		{"OUTBOX_RIVER_GIN_CLEAN_INTERVAL_MS", c.RiverGINCleanIntervalMS, 0, 3_600_000},
		{"OUTBOX_WORKER_JOB_TIMEOUT_S", c.WorkerJobTimeoutS, 1, 86_400},
		{"OUTBOX_WORKER_RESCUE_AFTER_S", c.WorkerRescueAfterS, 1, 604_800},
		{"OUTBOX_DATABASE_MAX_CONNS", c.DatabaseMaxConns, 0, 10_000},
		{"OUTBOX_SHUTDOWN_TIMEOUT_MS", c.ShutdownTimeoutMS, 0, 3_600_000},
		{"OUTBOX_LISTENER_ALERT_AFTER_MS", c.ListenerAlertAfterMS, 1000, 86_400_000},
	}
	var errs []error
	for _, r := range rules {
		if r.value < r.min || r.value > r.max {
			errs = append(errs, fmt.Errorf("configuration: %s=%d is out of range: it must be between %d and %d", r.name, r.value, r.min, r.max))
		}
	}
	// The batch size is clamped, not refused (the contract says 1..10000).
	if c.DoneRetentionBatchSize < 1 {
		c.DoneRetentionBatchSize = 1
	} else if c.DoneRetentionBatchSize > 10000 {
		c.DoneRetentionBatchSize = 10000
	}
	if c.RiverFetchPollIntervalMS < c.RiverFetchCooldownMS {
		errs = append(errs, fmt.Errorf("configuration: OUTBOX_RIVER_FETCH_POLL_INTERVAL_MS=%d must not be shorter than OUTBOX_RIVER_FETCH_COOLDOWN_MS=%d", c.RiverFetchPollIntervalMS, c.RiverFetchCooldownMS))
	}
	if c.WorkerRescueAfterS < c.WorkerJobTimeoutS {
		errs = append(errs, fmt.Errorf("configuration: OUTBOX_WORKER_RESCUE_AFTER_S=%d must not be shorter than OUTBOX_WORKER_JOB_TIMEOUT_S=%d (River rescues only jobs past their timeout)", c.WorkerRescueAfterS, c.WorkerJobTimeoutS))
	}
	if c.HTTPAddr != "" {
		if _, port, err := net.SplitHostPort(c.HTTPAddr); err != nil || port == "" {
			errs = append(errs, fmt.Errorf("configuration: OUTBOX_HTTP_ADDR=%q must be host:port, e.g. 127.0.0.1:9090 (the default) or :9090, or off (or empty) to turn the HTTP listener off", c.HTTPAddr))
		}
	}
	if c.ConsoleToken != "" && len(c.ConsoleToken) < 16 {
		errs = append(errs, fmt.Errorf("configuration: OUTBOX_CONSOLE_TOKEN is %d bytes: use at least 16 (e.g. openssl rand -hex 24), or leave it unset for a read-only console", len(c.ConsoleToken)))
	}
	switch c.LogFormat {
	case "text", "json":
	default:
		errs = append(errs, fmt.Errorf("configuration: OUTBOX_LOG_FORMAT=%q must be text or json", c.LogFormat))
	}
	switch strings.ToLower(c.LogLevel) {
	case "debug", "info", "warn", "error":
	default:
		errs = append(errs, fmt.Errorf("configuration: OUTBOX_LOG_LEVEL=%q must be debug, info, warn or error", c.LogLevel))
	}
	if c.DispatcherEnabled {
		if c.DatabaseURL == "" {
			errs = append(errs, errors.New("configuration: DATABASE_URL is required"))
		}
		if c.RoutesFile == "" {
			errs = append(errs, errors.New("configuration: OUTBOX_ROUTES_FILE is required when OUTBOX_DISPATCHER_ENABLED=true: the dispatcher refuses to start without routes (see docs/examples/routes.yaml)"))
		}
	}
	errs = append(errs, c.validateWorkers()...)
	return errors.Join(errs...)
}

// Dispatcher returns the dispatcher settings (without routes, alerter and
// logger).
func (c *Config) Dispatcher() dispatcher.Config {
	maxRetries := c.MaxRetries
	if maxRetries == 0 {
		maxRetries = -1 // dispatcher.Config: negative means "none"
	}
	return dispatcher.Config{
		BatchSize:         c.DispatchBatchSize,
		BatchBytes:        c.DispatchBatchBytes,
		Concurrency:       c.DispatchConcurrency,
		PollInterval:      ms(c.DispatchIntervalMS),
		ListenDisabled:    !c.ListenEnabled,
		MaxRetries:        maxRetries,
		BatchTimeout:      ms(c.DispatchTimeoutMS),
		ReconnectDelay:    ms(c.ListenReconnectDelayMS),
		PingInterval:      ms(c.ListenPingIntervalMS),
		SynchronousCommit: c.DispatchSyncCommit,
		Linger:            linger(c.DispatchLingerMS),
	}
}

func ms(n int) time.Duration { return time.Duration(n) * time.Millisecond }

// linger maps OUTBOX_DISPATCH_LINGER_MS to dispatcher.Config.Linger, where
// 0 means the default and a negative value means none.
func linger(n int) time.Duration {
	if n == 0 {
		return -1
	}
	return ms(n)
}
