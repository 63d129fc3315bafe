package outboxriver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
)

// Event is an outbox event as a receiver sees it: the event that the
// dispatcher handed to River, and the River job that delivers it.
type Event struct {
	// ID is the outbox event id, the receivers' idempotency key.
	ID int64
	// Type is the event type, e.g. "mail.receipt.requested".
	Type string
	// TenantID is the tenant, or "" when the event has none (the table
	// never stores an empty tenant id, so "" is unambiguous).
	TenantID string
	// Payload is the event body as published (JSON). Decode turns it into a
	// struct.
	Payload json.RawMessage
	// DispatchKey is the producer's idempotency key, or "" when none.
	DispatchKey string
	// CreatedAt is when the event was written (the database's clock).
	CreatedAt time.Time
	// OrderingKey is the event's ordering key, or "" when none.
	OrderingKey string

	// JobID is the River job delivering the event (0 for an Event not built
	// from a job).
	JobID int64
	// Queue is the River queue of that job.
	Queue string
	// Attempt is the job's attempt number: 1 on the first run, 2 on the
	// first retry, and so on.
	Attempt int

	// complete completes the River job with river.JobCompleteTx, for
	// WithIdempotency; nil for an Event not built from a running job.
	complete func(ctx context.Context, tx pgx.Tx) error
}

// EventFromJob returns the Event that job delivers. Worker calls it for
// every job; call it yourself when you write your own River worker for
// EventArgs and still want WithIdempotency and WithClaim.
func EventFromJob(job *river.Job[EventArgs]) Event {
	a := job.Args
	ev := Event{
		ID:        a.EventID,
		Type:      a.EventType,
		Payload:   a.Payload,
		CreatedAt: a.CreatedAt,
		JobID:     job.ID,
		Queue:     job.Queue,
		Attempt:   job.Attempt,
		complete:  completer(job),
	}
	if a.TenantID != nil {
		ev.TenantID = *a.TenantID
	}
	if a.DispatchKey != nil {
		ev.DispatchKey = *a.DispatchKey
	}
	if a.OrderingKey != nil {
		ev.OrderingKey = *a.OrderingKey
	}
	return ev
}

// DecodeError reports a payload that does not decode into the handler's
// type. Retrying does not fix it; a new receiver version (or a fixed
// producer and a new event) does. A handler that wants the job discarded at
// once can return river.JobCancel(err).
type DecodeError struct {
	EventID   int64
	EventType string
	// Target is the Go type the payload was decoded into.
	Target string
	// Err is encoding/json's error.
	Err error
}

func (e *DecodeError) Error() string {
	return fmt.Sprintf("outboxriver: payload of event %d (%s) does not decode into %s: %s",
		e.EventID, e.EventType, e.Target, describeJSONError(e.Err))
}

func (e *DecodeError) Unwrap() error { return e.Err }

// describeJSONError names the field and the types for the common errors.
func describeJSONError(err error) string {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te):
		field := te.Field
		if field == "" {
			field = "(top level)"
		}
		return fmt.Sprintf("field %s: JSON %s cannot be a Go %s", field, te.Value, te.Type)
	case errors.As(err, &se):
		return fmt.Sprintf("not valid JSON at byte %d: %v", se.Offset, err)
	default:
		return err.Error()
	}
}

// Decode decodes ev's payload into a T. Unknown fields are ignored, so
// producers may add fields without breaking receivers; a missing field
// leaves its zero value. A payload that does not fit T is a *DecodeError
// that names the event, the target type and the field.
//
//	type Receipt struct {
//		InvoiceID   int64 `json:"invoice_id"`
//		AmountCents int   `json:"amount_cents"`
//	}
//	r, err := outboxriver.Decode[Receipt](ev)
func Decode[T any](ev Event) (T, error) {
	var v T
	payload := ev.Payload
	if len(payload) == 0 {
		payload = json.RawMessage("{}")
	}
	if err := json.Unmarshal(payload, &v); err != nil {
		return v, &DecodeError{
			EventID:   ev.ID,
			EventType: ev.Type,
			Target:    reflect.TypeFor[T]().String(),
			Err:       err,
		}
	}
	return v, nil
}
