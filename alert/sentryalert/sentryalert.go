// Package sentryalert sends the outbox's alerts (alert.Alerter) to Sentry
// with github.com/getsentry/sentry-go.
//
// Grouping: every alert carries the fingerprint
//
//	["outbox", <reason>, <event type prefix>]
//
// where the prefix is the event type's first PrefixSegments segments
// ("mail.user." for mail.user.welcome), so a thousand dead-lettered
// mail.user.* events are one Sentry issue, and unroutable billing events
// are another. Alerts without an event (a failing dispatcher loop, a
// disconnected listener) use "-" as the prefix. A parked ordering key is
// one issue per key and queue:
//
//	["outbox", "parked_key", <tenant or "-">, <ordering key>, <queue>]
//
// Bursts: at most Burst alerts per fingerprint are sent per Window; the
// rest are counted and the next alert sent for that fingerprint carries the
// number suppressed (context "outbox", key "suppressed"). Every alert is
// still written to Logger when one is set.
//
// Privacy: an alert carries the event id, type, tenant, retries, the
// ordering key, queue and job id, and the error, never the payload (it may hold personal data), and the client is
// created with SendDefaultPII off. IncludePayload opts in: the payload is
// then read from the database by id and attached.
package sentryalert

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/getsentry/sentry-go"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/alert"
)

// Config configures New. Zero values take the documented defaults.
type Config struct {
	// DSN of the Sentry project (SENTRY_DSN). Required unless Client is set.
	DSN string
	// Client, if set, is used instead of a client built from DSN.
	Client *sentry.Client
	// Environment and Release are sent with every event (optional).
	Environment string
	Release     string
	// PrefixSegments is how many leading segments of the event type form
	// the fingerprint's prefix. 0 means 2 ("mail.user.").
	PrefixSegments int
	// Burst is the most alerts sent per fingerprint per Window. 0 means 10.
	Burst int
	// Window of the rate limit. 0 means 1 minute.
	Window time.Duration
	// IncludePayload attaches the event's payload, read from Pool by id.
	// Off by default: payloads may hold personal data.
	IncludePayload bool
	// Pool reads payloads when IncludePayload is set.
	Pool *pgxpool.Pool
	// Logger, if set, also receives every alert (alert.Log), sent or
	// suppressed.
	Logger *slog.Logger
	// Now is the clock of the rate limit; nil means time.Now (tests).
	Now func() time.Time
}

// Alerter is an alert.Alerter that sends to Sentry. Create it with New.
type Alerter struct {
	cfg    Config
	client *sentry.Client
	log    alert.Alerter

	mu      sync.Mutex
	buckets map[string]*bucket
}

type bucket struct {
	start      time.Time
	sent       int
	suppressed int
}

// maxBuckets bounds the rate limiter's memory; expired buckets are dropped
// when it is reached.
const maxBuckets = 10000

