package outboxriver_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

func ExampleDecode() {
	type Receipt struct {
		InvoiceID   int64 `json:"invoice_id"`
		AmountCents int   `json:"amount_cents"`
	}
	ev := outboxriver.Event{ID: 42, Type: "mail.receipt.requested", Payload: json.RawMessage(`{"invoice_id": 7, "amount_cents": 1200}`)}
	r, err := outboxriver.Decode[Receipt](ev)
	fmt.Println(r.InvoiceID, r.AmountCents, err)

	ev.Payload = json.RawMessage(`{"invoice_id": "seven"}`)
	_, err = outboxriver.Decode[Receipt](ev)
	var de *outboxriver.DecodeError
	fmt.Println(errors.As(err, &de), strings.SplitN(err.Error(), ": ", 3)[2])
	// Output:
	// 7 1200 <nil>
	// true field invoice_id: JSON string cannot be a Go int64
}

func ExampleHandlers() {
	hs := outboxriver.NewHandlers()
	hs.HandleFunc("mail.", func(context.Context, outboxriver.Event) error { return nil })
	hs.HandleFunc("mail.receipt.", func(context.Context, outboxriver.Event) error { return nil })
	hs.HandleFunc("", func(context.Context, outboxriver.Event) error { return nil }) // catch-all

	for _, typ := range []string{"mail.receipt.requested", "mail.welcome.sent", "audit.login.failed"} {
		_, prefix, _ := hs.Lookup(typ)
		fmt.Printf("%s → %q\n", typ, prefix)
	}
	// Output:
	// mail.receipt.requested → "mail.receipt."
	// mail.welcome.sent → "mail."
	// audit.login.failed → ""
}

// A service that embeds the receivers: register handlers, add the outbox
// Worker to River, and work the group's queues.
func ExampleNewWorker() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/app")
	if err != nil {
		panic(err)
	}
	hs := outboxriver.NewHandlers()
	hs.Handle("mail.", outboxriver.Typed(func(ctx context.Context, ev outboxriver.Event, p struct {
		Email string `json:"email"`
	}) error {
		// ... send p.Email a mail, idempotently (see ExampleWithClaim) ...
		return nil
	}))
	workers := river.NewWorkers()
	river.AddWorker(workers, outboxriver.NewWorker(hs, outboxriver.WorkerOptions{}))

	queues := []outboxriver.Queue{{Name: "outbox_mail", MaxWorkers: 20}, {Name: "outbox_webhook"}}
	cfg := outboxriver.QueuesConfig(workers, queues, outboxriver.WorkerLatency{})
	cfg.ID = outboxriver.GroupClientID("mail")
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		panic(err)
	}
	if err := client.Start(ctx); err != nil {
		panic(err)
	}
}

// A same-database effect, exactly once: the ledger row, the receipt and
// the job's completion commit together.
func ExampleWithIdempotency() {
	pool := (*pgxpool.Pool)(nil) // your pool
	ledger := outboxriver.Receiver{Name: "billing.ledger"}

	handler := func(ctx context.Context, ev outboxriver.Event) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = outboxriver.WithIdempotency(ctx, tx, ledger, ev, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, amount_cents) VALUES ($1, ($2::jsonb->>'amount_cents')::int)`, ev.ID, ev.Payload)
			return err
		})
		if err != nil {
			return err
		}
		return tx.Commit(ctx) // the last step: this commit completes the job
	}
	_ = outboxriver.HandlerFunc(handler)
}

// An external effect: claimed before the call, released if it fails, and
// its result returned to duplicate deliveries.
func ExampleWithClaim() {
	pool := (*pgxpool.Pool)(nil)                             // your pool
	webhook := outboxriver.Receiver{Name: "partner-webhook"} // TTL 24 h

	handler := func(ctx context.Context, ev outboxriver.Event) error {
		status, duplicate, err := outboxriver.WithClaim(ctx, pool, webhook, ev, func(ctx context.Context) (int, error) {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://partner.example/hook", strings.NewReader(string(ev.Payload)))
			req.Header.Set("Idempotency-Key", fmt.Sprint(ev.ID)) // for the crash-inside-the-call window
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return 0, err
			}
			defer resp.Body.Close()
			if resp.StatusCode >= 300 {
				return 0, fmt.Errorf("partner answered %s", resp.Status) // releases the claim: River retries
			}
			return resp.StatusCode, nil
		})
		if err != nil {
			return err // includes ErrClaimHeld: another delivery is running it
		}
		_, _ = status, duplicate
		return nil
	}
	_ = outboxriver.HandlerFunc(handler)
}

func ExampleJobParams() {
	tbl, err := route.Parse([]byte(`
routes:
  - prefix: "billing.invoice."
    jobs:
      - queue: outbox_audit
      - queue: mail
        kind: send_invoice_email
        args: payload
        priority: 2
        tags: [billing]
`))
	if err != nil {
		panic(err)
	}
	// The event as the dispatcher claimed it.
	ev := outboxriver.EventArgs{
		EventID:   42,
		EventType: "billing.invoice.paid",
		Payload:   json.RawMessage(`{"invoice_id":7,"email":"ada@example.com"}`),
	}
	rule, _ := tbl.Match(ev.EventType)
	for _, p := range outboxriver.JobParams(rule, ev) {
		args, _ := json.Marshal(p.Args)
		fmt.Println(p.InsertOpts.Queue, p.Args.Kind(), p.InsertOpts.Priority, p.InsertOpts.Tags)
		fmt.Println("  args:", string(args))
		fmt.Println("  metadata:", string(p.InsertOpts.Metadata))
	}
	// Output:
	// outbox_audit outbox_event 0 []
	//   args: {"event_id":42,"event_type":"billing.invoice.paid","tenant_id":null,"payload":{"invoice_id":7,"email":"ada@example.com"},"dispatch_key":null,"created_at":"0001-01-01T00:00:00Z"}
	//   metadata: {"outbox_event_id":42,"outbox_event_type":"billing.invoice.paid"}
	// mail send_invoice_email 2 [billing]
	//   args: {"invoice_id":7,"email":"ada@example.com"}
	//   metadata: {"outbox_event_id":42,"outbox_event_type":"billing.invoice.paid","outbox_created_at":"0001-01-01T00:00:00Z","outbox_args":"payload"}
}

// A plain River worker, unchanged from before the service adopted the
// outbox, makes its effect idempotent per event.
func ExampleWithIdempotencyJob() {
	var pool *pgxpool.Pool // the service's pool
	work := func(ctx context.Context, job *river.Job[SendInvoiceArgs]) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := outboxriver.WithIdempotencyJob(ctx, tx, outboxriver.Receiver{Name: "invoice-mailer"}, job,
				func(ctx context.Context, tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `INSERT INTO invoice_mail (invoice_id) VALUES ($1)`, job.Args.InvoiceID)
					return err
				})
			return err
		})
	}
	_ = work
}

// A process that runs its own dispatcher (dispatcher.New) and wants what
// outboxd does beside it: River's GIN pending lists merged in small
// pieces, at most every 200 ms (migration 015's outbox_river_gin_clean()).
func ExampleNewGINCleaner() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/app")
	if err != nil {
		panic(err)
	}
	cleaner, err := outboxriver.NewGINCleaner(pool, outboxriver.GINCleanerConfig{Interval: outboxriver.DefaultGINCleanInterval})
	if err != nil {
		panic(err)
	}
	if err := cleaner.Start(ctx); err != nil {
		panic(err)
	}
	defer func() { _ = cleaner.Stop(ctx) }()
	// ... run the dispatcher ...
}
