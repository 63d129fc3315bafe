package main

// The receivers process: `outbox-demo -receivers` is what your own service
// looks like when it embeds package outboxriver. The demo starts it as the
// "mail" group, a separate process from outboxd.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox/internal/config"
	outboxriver "github.com/outboxhq/outbox/river"
)

// invoicePayload is the payload of the demo's events.
type invoicePayload struct {
	InvoiceID   int64  `json:"invoice_id"`
	AmountCents int    `json:"amount_cents"`
	Email       string `json:"email"`
}

// webhookResult is what the webhook receiver answered; WithClaim returns
// it to duplicate deliveries.
type webhookResult struct {
	Status     int    `json:"status"`
	DeliveryID string `json:"delivery_id"`
}

var (
	mailer  = outboxriver.Receiver{Name: "mailer"}
	webhook = outboxriver.Receiver{Name: "webhook"}
	auditor = outboxriver.Receiver{Name: "audit"}
)

// say prints one line to the parent, which shows it under "[mail group]".
func say(format string, a ...any) { fmt.Printf(format+"\n", a...) }

func receiverHandlers(pool *pgxpool.Pool, hookURL string) *outboxriver.Handlers {
	hs := outboxriver.NewHandlers()

	// mail.: a same-database effect (a row in the mailbox table), exactly
	// once with WithIdempotency.
	hs.Handle("mail.", outboxriver.Typed(func(ctx context.Context, ev outboxriver.Event, p invoicePayload) error {
		started := time.Now()
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		dup, err := outboxriver.WithIdempotency(ctx, tx, mailer, ev, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO mailbox (event_id, invoice_id, recipient, subject, handler_started_at) VALUES ($1, $2, $3, $4, $5)`,
				ev.ID, p.InvoiceID, p.Email, fmt.Sprintf("Receipt for invoice %d", p.InvoiceID), started)
			return err
		})
		if err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		if dup {
			say("duplicate delivery of event %d to %s suppressed (job %d): the mailbox already has it", ev.ID, mailer.Name, ev.JobID)
		}
		return nil
	}))

	// webhook.: an external effect (an HTTP POST), claimed with a TTL.
	client := &http.Client{Timeout: 10 * time.Second}
	hs.Handle("webhook.", outboxriver.Typed(func(ctx context.Context, ev outboxriver.Event, p invoicePayload) error {
		res, dup, err := outboxriver.WithClaim(ctx, pool, webhook, ev, func(ctx context.Context) (webhookResult, error) {
			body, _ := json.Marshal(map[string]any{"event_id": ev.ID, "type": ev.Type, "invoice_id": p.InvoiceID})
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, hookURL, bytes.NewReader(body))
			if err != nil {
				return webhookResult{}, err
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", fmt.Sprintf("outbox-event-%d", ev.ID))
			resp, err := client.Do(req)
			if err != nil {
				return webhookResult{}, err
			}
			defer func() { _ = resp.Body.Close() }()
			id, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
			if resp.StatusCode >= 300 {
				return webhookResult{}, fmt.Errorf("webhook answered %s", resp.Status)
			}
			return webhookResult{Status: resp.StatusCode, DeliveryID: string(bytes.TrimSpace(id))}, nil
		})
		if err != nil {
			if ev.Attempt == 1 {
				say("webhook for event %d failed on attempt 1 (%v): claim released, River retries it", ev.ID, err)
			}
			return err
		}
		switch {
		case dup:
			say("duplicate delivery of event %d to %s suppressed (job %d): cached result %s, no second POST", ev.ID, webhook.Name, ev.JobID, res.DeliveryID)
		case ev.Attempt > 1:
			say("webhook for event %d delivered on attempt %d (%s)", ev.ID, ev.Attempt, res.DeliveryID)
		}
		return nil
	}))

	// audit.: append to the audit table, exactly once.
	hs.Handle("audit.", outboxriver.HandlerFunc(func(ctx context.Context, ev outboxriver.Event) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := outboxriver.WithIdempotency(ctx, tx, auditor, ev, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO audit_log (event_id, event_type, tenant_id, payload) VALUES ($1, $2, $3, $4)`,
					ev.ID, ev.Type, ev.TenantID, ev.Payload)
				return err
			})
			return err
		})
	}))
	return hs
}

// runReceivers is the child process: it works the queues of the group
// OUTBOX_WORKER_GROUP picks from OUTBOX_WORKER_GROUPS until SIGTERM.
func runReceivers() error {
	ctx, stop := signalContext()
	defer stop()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	groups, err := config.ParseGroups(os.Getenv("OUTBOX_WORKER_GROUPS"))
	if err != nil {
		return fmt.Errorf("OUTBOX_WORKER_GROUPS: %w", err)
	}
	group, ok := config.FindGroup(groups, os.Getenv("OUTBOX_WORKER_GROUP"))
	if !ok {
		return fmt.Errorf("OUTBOX_WORKER_GROUP=%q is not in OUTBOX_WORKER_GROUPS", os.Getenv("OUTBOX_WORKER_GROUP"))
	}
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()

	workers := river.NewWorkers()
	river.AddWorker(workers, outboxriver.NewWorker(receiverHandlers(pool, os.Getenv("DEMO_WEBHOOK_URL")), outboxriver.WorkerOptions{Logger: logger}))
	cfg := outboxriver.QueuesConfig(workers, group.Queues, outboxriver.WorkerLatency{})
	cfg.ID = outboxriver.GroupClientID(group.Name)
	// River logs every failed attempt at error level; the injected failure
	// is expected, and the handler reports it itself.
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError + 4}))
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		return err
	}
	if err := client.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return client.Stop(sctx)
}