// New builds an Alerter.
func New(cfg Config) (*Alerter, error) {
	if cfg.PrefixSegments == 0 {
		cfg.PrefixSegments = 2
	}
	if cfg.Burst == 0 {
		cfg.Burst = 10
	}
	if cfg.Window == 0 {
		cfg.Window = time.Minute
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	switch {
	case cfg.PrefixSegments < 1:
		return nil, fmt.Errorf("sentryalert: PrefixSegments must be at least 1, got %d", cfg.PrefixSegments)
	case cfg.Burst < 1:
		return nil, fmt.Errorf("sentryalert: Burst must be at least 1, got %d", cfg.Burst)
	case cfg.Window < 0:
		return nil, errors.New("sentryalert: Window must not be negative")
	case cfg.IncludePayload && cfg.Pool == nil:
		return nil, errors.New("sentryalert: IncludePayload needs Pool to read payloads")
	}
	client := cfg.Client
	if client == nil {
		if cfg.DSN == "" {
			return nil, errors.New("sentryalert: DSN (SENTRY_DSN) is required")
		}
		var err error
		client, err = sentry.NewClient(sentry.ClientOptions{
			Dsn:            cfg.DSN,
			Environment:    cfg.Environment,
			Release:        cfg.Release,
			SendDefaultPII: false,
			MaxBreadcrumbs: -1,
		})
		if err != nil {
			return nil, fmt.Errorf("sentryalert: SENTRY_DSN: %w", err)
		}
	}
	a := &Alerter{cfg: cfg, client: client, buckets: map[string]*bucket{}}
	if cfg.Logger != nil {
		a.log = alert.Log{Logger: cfg.Logger}
	}
	return a, nil
}

// Client returns the Sentry client (to Flush it at shutdown).
func (a *Alerter) Client() *sentry.Client { return a.client }

// Flush waits up to timeout for queued events to be sent.
func (a *Alerter) Flush(timeout time.Duration) bool { return a.client.Flush(timeout) }

// TypePrefix returns the first n segments of an event type with a trailing
// dot ("mail.user." for mail.user.welcome and n = 2), the whole type (with
// a dot) when it has no more than n segments, and "-" for no type.
func TypePrefix(eventType string, n int) string {
	if eventType == "" {
		return "-"
	}
	parts := strings.SplitN(eventType, ".", n+1)
	if len(parts) > n {
		parts = parts[:n]
	}
	return strings.Join(parts, ".") + "."
}

// Fingerprint is the grouping of an alert in Sentry.
func (a *Alerter) Fingerprint(al alert.Alert) []string {
	if al.Reason == alert.ParkedKey {
		tenant := al.TenantID
		if tenant == "" {
			tenant = "-"
		}
		return []string{"outbox", string(al.Reason), tenant, al.OrderingKey, al.Queue}
	}
	return []string{"outbox", string(al.Reason), TypePrefix(al.EventType, a.cfg.PrefixSegments)}
}

// Alert implements alert.Alerter. It does not block on the network: the
// client's transport queues the event (reading a payload, when enabled,
// takes one query bounded by 2 s).
func (a *Alerter) Alert(ctx context.Context, al alert.Alert) {
	if a.log != nil {
		a.log.Alert(ctx, al)
	}
	fp := a.Fingerprint(al)
	send, suppressed := a.admit(strings.Join(fp, "\x00"))
	if !send {
		return
	}
	prefix := TypePrefix(al.EventType, a.cfg.PrefixSegments)

	ev := sentry.NewEvent()
	ev.Level = sentry.LevelError
	if al.Reason == alert.ListenerDisconnected {
		ev.Level = sentry.LevelWarning
	}
	ev.Message = al.Message
	ev.Logger = "outbox"
	ev.Fingerprint = fp
	ev.Environment = a.cfg.Environment
	ev.Release = a.cfg.Release
	ev.Tags = map[string]string{
		"outbox.reason":      string(al.Reason),
		"outbox.type_prefix": prefix,
	}
	if al.EventType != "" {
		ev.Tags["outbox.event_type"] = al.EventType
	}
	if al.TenantID != "" {
		ev.Tags["outbox.tenant_id"] = al.TenantID
	}
	if al.Queue != "" {
		ev.Tags["outbox.queue"] = al.Queue
	}
	detail := sentry.Context{"reason": string(al.Reason)}
	if al.EventID != 0 {
		detail["event_id"] = strconv.FormatInt(al.EventID, 10)
	}
	if al.EventType != "" {
		detail["event_type"] = al.EventType
	}
	if al.TenantID != "" {
		detail["tenant_id"] = al.TenantID
	}
	if al.Retries != 0 {
		detail["retries"] = al.Retries
	}
	if al.OrderingKey != "" {
		detail["ordering_key"] = al.OrderingKey
	}
	if al.Queue != "" {
		detail["queue"] = al.Queue
	}
	if al.JobID != 0 {
		detail["job_id"] = strconv.FormatInt(al.JobID, 10)
	}
	if al.Err != "" {
		detail["error"] = al.Err
	}
	if suppressed > 0 {
		detail["suppressed"] = suppressed
	}
	if a.cfg.IncludePayload && al.EventID != 0 {
		detail["payload"] = a.payload(ctx, al.EventID)
	}
	ev.Contexts = map[string]sentry.Context{"outbox": detail}
	a.client.CaptureEvent(ev, nil, nil)
}

// admit applies the rate limit to one fingerprint key: whether to send,
// and how many alerts were suppressed since the last one sent.
func (a *Alerter) admit(key string) (bool, int) {
	now := a.cfg.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	b, ok := a.buckets[key]
	if !ok {
		if len(a.buckets) >= maxBuckets {
			for k, old := range a.buckets {
				if now.Sub(old.start) >= a.cfg.Window && old.suppressed == 0 {
					delete(a.buckets, k)
				}
			}
		}
		b = &bucket{start: now}
		a.buckets[key] = b
	}
	if now.Sub(b.start) >= a.cfg.Window {
		b.start, b.sent = now, 0
	}
	if b.sent >= a.cfg.Burst {
		b.suppressed++
		return false, 0
	}
	b.sent++
	n := b.suppressed
	b.suppressed = 0
	return true, n
}

func (a *Alerter) payload(ctx context.Context, id int64) any {
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	var p json.RawMessage
	if err := a.cfg.Pool.QueryRow(qctx, `SELECT payload FROM outbox_event WHERE id = $1`, id).Scan(&p); err != nil {
		return "unavailable: " + err.Error()
	}
	return p
}
