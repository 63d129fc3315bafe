package outboxriver_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/riverqueue/rivercontrib/otelriver"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// newTracer returns a tracer provider that exports every ended span to an
// in-memory exporter at once.
func newTracer(t *testing.T) (*sdktrace.TracerProvider, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp, exp
}

// waitSpan waits until the exporter holds an ended span named name and
// returns it.
func waitSpan(t *testing.T, exp *tracetest.InMemoryExporter, name string) tracetest.SpanStub {
	t.Helper()
	var found tracetest.SpanStub
	pgtest.WaitFor(t, 60*time.Second, "span "+name, func() bool {
		for _, s := range exp.GetSpans() {
			if s.Name == name {
				found = s
				return true
			}
		}
		return false
	})
	return found
}

// startDispatcher runs the real dispatcher (the one outboxd runs) on pool
// until the test ends.
func startDispatcher(t *testing.T, pool *pgxpool.Pool, routes *route.Table) {
	t.Helper()
	d, err := dispatcher.New(pool, dispatcher.Config{Routes: routes, Logger: quiet, PollInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop dispatcher: %v", err)
		}
	})
}

// publishTraced publishes events in a producer span of tp and returns the
// span's context.
func publishTraced(t *testing.T, pool *pgxpool.Pool, tp trace.TracerProvider, events ...outbox.Event) trace.SpanContext {
	t.Helper()
	ctx, span := tp.Tracer("producer").Start(pgtest.Context(t, 30*time.Second), "produce")
	defer span.End()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := outbox.PublishMany(ctx, tx, events)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return span.SpanContext()
}

func otelMiddleware(tp trace.TracerProvider) *otelriver.Middleware {
	return otelriver.NewMiddleware(&otelriver.MiddlewareConfig{TracerProvider: tp, EnableTracePropagation: true})
}

func attr(s tracetest.SpanStub, key string) attribute.Value {
	for _, kv := range s.Attributes {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// TestWorkerSpanContinuesTheProducersTrace: an event published in a
// producer span goes through the real dispatcher to an outboxriver.Worker,
// whose handler runs in an "outbox.handle" span of the producer's trace:
// the producer's span is its parent, or, with River's OpenTelemetry
// middleware after TraceMiddleware (QueuesConfig's), otelriver's
// river.work span, itself the producer span's child. With otelriver alone
// (no TraceMiddleware) river.work starts a new trace and the handler's
// span still continues the producer's, linking to river.work. An event
// published without a span gets a span of a trace of its own.
func TestWorkerSpanContinuesTheProducersTrace(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"Worker alone", "otelriver after TraceMiddleware", "otelriver alone"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			tp, exp := newTracer(t)
			handled := make(chan trace.SpanContext, 2)
			handlers := outboxriver.NewHandlers()
			handlers.HandleFunc("mail.", func(ctx context.Context, ev outboxriver.Event) error {
				handled <- trace.SpanContextFromContext(ctx)
				return nil
			})
			workers := river.NewWorkers()
			river.AddWorker(workers, outboxriver.NewWorker(handlers, outboxriver.WorkerOptions{Logger: quiet, TracerProvider: tp}))
			cfg := outboxriver.QueuesConfig(workers, []outboxriver.Queue{{Name: "outbox_mail"}}, outboxriver.WorkerLatency{})
			switch mode {
			case "otelriver after TraceMiddleware":
				cfg.Middleware = append(cfg.Middleware, otelMiddleware(tp))
			case "otelriver alone":
				cfg.Middleware = []rivertype.Middleware{otelMiddleware(tp)}
			}
			startClient(t, s.Pool, cfg)
			startDispatcher(t, s.Pool, testRoutes(t))

			producer := publishTraced(t, s.Pool, tp, outbox.Event{Type: "mail.user.welcome", TenantID: "acme"})
			var inHandler trace.SpanContext
			select {
			case inHandler = <-handled:
			case <-time.After(60 * time.Second):
				t.Fatal("the handler did not run within 60 s")
			}
			handle := waitSpan(t, exp, "outbox.handle")
			if handle.SpanContext.TraceID() != producer.TraceID() || inHandler.TraceID() != producer.TraceID() {
				t.Fatalf("handler span in trace %s (ctx %s), want the producer's %s", handle.SpanContext.TraceID(), inHandler.TraceID(), producer.TraceID())
			}
			if inHandler.SpanID() != handle.SpanContext.SpanID() {
				t.Errorf("the handler's ctx holds span %s, not outbox.handle %s", inHandler.SpanID(), handle.SpanContext.SpanID())
			}
			if handle.SpanKind != trace.SpanKindConsumer || attr(handle, "outbox.event_type").AsString() != "mail.user.welcome" ||
				attr(handle, "outbox.tenant_id").AsString() != "acme" || attr(handle, "outbox.handler_prefix").AsString() != "mail." ||
				attr(handle, "river.queue").AsString() != "outbox_mail" || attr(handle, "outbox.event_id").AsInt64() == 0 {
				t.Errorf("outbox.handle: kind %s, attributes %v", handle.SpanKind, handle.Attributes)
			}
			switch mode {
			case "otelriver after TraceMiddleware":
				work := waitSpan(t, exp, "river.work")
				if work.Parent.SpanID() != producer.SpanID() || work.SpanContext.TraceID() != producer.TraceID() {
					t.Errorf("river.work parent %s in trace %s, want the producer span %s", work.Parent.SpanID(), work.SpanContext.TraceID(), producer.SpanID())
				}
				if handle.Parent.SpanID() != work.SpanContext.SpanID() {
					t.Errorf("outbox.handle parent %s, want river.work %s", handle.Parent.SpanID(), work.SpanContext.SpanID())
				}
			case "otelriver alone":
				work := waitSpan(t, exp, "river.work")
				if work.SpanContext.TraceID() == producer.TraceID() {
					t.Errorf("river.work continued the producer's trace without TraceMiddleware: otelriver changed, update the docs")
				}
				if handle.Parent.SpanID() != producer.SpanID() || len(handle.Links) != 1 || handle.Links[0].SpanContext.SpanID() != work.SpanContext.SpanID() {
					t.Errorf("outbox.handle parent %s links %v, want the producer span %s and a link to river.work %s", handle.Parent.SpanID(), handle.Links, producer.SpanID(), work.SpanContext.SpanID())
				}
			default:
				if handle.Parent.SpanID() != producer.SpanID() || !handle.Parent.IsRemote() {
					t.Errorf("outbox.handle parent %s (remote %v), want the producer span %s", handle.Parent.SpanID(), handle.Parent.IsRemote(), producer.SpanID())
				}
			}

			// Without a producer span: a trace of its own.
			exp.Reset()
			publishTraced(t, s.Pool, noop.NewTracerProvider(), outbox.Event{Type: "mail.user.welcome"})
			select {
			case <-handled:
			case <-time.After(60 * time.Second):
				t.Fatal("the handler did not run within 60 s")
			}
			handle = waitSpan(t, exp, "outbox.handle")
			if handle.SpanContext.TraceID() == producer.TraceID() || (mode == "Worker alone" && handle.Parent.IsValid()) {
				t.Errorf("untraced event: outbox.handle in trace %s with parent %s", handle.SpanContext.TraceID(), handle.Parent.SpanID())
			}
		})
	}
}

