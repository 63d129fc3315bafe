package dispatcher_test

import (
	"context"
	"encoding/json"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// SendInvoiceArgs and sendInvoiceWorker are the "before" of the worked
// migration in docs/routes.md: a service's own River job and its plain
// worker, which know nothing of the outbox.
type SendInvoiceArgs struct {
	InvoiceID int64  `json:"invoice_id"`
	Email     string `json:"email"`
}

func (SendInvoiceArgs) Kind() string { return "send_invoice_email" }

type sendInvoiceWorker struct {
	river.WorkerDefaults[SendInvoiceArgs]
	mu   sync.Mutex
	jobs []*river.Job[SendInvoiceArgs]
}

func (w *sendInvoiceWorker) Work(_ context.Context, job *river.Job[SendInvoiceArgs]) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.jobs = append(w.jobs, job)
	return nil
}

func (w *sendInvoiceWorker) seen() []*river.Job[SendInvoiceArgs] {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.jobs)
}

// TestWorkedMigrationOfDirectRiverInserts runs the worked migration of
// docs/routes.md end to end: the route of the doc, outbox.Publish in the
// business transaction, the real dispatcher, and the service's unchanged
// River client and worker, which receive the payload as their own args with
// the route's kind, priority, max attempts and tags, and the event in the
// job's metadata. A fan-out rule beside it sends one envelope job and one
// payload job for the same event.
func TestWorkedMigrationOfDirectRiverInserts(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)

	routes, err := route.Parse([]byte(`routes:
  - prefix: "billing.invoice.paid"
    queue: mail
    kind: send_invoice_email
    args: payload
    priority: 2
    max_attempts: 10
    tags: [billing]
  - prefix: "billing.invoice.refunded"
    jobs:
      - queue: outbox_audit
      - queue: mail
        kind: send_invoice_email
        args: payload
`))
	if err != nil {
		t.Fatal(err)
	}
	start(t, s.Pool, dispatcher.Config{Routes: routes, PollInterval: time.Minute})

	// The service's River client, as it was before the outbox: it knows
	// only its own worker. The audit queue is worked by nobody here.
	workers := river.NewWorkers()
	w := &sendInvoiceWorker{}
	river.AddWorker(workers, w)
	client, err := river.NewClient(riverpgxv5.New(s.Pool), &river.Config{
		Queues:            map[string]river.QueueConfig{"mail": {MaxWorkers: 2}},
		Workers:           workers,
		FetchCooldown:     5 * time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = client.Stop(sctx)
	})

	// After: the handler publishes the fact in its own transaction.
	var paid, refunded outbox.Published
	err = pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		payload, _ := json.Marshal(SendInvoiceArgs{InvoiceID: 42, Email: "a@example.com"})
		var err error
		if paid, err = outbox.Publish(ctx, tx, outbox.Event{Type: "billing.invoice.paid", TenantID: "acme", Payload: payload, DispatchKey: "inv-42-paid"}); err != nil {
			return err
		}
		payload, _ = json.Marshal(SendInvoiceArgs{InvoiceID: 43, Email: "b@example.com"})
		refunded, err = outbox.Publish(ctx, tx, outbox.Event{Type: "billing.invoice.refunded", Payload: payload})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	pgtest.WaitFor(t, 30*time.Second, "both jobs worked by the plain worker", func() bool { return len(w.seen()) == 2 })
	byInvoice := map[int64]*river.Job[SendInvoiceArgs]{}
	for _, j := range w.seen() {
		byInvoice[j.Args.InvoiceID] = j
	}
	job := byInvoice[42]
	if job == nil || job.Args.Email != "a@example.com" {
		t.Fatalf("paid job args: %+v", job)
	}
	if job.Kind != "send_invoice_email" || job.Queue != "mail" || job.Priority != 2 || job.MaxAttempts != 10 || !slices.Equal(job.Tags, []string{"billing"}) {
		t.Errorf("paid job shape: kind %s queue %s priority %d max_attempts %d tags %v", job.Kind, job.Queue, job.Priority, job.MaxAttempts, job.Tags)
	}
	ev, ok := outboxriver.JobEvent(job)
	if !ok || ev.ID != paid.ID || ev.Type != "billing.invoice.paid" || ev.TenantID != "acme" || ev.DispatchKey != "inv-42-paid" {
		t.Errorf("paid job metadata names event %+v (ok %v), want %d", ev, ok, paid.ID)
	}
	if job := byInvoice[43]; job == nil || job.Kind != "send_invoice_email" {
		t.Fatalf("refunded payload job: %+v", job)
	}

	// The fan-out's envelope job waits in outbox_audit; river_job_ids lists
	// both jobs in route order, so explain finds custom kinds too.
	var kinds []string
	err = s.Pool.QueryRow(ctx, `
		SELECT array_agg(j.kind || '@' || j.queue ORDER BY o.ord)
		FROM outbox_event e, unnest(e.river_job_ids) WITH ORDINALITY AS o(job_id, ord)
		JOIN river_job j ON j.id = o.job_id
		WHERE e.id = $1`, refunded.ID).Scan(&kinds)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(kinds, []string{"outbox_event@outbox_audit", "send_invoice_email@mail"}) {
		t.Errorf("fan-out jobs = %v", kinds)
	}
	var envelope outboxriver.EventArgs
	if err := s.Pool.QueryRow(ctx, `SELECT args FROM river_job WHERE queue = 'outbox_audit'`).Scan(&envelope); err != nil {
		t.Fatal(err)
	}
	if envelope.EventID != refunded.ID || envelope.EventType != "billing.invoice.refunded" {
		t.Errorf("envelope args = %+v", envelope)
	}
}
