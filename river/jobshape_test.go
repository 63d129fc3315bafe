package outboxriver_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// SendInvoiceArgs are the args of a service's own River job, the kind its
// workers handled before it adopted the outbox.
type SendInvoiceArgs struct {
	InvoiceID int64  `json:"invoice_id"`
	Email     string `json:"email"`
}

func (SendInvoiceArgs) Kind() string { return "send_invoice_email" }

// invoiceWorker is a plain river.Worker[SendInvoiceArgs]: it knows nothing
// of the outbox. work, when set, replaces the default (record and succeed).
type invoiceWorker struct {
	river.WorkerDefaults[SendInvoiceArgs]
	mu   sync.Mutex
	jobs []*river.Job[SendInvoiceArgs]
	work func(ctx context.Context, job *river.Job[SendInvoiceArgs]) error
}

func (w *invoiceWorker) Work(ctx context.Context, job *river.Job[SendInvoiceArgs]) error {
	w.mu.Lock()
	w.jobs = append(w.jobs, job)
	w.mu.Unlock()
	if w.work != nil {
		return w.work(ctx, job)
	}
	return nil
}

func (w *invoiceWorker) seen() []*river.Job[SendInvoiceArgs] {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.jobs)
}

// claimedEvent reads an event as the dispatcher's claim does.
func claimedEvent(t *testing.T, pool *pgxpool.Pool, id int64) outboxriver.EventArgs {
	t.Helper()
	var a outboxriver.EventArgs
	err := pool.QueryRow(context.Background(),
		`SELECT id, event_type, tenant_id, payload, dispatch_key, created_at FROM outbox_event WHERE id = $1`, id).
		Scan(&a.EventID, &a.EventType, &a.TenantID, &a.Payload, &a.DispatchKey, &a.CreatedAt)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// insertJobs inserts params with an insert-only client (NewInsertClient) in
// one transaction and returns the job ids.
func insertJobs(t *testing.T, pool *pgxpool.Pool, params []river.InsertManyParams) []int64 {
	t.Helper()
	ctx := pgtest.Context(t, 30*time.Second)
	ins, err := outboxriver.NewInsertClient(pool, outboxriver.InsertClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		res, err := ins.InsertManyTx(ctx, tx, params)
		for _, r := range res {
			ids = append(ids, r.Job.ID)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// startPlainClient starts an ordinary River client, configured without
// anything from the outbox, working queues with workers.
func startPlainClient(t *testing.T, pool *pgxpool.Pool, workers *river.Workers, queues ...string) *river.Client[pgx.Tx] {
	t.Helper()
	qs := map[string]river.QueueConfig{}
	for _, q := range queues {
		qs[q] = river.QueueConfig{MaxWorkers: 4}
	}
	return startClient(t, pool, &river.Config{
		Queues:            qs,
		Workers:           workers,
		FetchCooldown:     time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond,
	})
}

func parseRoutes(t *testing.T, doc string) *route.Table {
	t.Helper()
	tbl, err := route.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return tbl
}

// paramsFor builds the jobs of the event with JobParams, as the handoff
// does.
func paramsFor(t *testing.T, pool *pgxpool.Pool, tbl *route.Table, id int64) []river.InsertManyParams {
	t.Helper()
	ev := claimedEvent(t, pool, id)
	rule, ok := tbl.Match(ev.EventType)
	if !ok {
		t.Fatalf("no rule for %s", ev.EventType)
	}
	return outboxriver.JobParams(rule, ev)
}

func jsonEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Fatalf("%s: %v", a, err)
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return reflect.DeepEqual(x, y)
}

// checkMetadata checks the outbox keys of a job's metadata.
func checkMetadata(t *testing.T, raw []byte, want outboxriver.EventArgs, args string) {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	// The shape and the creation time are written only on payload-args
	// jobs: envelope args carry created_at themselves.
	wantArgs := any(nil)
	if args == "payload" {
		wantArgs = args
	}
	if m[outboxriver.MetadataEventID] != float64(want.EventID) || m[outboxriver.MetadataEventType] != want.EventType || m[outboxriver.MetadataArgs] != wantArgs {
		t.Errorf("metadata %s does not name event %d (%s, %s args)", raw, want.EventID, want.EventType, args)
	}
	tenant, hasTenant := m[outboxriver.MetadataTenantID]
	if (want.TenantID == nil) == hasTenant || (hasTenant && tenant != *want.TenantID) {
		t.Errorf("metadata %s: tenant %v, want %v", raw, tenant, want.TenantID)
	}
	key, hasKey := m[outboxriver.MetadataDispatchKey]
	if (want.DispatchKey == nil) == hasKey || (hasKey && key != *want.DispatchKey) {
		t.Errorf("metadata %s: dispatch key %v, want %v", raw, key, want.DispatchKey)
	}
	created, hasCreated := m[outboxriver.MetadataCreatedAt].(string)
	if hasCreated != (args == "payload") {
		t.Errorf("metadata %s: created_at present %v, want it on payload-args jobs only", raw, hasCreated)
	}
	if at, _ := time.Parse(time.RFC3339Nano, created); hasCreated && !at.Equal(want.CreatedAt) {
		t.Errorf("metadata %s: created_at %v, want %v", raw, at, want.CreatedAt)
	}
	wantParent, wantState, _ := strings.Cut(want.TraceContext, " ")
	parent, hasParent := m[outboxriver.MetadataTraceParent]
	state, hasState := m[outboxriver.MetadataTraceState]
	if (wantParent != "") != hasParent || (hasParent && parent != wantParent) || (wantState != "") != hasState || (hasState && state != wantState) {
		t.Errorf("metadata %s: traceparent %v, tracestate %v, want the trace context %q", raw, parent, state, want.TraceContext)
	}
}

// The handoff writes the event's trace context into every job's metadata
// under the W3C keys, and never into the args.
func TestJobParamsCarryTheTraceContext(t *testing.T) {
	t.Parallel()
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	rule := parseRoutes(t, nativeRoutes)
	for _, tc := range []string{tp, tp + " rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"} {
		for _, typ := range []string{"billing.invoice.paid", "billing.invoice.voided"} {
			ev := outboxriver.EventArgs{EventID: 5, EventType: typ, Payload: json.RawMessage(`{"a":1}`), CreatedAt: time.Unix(1700000000, 0).UTC(), TraceContext: tc}
			r, ok := rule.Match(typ)
			if !ok {
				t.Fatal(typ)
			}
			for _, p := range outboxriver.JobParams(r, ev) {
				shape := "envelope"
				if typ == "billing.invoice.paid" {
					shape = "payload"
				}
				checkMetadata(t, p.InsertOpts.Metadata, ev, shape)
				args, err := json.Marshal(p.Args)
				if err != nil {
					t.Fatal(err)
				}
				if strings.Contains(string(args), "00f067aa0ba902b7") {
					t.Errorf("%s: the trace context is in the args %s", typ, args)
				}
				if sc := outboxriver.ProducerSpanContext(&rivertype.JobRow{Metadata: p.InsertOpts.Metadata}); sc.SpanID().String() != "00f067aa0ba902b7" {
					t.Errorf("%s: ProducerSpanContext of the metadata = %+v", typ, sc)
				}
			}
		}
	}
}

func checkEvent(t *testing.T, ev outboxriver.Event, want outboxriver.EventArgs) {
	t.Helper()
	deref := func(p *string) string {
		if p == nil {
			return ""
		}
		return *p
	}
	if ev.ID != want.EventID || ev.Type != want.EventType || ev.TenantID != deref(want.TenantID) ||
		ev.DispatchKey != deref(want.DispatchKey) || !ev.CreatedAt.Equal(want.CreatedAt) || !jsonEqual(t, ev.Payload, want.Payload) {
		t.Errorf("event from metadata = %+v, want %+v", ev, want)
	}
}

const nativeRoutes = `
routes:
  - prefix: "billing.invoice.paid"
    queue: mail
    kind: send_invoice_email
    args: payload
    priority: 2
    max_attempts: 10
    tags: [billing, invoice-mail]
  - prefix: "billing."
    queue: outbox_billing
    priority: 3
    tags: [billing]
`

// A payload-args route hands the event's payload to a plain
// river.Worker[SendInvoiceArgs] under its own kind, priority, attempts and
// tags, with the event in the job's metadata; an envelope route with a
// shape keeps outbox_event and EventArgs.
func TestJobParamsPlainWorkerGetsPayloadArgs(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	tbl := parseRoutes(t, nativeRoutes)
	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "billing.invoice.paid", TenantID: "acme", DispatchKey: "stripe:evt_1", Payload: json.RawMessage(`{"invoice_id": 7, "email": "ada@example.com", "extra": [1]}`)},
		outbox.Event{Type: "billing.invoice.voided", Payload: json.RawMessage(`{"invoice_id": 8}`)},
	)
	paid, voided := claimedEvent(t, s.Pool, ids[0]), claimedEvent(t, s.Pool, ids[1])
	params := append(paramsFor(t, s.Pool, tbl, ids[0]), paramsFor(t, s.Pool, tbl, ids[1])...)
	if len(params) != 2 {
		t.Fatalf("%d params, want 2", len(params))
	}
	jobIDs := insertJobs(t, s.Pool, params)

	w := &invoiceWorker{}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client := startPlainClient(t, s.Pool, workers, "mail")
	pgtest.WaitFor(t, 30*time.Second, "the invoice worker", func() bool { return len(w.seen()) == 1 })

	job := w.seen()[0]
	if job.ID != jobIDs[0] || job.Args != (SendInvoiceArgs{InvoiceID: 7, Email: "ada@example.com"}) {
		t.Errorf("job %d args = %+v", job.ID, job.Args)
	}
	if job.Kind != "send_invoice_email" || job.Queue != "mail" || job.Priority != 2 || job.MaxAttempts != 10 || !slices.Equal(job.Tags, []string{"billing", "invoice-mail"}) {
		t.Errorf("job shape: kind %s queue %s priority %d max_attempts %d tags %v", job.Kind, job.Queue, job.Priority, job.MaxAttempts, job.Tags)
	}
	if !jsonEqual(t, job.EncodedArgs, paid.Payload) {
		t.Errorf("args %s are not the payload %s verbatim", job.EncodedArgs, paid.Payload)
	}
	checkMetadata(t, job.Metadata, paid, "payload")
	ev, ok := outboxriver.JobEvent(job)
	if !ok {
		t.Fatal("JobEvent found no event")
	}
	checkEvent(t, ev, paid)
	if ev.JobID != job.ID || ev.Queue != "mail" || ev.Attempt != 1 {
		t.Errorf("event job fields = %d %s %d", ev.JobID, ev.Queue, ev.Attempt)
	}

	// The envelope job: kind outbox_event, EventArgs, the route's shape.
	row, err := client.JobGet(context.Background(), jobIDs[1])
	if err != nil {
		t.Fatal(err)
	}
	var args outboxriver.EventArgs
	if err := json.Unmarshal(row.EncodedArgs, &args); err != nil {
		t.Fatal(err)
	}
	if row.Kind != outboxriver.Kind || row.Queue != "outbox_billing" || row.Priority != 3 || row.MaxAttempts != 25 || !slices.Equal(row.Tags, []string{"billing"}) {
		t.Errorf("envelope job shape: kind %s queue %s priority %d max_attempts %d tags %v", row.Kind, row.Queue, row.Priority, row.MaxAttempts, row.Tags)
	}
	if args.EventID != voided.EventID || args.EventType != voided.EventType || args.TenantID != nil || !jsonEqual(t, args.Payload, voided.Payload) {
		t.Errorf("envelope args = %+v", args)
	}
	checkMetadata(t, row.Metadata, voided, "envelope")
	ev, ok = outboxriver.EventFromMetadata(row)
	if !ok {
		t.Fatal("EventFromMetadata found no event")
	}
	checkEvent(t, ev, voided)
}

// One rule fans out to an envelope job for the outbox's own Worker and a
// payload job for a plain worker; both name the event.
func TestJobParamsFanOutMixesEnvelopeAndPayload(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	tbl := parseRoutes(t, `
routes:
  - prefix: "billing.invoice."
    jobs:
      - queue: outbox_audit
      - queue: mail
        kind: send_invoice_email
        args: payload
        priority: 4
        tags: [invoice]
      - queue: outbox_ledger
        kind: ledger_entry
        max_attempts: 3
`)
	ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "billing.invoice.paid", TenantID: "acme", Payload: json.RawMessage(`{"invoice_id": 9, "email": "bob@example.com"}`)})
	want := claimedEvent(t, s.Pool, ids[0])
	params := paramsFor(t, s.Pool, tbl, ids[0])
	if len(params) != 3 || params[0].Args.Kind() != outboxriver.Kind || params[1].Args.Kind() != "send_invoice_email" || params[2].Args.Kind() != "ledger_entry" {
		t.Fatalf("params = %+v", params)
	}
	jobIDs := insertJobs(t, s.Pool, params)

	var (
		mu      sync.Mutex
		audited []outboxriver.Event
	)
	handlers := outboxriver.NewHandlers()
	handlers.HandleFunc("billing.", func(_ context.Context, ev outboxriver.Event) error {
		mu.Lock()
		defer mu.Unlock()
		audited = append(audited, ev)
		return nil
	})
	w := &invoiceWorker{}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	river.AddWorker(workers, outboxriver.NewWorker(handlers, outboxriver.WorkerOptions{Logger: quiet}))
	client := startPlainClient(t, s.Pool, workers, "mail", "outbox_audit")
	pgtest.WaitFor(t, 30*time.Second, "both jobs worked", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(w.seen()) == 1 && len(audited) == 1
	})

	job := w.seen()[0]
	if job.Args != (SendInvoiceArgs{InvoiceID: 9, Email: "bob@example.com"}) || job.Priority != 4 || !slices.Equal(job.Tags, []string{"invoice"}) {
		t.Errorf("payload job = %+v priority %d tags %v", job.Args, job.Priority, job.Tags)
	}
	checkMetadata(t, job.Metadata, want, "payload")
	mu.Lock()
	env := audited[0]
	mu.Unlock()
	checkEvent(t, env, want)
	if env.Queue != "outbox_audit" {
		t.Errorf("envelope job queue %s", env.Queue)
	}
	ev, _ := outboxriver.JobEvent(job)
	checkEvent(t, ev, want)

	// The envelope under a kind of its own: EventArgs' JSON, the route's
	// kind and attempts (no worker here: it stays available).
	row, err := client.JobGet(context.Background(), jobIDs[2])
	if err != nil {
		t.Fatal(err)
	}
	var args outboxriver.EventArgs
	if err := json.Unmarshal(row.EncodedArgs, &args); err != nil {
		t.Fatal(err)
	}
	if row.Kind != "ledger_entry" || row.Queue != "outbox_ledger" || row.MaxAttempts != 3 || args.EventID != want.EventID || args.EventType != want.EventType || !jsonEqual(t, args.Payload, want.Payload) {
		t.Errorf("kinded envelope job: kind %s queue %s max_attempts %d args %+v", row.Kind, row.Queue, row.MaxAttempts, args)
	}
	checkMetadata(t, row.Metadata, want, "envelope")
}

