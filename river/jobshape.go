package outboxriver

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/outboxhq/outbox/route"
)

// The keys of the outbox facts in every handed-off job's River metadata,
// whatever the job's kind and args. They let a plain river.Worker[T] know
// the event it works (JobEvent, EventFromMetadata), and let River UI and SQL
// find a job by its event:
//
//	SELECT * FROM river_job WHERE metadata @> '{"outbox_event_id": 42}'
const (
	// MetadataEventID is the event id, a JSON number.
	MetadataEventID = "outbox_event_id"
	// MetadataEventType is the event type, a string.
	MetadataEventType = "outbox_event_type"
	// MetadataTenantID is the tenant, a string; absent when the event has
	// none.
	MetadataTenantID = "outbox_tenant_id"
	// MetadataDispatchKey is the producer's dispatch key, a string; absent
	// when the event has none.
	MetadataDispatchKey = "outbox_dispatch_key"
	// MetadataCreatedAt is when the event was written (RFC 3339, the
	// database's clock); only on payload-args jobs (envelope args carry
	// created_at themselves).
	MetadataCreatedAt = "outbox_created_at"
	// MetadataArgs is "payload" on a job whose args are the event payload;
	// absent on envelope jobs.
	MetadataArgs = "outbox_args"
	// MetadataOrderingKey is the event's ordering key, a string; absent
	// when the event has none. A job that carries it is an ordered job:
	// the ordering triggers hold it back until the job before it in its
	// (tenant, key, queue) is finalized: in its key's line when the
	// handoff inserts it (migration 024), in River's pending state when
	// other code does (see docs/ordering.md).
	MetadataOrderingKey = "outbox_ordering_key"
	// MetadataOrderingPosition is the event's position in its key's order,
	// a JSON number; present with MetadataOrderingKey.
	MetadataOrderingPosition = "outbox_ordering_position"
)

// The producer's trace context is in the metadata too, under the W3C keys
// MetadataTraceParent and MetadataTraceState (trace.go).

// jobMetadata is the JSON of the metadata keys above.
type jobMetadata struct {
	EventID     *int64     `json:"outbox_event_id"`
	EventType   string     `json:"outbox_event_type"`
	TenantID    *string    `json:"outbox_tenant_id,omitempty"`
	DispatchKey *string    `json:"outbox_dispatch_key,omitempty"`
	CreatedAt   *time.Time `json:"outbox_created_at,omitempty"`
	Args        route.Args `json:"outbox_args,omitempty"`
	TraceParent string     `json:"traceparent,omitempty"`
	TraceState  string     `json:"tracestate,omitempty"`
	OrderingKey *string    `json:"outbox_ordering_key,omitempty"`
	OrderingPos *int64     `json:"outbox_ordering_position,omitempty"`
}

// PayloadArgs are the args of a job whose route says args: payload: the
// event's payload, verbatim, under the route's kind. River encodes args
// with encoding/json (which only compacts what MarshalJSON returns), so the
// payload becomes the job's args and a river.Worker[T] registered for the
// kind decodes it as its own T.
type PayloadArgs struct {
	// JobKind is the route's kind.
	JobKind string
	// Payload is the event payload (JSON). Empty means {}.
	Payload json.RawMessage
}

// Kind implements river.JobArgs.
func (a PayloadArgs) Kind() string { return a.JobKind }

// MarshalJSON returns the payload itself.
func (a PayloadArgs) MarshalJSON() ([]byte, error) {
	if len(a.Payload) == 0 {
		return []byte("{}"), nil
	}
	return a.Payload, nil
}

// KindedEventArgs are envelope args (EventArgs, the same JSON) under a kind
// other than outbox_event, for a route that gives envelope args its own
// kind. Work them with a river.Worker of your own args type with that kind
// and EventArgs' fields, or with EventFromMetadata.
type KindedEventArgs struct {
	EventArgs
	// JobKind is the route's kind.
	JobKind string
}

// Kind implements river.JobArgs.
func (a KindedEventArgs) Kind() string { return a.JobKind }

// MarshalJSON encodes the envelope exactly as EventArgs.
func (a KindedEventArgs) MarshalJSON() ([]byte, error) { return json.Marshal(a.EventArgs) }

