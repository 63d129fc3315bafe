package outboxriver

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The keys of the producer's W3C trace context in a handed-off job's
// metadata (present only when the event has one: outbox.Publish stores the
// trace context of its ctx). They are the keys River's OpenTelemetry
// middleware (github.com/riverqueue/rivercontrib/otelriver, with
// EnableTracePropagation) reads and writes, so its work span links to the
// producer's span, and River UI shows them.
const (
	// MetadataTraceParent is the W3C traceparent header value, a string
	// such as "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".
	MetadataTraceParent = "traceparent"
	// MetadataTraceState is the W3C tracestate header value, a string;
	// absent when the producer's trace had none.
	MetadataTraceState = "tracestate"
)

// splitTraceContext splits a stored trace context (the traceparent,
// optionally followed by one space and the tracestate) into its two header
// values.
func splitTraceContext(tc string) (traceparent, tracestate string) {
	traceparent, tracestate, _ = strings.Cut(tc, " ")
	return traceparent, tracestate
}

// traceMetadata is the part of the job metadata that TraceMiddleware reads.
type traceMetadata struct {
	TraceParent string `json:"traceparent"`
	TraceState  string `json:"tracestate"`
}

// ProducerSpanContext returns the span context of the producer that
// published the event a job was handed off for, read from the job's
// metadata (MetadataTraceParent, MetadataTraceState), as a remote span
// context. It is not valid (IsValid false) for a job without one: an event
// published without a trace, a job not handed off by the outbox, or a
// malformed value.
func ProducerSpanContext(row *rivertype.JobRow) trace.SpanContext {
	if row == nil || !bytes.Contains(row.Metadata, []byte(`"`+MetadataTraceParent+`"`)) {
		return trace.SpanContext{}
	}
	var m traceMetadata
	if err := json.Unmarshal(row.Metadata, &m); err != nil || m.TraceParent == "" {
		return trace.SpanContext{}
	}
	carrier := propagation.MapCarrier{MetadataTraceParent: m.TraceParent}
	if m.TraceState != "" {
		carrier[MetadataTraceState] = m.TraceState
	}
	// The W3C propagator, whatever the global one is: the metadata holds
	// W3C headers.
	return trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), carrier))
}

// TraceMiddleware is a River worker middleware that makes the work of a
// job handed off by the outbox continue the producer's trace: when the
// job's metadata carries the producer's trace context and the work's ctx
// holds no span yet, it runs the rest of the chain with the producer's span
// context as the parent (trace.ContextWithRemoteSpanContext). It starts no
// span of its own.
//
// QueuesConfig and WorkerConfig install it. Add River's OpenTelemetry
// middleware (otelriver.NewMiddleware) after it in river.Config.Middleware:
// otelriver's river.work span is then a child of the producer's span, where
// on its own it starts a new trace with only a link to it (the work of a
// job may come long after its insert, so otelriver links rather than
// parents). The spans that a plain river.Worker[T] starts are children of
// river.work, or without otelriver of the producer's span. Worker starts a
// span of its own in either case.
type TraceMiddleware struct {
	river.MiddlewareDefaults
}

// NewTraceMiddleware returns a TraceMiddleware.
func NewTraceMiddleware() *TraceMiddleware { return &TraceMiddleware{} }

// Work implements rivertype.WorkerMiddleware.
func (*TraceMiddleware) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		if sc := ProducerSpanContext(job); sc.IsValid() {
			ctx = trace.ContextWithRemoteSpanContext(ctx, sc)
		}
	}
	return doInner(ctx)
}

var _ rivertype.WorkerMiddleware = (*TraceMiddleware)(nil)