// A plain worker makes its effect idempotent with the event id from the
// job's metadata: a second job for the same event (a duplicate delivery)
// finds the receipt, and a job that did not come from the outbox is
// refused.
func TestWithIdempotencyJobSuppressesDuplicateDelivery(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	if _, err := s.Pool.Exec(ctx, `CREATE TABLE invoice_mail (event_id bigint NOT NULL, invoice_id bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	tbl := parseRoutes(t, nativeRoutes)
	ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "billing.invoice.paid", Payload: json.RawMessage(`{"invoice_id": 11, "email": "cy@example.com"}`)})

	type outcome struct {
		jobID     int64
		duplicate bool
		err       error
	}
	var (
		mu       sync.Mutex
		outcomes []outcome
	)
	mailer := outboxriver.Receiver{Name: "invoice-mailer"}
	w := &invoiceWorker{work: func(ctx context.Context, job *river.Job[SendInvoiceArgs]) error {
		var dup bool
		err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			var err error
			dup, err = outboxriver.WithIdempotencyJob(ctx, tx, mailer, job, func(ctx context.Context, tx pgx.Tx) error {
				ev, _ := outboxriver.JobEvent(job)
				_, err := tx.Exec(ctx, `INSERT INTO invoice_mail VALUES ($1, $2)`, ev.ID, job.Args.InvoiceID)
				return err
			})
			return err
		})
		mu.Lock()
		outcomes = append(outcomes, outcome{job.ID, dup, err})
		mu.Unlock()
		if err != nil {
			return river.JobCancel(err)
		}
		return nil
	}}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client := startPlainClient(t, s.Pool, workers, "mail")

	first := insertJobs(t, s.Pool, paramsFor(t, s.Pool, tbl, ids[0]))
	pgtest.WaitFor(t, 30*time.Second, "the first delivery", func() bool { mu.Lock(); defer mu.Unlock(); return len(outcomes) == 1 })
	second := insertJobs(t, s.Pool, paramsFor(t, s.Pool, tbl, ids[0]))
	pgtest.WaitFor(t, 30*time.Second, "the duplicate delivery", func() bool { mu.Lock(); defer mu.Unlock(); return len(outcomes) == 2 })
	foreign, err := client.Insert(ctx, SendInvoiceArgs{InvoiceID: 12}, &river.InsertOpts{Queue: "mail"})
	if err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, 30*time.Second, "the job from outside the outbox", func() bool { mu.Lock(); defer mu.Unlock(); return len(outcomes) == 3 })

	mu.Lock()
	got := slices.Clone(outcomes)
	mu.Unlock()
	if got[0] != (outcome{first[0], false, nil}) || got[1] != (outcome{second[0], true, nil}) {
		t.Errorf("deliveries = %+v, want the first applied and the second a duplicate", got[:2])
	}
	if got[2].jobID != foreign.Job.ID || !errors.Is(got[2].err, outboxriver.ErrNoOutboxEvent) {
		t.Errorf("foreign job: %+v, want ErrNoOutboxEvent", got[2])
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM invoice_mail WHERE event_id = $1 AND invoice_id = 11`, ids[0]); n != 1 {
		t.Errorf("effect applied %d times, want once", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM invoice_mail`); n != 1 {
		t.Errorf("%d effects in all, want 1", n)
	}
	pgtest.WaitFor(t, 30*time.Second, "both outbox jobs completed", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = ANY($1) AND state = 'completed'`, []int64{first[0], second[0]}) == 2
	})
}