// TestPlainWorkerContinuesTheProducersTrace: a payload-args route hands an
// event to a plain river.Worker[SendInvoiceArgs]. With River's
// OpenTelemetry middleware after TraceMiddleware, the worker runs in
// otelriver's river.work span, a child of the producer's span; with
// TraceMiddleware alone, its ctx carries the producer's span context, so
// the spans it starts are the producer span's children.
func TestPlainWorkerContinuesTheProducersTrace(t *testing.T) {
	t.Parallel()
	for _, withOtel := range []bool{true, false} {
		t.Run(fmt.Sprintf("otelriver=%v", withOtel), func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			tp, exp := newTracer(t)
			seen := make(chan trace.SpanContext, 1)
			w := &invoiceWorker{work: func(ctx context.Context, job *river.Job[SendInvoiceArgs]) error {
				seen <- trace.SpanContextFromContext(ctx)
				return nil
			}}
			workers := river.NewWorkers()
			river.AddWorker(workers, w)
			cfg := outboxriver.QueuesConfig(workers, []outboxriver.Queue{{Name: "mail"}}, outboxriver.WorkerLatency{})
			if withOtel {
				cfg.Middleware = append(cfg.Middleware, otelMiddleware(tp))
			}
			startClient(t, s.Pool, cfg)
			startDispatcher(t, s.Pool, parseRoutes(t, nativeRoutes))

			producer := publishTraced(t, s.Pool, tp, outbox.Event{Type: "billing.invoice.paid", Payload: json.RawMessage(`{"invoice_id": 7}`)})
			var inWorker trace.SpanContext
			select {
			case inWorker = <-seen:
			case <-time.After(60 * time.Second):
				t.Fatal("the plain worker did not run within 60 s")
			}
			if inWorker.TraceID() != producer.TraceID() {
				t.Fatalf("the worker's ctx is in trace %s, want the producer's %s", inWorker.TraceID(), producer.TraceID())
			}
			if !withOtel {
				if inWorker.SpanID() != producer.SpanID() || !inWorker.IsRemote() {
					t.Errorf("the worker's ctx holds span %s (remote %v), want the producer's %s", inWorker.SpanID(), inWorker.IsRemote(), producer.SpanID())
				}
				return
			}
			work := waitSpan(t, exp, "river.work")
			if work.Parent.SpanID() != producer.SpanID() || inWorker.SpanID() != work.SpanContext.SpanID() {
				t.Errorf("river.work %s has parent %s and the worker's ctx holds %s; want parent %s and the worker inside river.work",
					work.SpanContext.SpanID(), work.Parent.SpanID(), inWorker.SpanID(), producer.SpanID())
			}
			if len(work.Links) != 1 || work.Links[0].SpanContext.SpanID() != producer.SpanID() {
				t.Errorf("river.work links %v, want one to the producer span (otelriver's EnableTracePropagation reads the metadata)", work.Links)
			}
		})
	}
}

// TestProducerSpanContext reads the trace context from job metadata and
// refuses what is not one.
func TestProducerSpanContext(t *testing.T) {
	t.Parallel()
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	sc := outboxriver.ProducerSpanContext(&rivertype.JobRow{Metadata: []byte(`{"outbox_event_id": 1, "traceparent": "` + tp + `", "tracestate": "rojo=1"}`)})
	if !sc.IsValid() || !sc.IsRemote() || sc.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || sc.SpanID().String() != "00f067aa0ba902b7" || !sc.IsSampled() || sc.TraceState().Get("rojo") != "1" {
		t.Errorf("span context %+v", sc)
	}
	for _, meta := range []string{``, `{}`, `{"traceparent": 5}`, `{"traceparent": "garbage"}`, `not json "traceparent"`,
		`{"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}`} {
		if sc := outboxriver.ProducerSpanContext(&rivertype.JobRow{Metadata: []byte(meta)}); sc.IsValid() {
			t.Errorf("metadata %s: a valid span context %+v", meta, sc)
		}
	}
	if outboxriver.ProducerSpanContext(nil).IsValid() {
		t.Error("nil row: a valid span context")
	}
}
