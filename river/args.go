package outboxriver

import (
	"encoding/json"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
)

// Kind is the River job kind of every outbox job.
const Kind = "outbox_event"

// EventArgs are the args of the River job created for one (event, queue).
// The JSON field names are part of the contract.
type EventArgs struct {
	// EventID is the outbox event id, also the receivers' idempotency key.
	EventID int64 `json:"event_id"`
	// EventType is the event's type, e.g. "billing.invoice.paid".
	EventType string `json:"event_type"`
	// TenantID is the tenant, or nil.
	TenantID *string `json:"tenant_id"`
	// Payload is the event body as published.
	Payload json.RawMessage `json:"payload"`
	// DispatchKey is the producer's idempotency key, or nil.
	DispatchKey *string `json:"dispatch_key"`
	// CreatedAt is when the event was written (the database's clock).
	CreatedAt time.Time `json:"created_at"`
	// TraceContext is the producer's W3C trace context as the outbox
	// stores it (the traceparent, optionally followed by a space and the
	// tracestate), or "" when none. It is not part of the args JSON: the
	// handoff (JobParams) writes it into the job's metadata under
	// MetadataTraceParent and MetadataTraceState, where River's
	// OpenTelemetry middleware and TraceMiddleware read it.
	TraceContext string `json:"-"`
	// OrderingKey is the event's ordering key, or nil (see
	// outbox.Event.OrderingKey).
	OrderingKey *string `json:"ordering_key,omitempty"`
	// OrderingPosition is the event's place in its key's order (ascending;
	// not consecutive), 0 when the event has no key. It is not part of the
	// args JSON: JobParams writes it into the job's metadata under
	// MetadataOrderingPosition, where the ordering trigger reads it.
	OrderingPosition int64 `json:"-"`
}

// Kind implements river.JobArgs.
func (EventArgs) Kind() string { return Kind }

// Latency settings shared by insert clients (NewInsertClient) and by the
// workers. River debounces its insert NOTIFY per client by FetchCooldown
// (default 100 ms) and sends no trailing notify, so a second insert inside
// the window waits for the worker's poll: with River's defaults an event that
// reaches River in a millisecond can wait 100 ms to 1 s more to be worked.
const (
	// DefaultFetchCooldown is the outbox's default for both clients.
	DefaultFetchCooldown = 1 * time.Millisecond
	// DefaultFetchPollInterval is the outbox's default worker poll fallback.
	DefaultFetchPollInterval = 100 * time.Millisecond
)

// InsertClientConfig configures NewInsertClient.
type InsertClientConfig struct {
	// FetchCooldown is the insert NOTIFY debounce of the inserting client.
	// 0 means DefaultFetchCooldown. River's minimum is 1 ms.
	FetchCooldown time.Duration
	// Silent switches River's own insert notification off (after the
	// client's first insert), for a caller that announces every insert
	// itself in the same transaction (AnnounceSQL): River sends its
	// notification in a round trip of its own, which such a caller saves
	// by sending the announcement with its other statements. FetchCooldown
	// is then ignored.
	Silent bool
}

// silentCooldown is the FetchCooldown of a Silent client: River sends an
// insert notification at most once per cooldown, so with a cooldown
// longer than any process lives only the first insert notifies.
const silentCooldown = 100 * 365 * 24 * time.Hour

// NewInsertClient returns an insert-only River client (no queues, no
// workers), with the outbox's low-latency notification settings, for an
// application that inserts jobs worked by other clients: it skips River's
// check that a worker is registered for the kind. (The dispatcher itself
// inserts its jobs in the statements that hand its batches off; see package
// claim.)
func NewInsertClient(pool *pgxpool.Pool, cfg InsertClientConfig) (*river.Client[pgx.Tx], error) {
	cooldown := cfg.FetchCooldown
	switch {
	case cfg.Silent:
		cooldown = silentCooldown
	case cooldown == 0:
		cooldown = DefaultFetchCooldown
	}
	return river.NewClient(riverpgxv5.New(pool), &river.Config{
		FetchCooldown:       cooldown,
		FetchPollInterval:   max(cooldown, DefaultFetchPollInterval),
		SkipUnknownJobCheck: true,
	})
}