// docs/routes.md documents every metadata key.
func TestMetadataKeysDocumented(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile("../docs/routes.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{outboxriver.MetadataEventID, outboxriver.MetadataEventType, outboxriver.MetadataTenantID,
		outboxriver.MetadataDispatchKey, outboxriver.MetadataCreatedAt, outboxriver.MetadataArgs,
		outboxriver.MetadataTraceParent, outboxriver.MetadataTraceState} {
		if !strings.Contains(string(data), "| `"+k+"` |") {
			t.Errorf("docs/routes.md does not document metadata key %s", k)
		}
	}
}

// A rule built in code without Jobs (not through route.New) gets envelope
// jobs of kind outbox_event, one per queue, with the metadata.
func TestJobParamsDefaultsWithoutJobs(t *testing.T) {
	t.Parallel()
	tenant := "acme"
	ev := outboxriver.EventArgs{EventID: 5, EventType: "mail.user.welcome", TenantID: &tenant, Payload: json.RawMessage(`{"a":1}`), CreatedAt: time.Unix(1700000000, 0).UTC()}
	params := outboxriver.JobParams(route.Rule{Prefix: "mail.", Queues: []string{"outbox_mail", "outbox_audit"}}, ev)
	if len(params) != 2 {
		t.Fatalf("%d params", len(params))
	}
	for i, q := range []string{"outbox_mail", "outbox_audit"} {
		p := params[i]
		if !reflect.DeepEqual(p.Args, ev) || p.InsertOpts.Queue != q || p.InsertOpts.Priority != 0 || p.InsertOpts.MaxAttempts != 0 || p.InsertOpts.Tags != nil {
			t.Errorf("param %d = %+v %+v", i, p.Args, p.InsertOpts)
		}
		checkMetadata(t, p.InsertOpts.Metadata, ev, "envelope")
	}
}
