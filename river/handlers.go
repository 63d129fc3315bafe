package outboxriver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"

	"github.com/riverqueue/river"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/route"
)

// Handler applies one outbox event.
//
// A handler runs at least once per job: River runs a job again after an
// error, a timeout or a crash. Make its effect idempotent with
// WithIdempotency (effects in the same database) or WithClaim (external
// effects), both keyed by the event id.
type Handler interface {
	HandleEvent(ctx context.Context, ev Event) error
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, ev Event) error

// HandleEvent implements Handler.
func (f HandlerFunc) HandleEvent(ctx context.Context, ev Event) error { return f(ctx, ev) }

// Typed returns a Handler that decodes the payload into a T (see Decode)
// before calling fn. A payload that does not decode fails the job with a
// *DecodeError.
func Typed[T any](fn func(ctx context.Context, ev Event, payload T) error) Handler {
	return HandlerFunc(func(ctx context.Context, ev Event) error {
		v, err := Decode[T](ev)
		if err != nil {
			return err
		}
		return fn(ctx, ev, v)
	})
}

// Handlers maps event-type prefixes to handlers. The longest registered
// prefix that matches an event's type wins, with the same rules as routes:
// a prefix is whole segments ending in a dot ("mail.", "plugin.hook."), or a
// complete event type for an exact match. The empty prefix "" is the
// catch-all, used when nothing longer matches.
//
// Register every handler before the River client starts; Lookup is safe for
// concurrent use after that.
type Handlers struct {
	// entries sorted by descending prefix length.
	entries []handlerEntry
}

type handlerEntry struct {
	prefix  string
	handler Handler
}

// NewHandlers returns an empty registry.
func NewHandlers() *Handlers { return &Handlers{} }

// Add registers h for prefix. It returns an error for an invalid prefix, a
// nil handler or a prefix registered twice.
func (hs *Handlers) Add(prefix string, h Handler) error {
	if h == nil {
		return fmt.Errorf("outboxriver: handler for prefix %q is nil", prefix)
	}
	if prefix != "" {
		if err := route.ValidatePrefix(prefix); err != nil {
			return fmt.Errorf("outboxriver: %w", err)
		}
	}
	for _, e := range hs.entries {
		if e.prefix == prefix {
			return fmt.Errorf("outboxriver: a handler for prefix %q is already registered", prefix)
		}
	}
	hs.entries = append(hs.entries, handlerEntry{prefix: prefix, handler: h})
	sort.SliceStable(hs.entries, func(i, j int) bool { return len(hs.entries[i].prefix) > len(hs.entries[j].prefix) })
	return nil
}

// Handle registers h for prefix and panics when Add would return an error,
// like river.AddWorker and http.ServeMux.Handle: registration is start-up
// code, and a mistake there is a programming error.
func (hs *Handlers) Handle(prefix string, h Handler) {
	if err := hs.Add(prefix, h); err != nil {
		panic(err)
	}
}

// HandleFunc registers fn for prefix (see Handle).
func (hs *Handlers) HandleFunc(prefix string, fn func(ctx context.Context, ev Event) error) {
	hs.Handle(prefix, HandlerFunc(fn))
}

// Lookup returns the handler of the longest prefix matching eventType and
// that prefix.
func (hs *Handlers) Lookup(eventType string) (Handler, string, bool) {
	for _, e := range hs.entries {
		if route.PrefixMatches(e.prefix, eventType) {
			return e.handler, e.prefix, true
		}
	}
	return nil, "", false
}

// Prefixes returns the registered prefixes, longest first.
func (hs *Handlers) Prefixes() []string {
	out := make([]string, len(hs.entries))
	for i, e := range hs.entries {
		out[i] = e.prefix
	}
	return out
}

// NoHandlerError is the error a Worker returns for a job whose event type
// no handler matches. River retries the job with its backoff, so deploying
// a receiver that handles the type lets the retry succeed.
type NoHandlerError struct {
	EventID   int64
	EventType string
	Queue     string
}

func (e *NoHandlerError) Error() string {
	return fmt.Sprintf("outboxriver: no handler for event type %s (event %d, queue %s): register one with Handlers.Handle, or stop routing the type to this queue",
		e.EventType, e.EventID, e.Queue)
}

// ErrNoHandler matches every *NoHandlerError with errors.Is.
var ErrNoHandler = errors.New("outboxriver: no handler for event type")

// Is makes errors.Is(err, ErrNoHandler) true.
func (e *NoHandlerError) Is(target error) bool { return target == ErrNoHandler }