// JobParams returns the River insert params of the jobs rule makes for one
// event: one per queue of the rule, in the rule's order, each with its
// queue's shape (kind, args, priority, max attempts, tags) and the outbox
// metadata (MetadataEventID and the rest, and the producer's trace context
// from ev.TraceContext under MetadataTraceParent and MetadataTraceState).
// ev carries the event as claimed;
// its Payload is passed on as raw JSON, never parsed.
//
// rule is a rule of a route.Table (route.New fills in and validates the job
// shapes). A rule built by hand without Jobs gets the default shape for
// each of its Queues. Pass the result to river.Client.InsertManyTx.
func JobParams(rule route.Rule, ev EventArgs) []river.InsertManyParams {
	jobs := rule.Jobs
	if len(jobs) == 0 {
		jobs = make([]route.Job, len(rule.Queues))
		for i, q := range rule.Queues {
			jobs[i] = route.Job{Queue: q}
		}
	}
	id := ev.EventID
	meta := jobMetadata{
		EventID:     &id,
		EventType:   ev.EventType,
		TenantID:    ev.TenantID,
		DispatchKey: ev.DispatchKey,
	}
	if ev.OrderingKey != nil {
		pos := ev.OrderingPosition
		meta.OrderingKey, meta.OrderingPos = ev.OrderingKey, &pos
	}
	meta.TraceParent, meta.TraceState = splitTraceContext(ev.TraceContext)
	var encoded [2][]byte // per args shape: the metadata differs only there
	params := make([]river.InsertManyParams, len(jobs))
	for i, j := range jobs {
		kind := j.Kind
		if kind == "" {
			kind = route.DefaultKind
		}
		var (
			args  river.JobArgs
			shape = 0
		)
		switch {
		case j.Args == route.ArgsPayload:
			args, shape = PayloadArgs{JobKind: kind, Payload: ev.Payload}, 1
		case kind == Kind:
			args = ev
		default:
			args = KindedEventArgs{EventArgs: ev, JobKind: kind}
		}
		if encoded[shape] == nil {
			// River indexes metadata with GIN, one entry per key and per
			// value, on every insert: envelope jobs (the default) carry
			// the event's creation time and shape in their args, so only
			// payload-args jobs spend entries on them (measured: the two
			// keys on every job cost the drain about 10 %).
			meta.Args, meta.CreatedAt = "", nil
			if shape == 1 {
				created := ev.CreatedAt
				meta.Args, meta.CreatedAt = route.ArgsPayload, &created
			}
			// Marshalling a struct of strings, numbers and a time cannot
			// fail.
			encoded[shape], _ = json.Marshal(meta)
		}
		params[i] = river.InsertManyParams{Args: args, InsertOpts: &river.InsertOpts{
			Queue:       j.Queue,
			Priority:    j.Priority,
			MaxAttempts: j.MaxAttempts,
			Tags:        j.Tags,
			Metadata:    encoded[shape],
		}}
	}
	return params
}

// EventFromMetadata returns the event a job row was handed off for, read
// from the outbox metadata (MetadataEventID and the rest), and the job's id,
// queue and attempt. Payload is the event payload whatever the args shape.
// It reports false for a job without the outbox metadata (a job inserted
// by something else, or an outbox_event job handed off before job metadata existed: use
// EventFromJob for those).
//
// The Event completes no job in WithIdempotency (a *rivertype.JobRow
// cannot be completed in a transaction): in a worker, use JobEvent.
func EventFromMetadata(row *rivertype.JobRow) (Event, bool) {
	if row == nil || len(row.Metadata) == 0 {
		return Event{}, false
	}
	var m jobMetadata
	if err := json.Unmarshal(row.Metadata, &m); err != nil || m.EventID == nil {
		return Event{}, false
	}
	ev := Event{
		ID:      *m.EventID,
		Type:    m.EventType,
		JobID:   row.ID,
		Queue:   row.Queue,
		Attempt: row.Attempt,
	}
	if m.CreatedAt != nil {
		ev.CreatedAt = *m.CreatedAt
	}
	if m.TenantID != nil {
		ev.TenantID = *m.TenantID
	}
	if m.DispatchKey != nil {
		ev.DispatchKey = *m.DispatchKey
	}
	if m.OrderingKey != nil {
		ev.OrderingKey = *m.OrderingKey
	}
	if m.Args == route.ArgsPayload {
		ev.Payload = json.RawMessage(row.EncodedArgs)
	} else {
		// Envelope args (EventArgs): the payload and the creation time.
		var env struct {
			Payload   json.RawMessage `json:"payload"`
			CreatedAt time.Time       `json:"created_at"`
		}
		if json.Unmarshal(row.EncodedArgs, &env) == nil {
			ev.Payload = env.Payload
			if ev.CreatedAt.IsZero() {
				ev.CreatedAt = env.CreatedAt
			}
		}
	}
	return ev, true
}

// JobEvent returns the event that job, of any args type, was handed off
// for (EventFromMetadata), ready for WithIdempotency (which then completes
// job in the receiver's transaction) and WithClaim. A plain
// river.Worker[SendInvoiceArgs] calls it in Work. It reports false for a
// job without the outbox metadata, except an EventArgs job, whose args
// name the event.
func JobEvent[T river.JobArgs](job *river.Job[T]) (Event, bool) {
	if job == nil {
		return Event{}, false
	}
	ev, ok := EventFromMetadata(job.JobRow)
	if !ok {
		if env, isEnv := any(job).(*river.Job[EventArgs]); isEnv {
			return EventFromJob(env), true
		}
		return Event{}, false
	}
	ev.complete = completer(job)
	return ev, true
}

// ErrNoOutboxEvent is returned by WithIdempotencyJob for a job that does
// not carry the outbox metadata (it was not handed off by the outbox).
var ErrNoOutboxEvent = errors.New("outboxriver: the job carries no outbox event metadata (outbox_event_id): it was not handed off by the outbox dispatcher")

// WithIdempotencyJob is WithIdempotency for a plain river.Worker[T]: it
// reads the event from job's metadata (JobEvent), applies fn exactly once
// per (r, event) in tx, and completes job in tx. A job without the outbox
// metadata is ErrNoOutboxEvent, and fn does not run.
func WithIdempotencyJob[T river.JobArgs](ctx context.Context, tx pgx.Tx, r Receiver, job *river.Job[T], fn func(ctx context.Context, tx pgx.Tx) error) (duplicate bool, err error) {
	ev, ok := JobEvent(job)
	if !ok {
		return false, ErrNoOutboxEvent
	}
	return WithIdempotency(ctx, tx, r, ev, fn)
}

// completer completes job in the caller's transaction.
func completer[T river.JobArgs](job *river.Job[T]) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		_, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
		return err
	}
}