// WorkerOptions configure NewWorker.
type WorkerOptions struct {
	// Alerter is told about jobs that no handler matches. nil means
	// alert.Log with Logger.
	Alerter alert.Alerter
	// Logger logs handler failures at debug level (River logs them too).
	// nil means slog.Default().
	Logger *slog.Logger
	// TracerProvider makes the span each job's handler runs in. nil means
	// the global one (otel.GetTracerProvider), which does nothing until the
	// program sets one.
	TracerProvider trace.TracerProvider
}

// TracerName is the name of the OpenTelemetry tracer of Worker's spans.
const TracerName = "github.com/outboxhq/outbox/river"

// Worker is the River worker for kind "outbox_event": it hands each job's
// event to the handler of the longest matching prefix. Add it to a
// river.Workers with river.AddWorker.
//
// A job whose event type no handler matches fails with a *NoHandlerError
// (River retries it) and raises an alert.NoHandler alert on its first
// attempt and on its last, so a missing handler is neither silent nor
// dropped.
//
// Each job runs in a span named "outbox.handle" (kind consumer) that
// continues the producer's trace: its parent is the span in ctx when that
// span is in the producer's trace (River's OpenTelemetry middleware after
// TraceMiddleware), else the producer's span context from the job's
// metadata, with a link to the span in ctx if there is one. A job without
// a trace context gets a span under whatever ctx holds (or a new trace).
type Worker struct {
	river.WorkerDefaults[EventArgs]
	handlers *Handlers
	alerter  alert.Alerter
	tracer   trace.Tracer
}

// NewWorker returns a Worker dispatching to handlers.
func NewWorker(handlers *Handlers, opts WorkerOptions) *Worker {
	if handlers == nil {
		handlers = NewHandlers()
	}
	logger := opts.Logger
	if logger == nil {
		logger = slog.Default()
	}
	alerter := opts.Alerter
	if alerter == nil {
		alerter = alert.Log{Logger: logger}
	}
	tp := opts.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return &Worker{handlers: handlers, alerter: alerter, tracer: tp.Tracer(TracerName)}
}

// Work implements river.Worker.
func (w *Worker) Work(ctx context.Context, job *river.Job[EventArgs]) (err error) {
	ev := EventFromJob(job)
	h, prefix, ok := w.handlers.Lookup(ev.Type)
	ctx, span := w.startSpan(ctx, job, ev)
	defer func() {
		if ok {
			span.SetAttributes(attribute.String("outbox.handler_prefix", prefix))
		}
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()
	if !ok {
		err := &NoHandlerError{EventID: ev.ID, EventType: ev.Type, Queue: job.Queue}
		if job.Attempt <= 1 || job.Attempt >= job.MaxAttempts {
			msg := fmt.Sprintf("no handler for event type %s in queue %s (job %d, attempt %d of %d)", ev.Type, job.Queue, job.ID, job.Attempt, job.MaxAttempts)
			if job.Attempt >= job.MaxAttempts {
				msg += "; River discards the job now"
			} else {
				msg += "; River retries it"
			}
			w.alerter.Alert(ctx, alert.Alert{
				Reason:    alert.NoHandler,
				Message:   msg,
				EventID:   ev.ID,
				EventType: ev.Type,
				TenantID:  ev.TenantID,
				Retries:   job.Attempt - 1,
				Err:       err.Error(),
			})
		}
		return err
	}
	return h.HandleEvent(ctx, ev)
}

// startSpan starts the span of one job (see Worker).
func (w *Worker) startSpan(ctx context.Context, job *river.Job[EventArgs], ev Event) (context.Context, trace.Span) {
	opts := []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.Int64("outbox.event_id", ev.ID),
			attribute.String("outbox.event_type", ev.Type),
			attribute.Int64("river.job_id", job.ID),
			attribute.String("river.queue", job.Queue),
			attribute.Int("river.attempt", job.Attempt),
		),
	}
	if ev.TenantID != "" {
		opts = append(opts, trace.WithAttributes(attribute.String("outbox.tenant_id", ev.TenantID)))
	}
	if producer := ProducerSpanContext(job.JobRow); producer.IsValid() {
		current := trace.SpanContextFromContext(ctx)
		if current.TraceID() != producer.TraceID() {
			if current.IsValid() {
				opts = append(opts, trace.WithLinks(trace.Link{SpanContext: current}))
			}
			ctx = trace.ContextWithRemoteSpanContext(ctx, producer)
		}
	}
	return w.tracer.Start(ctx, "outbox.handle", opts...)
}
