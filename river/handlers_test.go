package outboxriver_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

func TestWorkerHandsTheEventToTheLongestPrefix(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	routes := testRoutes(t)

	var (
		mu   sync.Mutex
		seen = map[string][]outboxriver.Event{} // by handler
	)
	record := func(name string) outboxriver.HandlerFunc {
		return func(_ context.Context, ev outboxriver.Event) error {
			mu.Lock()
			defer mu.Unlock()
			seen[name] = append(seen[name], ev)
			return nil
		}
	}
	hs := outboxriver.NewHandlers()
	hs.Handle("mail.", record("mail"))
	hs.Handle("mail.receipt.", record("receipt"))
	hs.Handle("mail.receipt.requested", record("exact"))
	hs.Handle("", record("fallback"))

	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "mail.receipt.requested", TenantID: "acme", Payload: json.RawMessage(`{"invoice_id": 7}`), DispatchKey: "invoice:7"},
		outbox.Event{Type: "mail.receipt.resent", Payload: json.RawMessage(`{}`)},
		outbox.Event{Type: "mail.welcome.sent"},
		outbox.Event{Type: "audit.login.succeeded"},
	)
	if res := handoff(t, s.Pool, routes); res.Done != 4 {
		t.Fatalf("handed off %d events, want 4", res.Done)
	}
	startWorkers(t, s.Pool, hs, nil, "outbox_mail", "outbox_audit")

	pgtest.WaitFor(t, 30*time.Second, "4 jobs completed", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == 4
	})
	mu.Lock()
	defer mu.Unlock()
	want := map[string]int64{"exact": ids[0], "receipt": ids[1], "mail": ids[2], "fallback": ids[3]}
	for name, id := range want {
		if len(seen[name]) != 1 || seen[name][0].ID != id {
			t.Errorf("handler %s saw %+v, want exactly event %d", name, seen[name], id)
		}
	}

	// The exact handler's event carries everything the row has.
	ev := seen["exact"][0]
	var createdAt time.Time
	var jobID int64
	if err := s.Pool.QueryRow(context.Background(), `SELECT created_at, river_job_ids[1] FROM outbox_event WHERE id = $1`, ids[0]).Scan(&createdAt, &jobID); err != nil {
		t.Fatal(err)
	}
	if ev.Type != "mail.receipt.requested" || ev.TenantID != "acme" || ev.DispatchKey != "invoice:7" {
		t.Errorf("event fields: %+v", ev)
	}
	if !ev.CreatedAt.Equal(createdAt) {
		t.Errorf("CreatedAt %s, want %s", ev.CreatedAt, createdAt)
	}
	if string(ev.Payload) != `{"invoice_id": 7}` {
		t.Errorf("payload %s", ev.Payload)
	}
	if ev.JobID != jobID || ev.Queue != "outbox_mail" || ev.Attempt != 1 {
		t.Errorf("job fields: job %d queue %s attempt %d, want job %d in outbox_mail, attempt 1", ev.JobID, ev.Queue, ev.Attempt, jobID)
	}
	fb := seen["fallback"][0]
	if fb.TenantID != "" || fb.DispatchKey != "" {
		t.Errorf("no tenant and no key should read as empty strings: %+v", fb)
	}
}

func TestWorkerAttemptCountsRetries(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	var (
		mu       sync.Mutex
		attempts []int
	)
	hs := outboxriver.NewHandlers()
	hs.HandleFunc("mail.", func(_ context.Context, ev outboxriver.Event) error {
		mu.Lock()
		defer mu.Unlock()
		attempts = append(attempts, ev.Attempt)
		if ev.Attempt < 3 {
			return errors.New("transient")
		}
		return nil
	})
	pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.receipt.requested"})
	handoff(t, s.Pool, testRoutes(t))
	startWorkers(t, s.Pool, hs, nil, "outbox_mail")
	pgtest.WaitFor(t, 30*time.Second, "the job to complete", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == 1
	})
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) != 3 || attempts[0] != 1 || attempts[1] != 2 || attempts[2] != 3 {
		t.Errorf("attempts %v, want [1 2 3]", attempts)
	}
}

func TestWorkerWithoutHandlerFailsLoudly(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	al := &alerts{}
	hs := outboxriver.NewHandlers()
	hs.HandleFunc("mail.", func(context.Context, outboxriver.Event) error { return nil })

	ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "audit.login.failed", TenantID: "acme"})
	handoff(t, s.Pool, testRoutes(t))
	startWorkers(t, s.Pool, hs, al, "outbox_audit")

	// The job is not dropped: it fails (River keeps retrying it) with an
	// error that says what is missing.
	pgtest.WaitFor(t, 30*time.Second, "the job to record an error", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE cardinality(errors) > 0`) == 1
	})
	var errMsg, state string
	if err := s.Pool.QueryRow(context.Background(), `SELECT errors[1]->>'error', state::text FROM river_job`).Scan(&errMsg, &state); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(errMsg, "no handler for event type audit.login.failed") || !strings.Contains(errMsg, "outbox_audit") {
		t.Errorf("job error %q does not name the type and queue", errMsg)
	}
	if state == "completed" || state == "discarded" || state == "cancelled" {
		t.Errorf("job state %s: a job without handler must stay retryable", state)
	}
	pgtest.WaitFor(t, 10*time.Second, "an alert", func() bool { return len(al.all()) > 0 })
	a := al.all()[0]
	if a.Reason != alert.NoHandler || a.EventID != ids[0] || a.EventType != "audit.login.failed" || a.TenantID != "acme" {
		t.Errorf("alert %+v", a)
	}
	// Alerts are raised on the first and the last attempt, not on every
	// retry in between.
	pgtest.WaitFor(t, 30*time.Second, "a few retries", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT attempt FROM river_job`) >= 4
	})
	if n := len(al.all()); n != 1 {
		t.Errorf("%d alerts after several attempts, want 1", n)
	}
}

func TestHandlersRegistration(t *testing.T) {
	t.Parallel()
	noop := outboxriver.HandlerFunc(func(context.Context, outboxriver.Event) error { return nil })
	hs := outboxriver.NewHandlers()
	if err := hs.Add("mail.", noop); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		prefix string
		h      outboxriver.Handler
		want   string
	}{
		{"mail.", noop, "already registered"},
		{"mail", noop, `use "mail."`},
		{"Mail.", noop, "lowercase"},
		{"webhook.", nil, "nil"},
	}
	for _, c := range cases {
		err := hs.Add(c.prefix, c.h)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Add(%q): %v, want an error containing %q", c.prefix, err, c.want)
		}
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("Handle with a duplicate prefix did not panic")
			}
		}()
		hs.Handle("mail.", noop)
	}()
	if _, p, ok := hs.Lookup("mailx.a.b"); ok {
		t.Errorf("mail. matched mailx.a.b via %q: prefixes match whole segments", p)
	}
	if _, p, ok := hs.Lookup("mail.a.b"); !ok || p != "mail." {
		t.Errorf("Lookup(mail.a.b) = %q, %v", p, ok)
	}
}

type receipt struct {
	InvoiceID   int64  `json:"invoice_id"`
	AmountCents int    `json:"amount_cents"`
	Email       string `json:"email"`
}

func TestDecode(t *testing.T) {
	t.Parallel()
	ev := outboxriver.Event{ID: 42, Type: "mail.receipt.requested", Payload: json.RawMessage(`{"invoice_id": 7, "amount_cents": 1200, "email": "a@example.com", "extra": true}`)}
	r, err := outboxriver.Decode[receipt](ev)
	if err != nil {
		t.Fatal(err)
	}
	if r != (receipt{7, 1200, "a@example.com"}) {
		t.Errorf("decoded %+v", r)
	}

	cases := map[string][]string{
		`{"invoice_id": "seven"}`: {"event 42", "mail.receipt.requested", "outboxriver_test.receipt", "field invoice_id", "JSON string cannot be a Go int64"},
		`[1, 2]`:                  {"event 42", "JSON array cannot be a Go outboxriver_test.receipt"},
		`{"invoice_id": 7`:        {"event 42", "not valid JSON"},
	}
	for payload, wants := range cases {
		ev.Payload = json.RawMessage(payload)
		_, err := outboxriver.Decode[receipt](ev)
		var de *outboxriver.DecodeError
		if !errors.As(err, &de) {
			t.Errorf("%s: error %v is not a *DecodeError", payload, err)
			continue
		}
		if de.EventID != 42 || de.EventType != "mail.receipt.requested" {
			t.Errorf("%s: DecodeError fields %+v", payload, de)
		}
		for _, w := range wants {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q lacks %q", payload, err, w)
			}
		}
	}
	// An empty payload decodes as {}.
	ev.Payload = nil
	if r, err := outboxriver.Decode[receipt](ev); err != nil || r != (receipt{}) {
		t.Errorf("empty payload: %+v, %v", r, err)
	}
}

func TestTypedHandlerFailsTheJobOnABadPayload(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	got := make(chan receipt, 1)
	hs := outboxriver.NewHandlers()
	hs.Handle("mail.", outboxriver.Typed(func(_ context.Context, _ outboxriver.Event, r receipt) error {
		got <- r
		return nil
	}))
	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "mail.receipt.requested", Payload: json.RawMessage(`{"invoice_id": "not a number"}`)},
		outbox.Event{Type: "mail.receipt.requested", Payload: json.RawMessage(`{"invoice_id": 9}`)},
	)
	handoff(t, s.Pool, testRoutes(t))
	startWorkers(t, s.Pool, hs, nil, "outbox_mail")
	select {
	case r := <-got:
		if r.InvoiceID != 9 {
			t.Errorf("handler got %+v, want invoice 9", r)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the good event was not handled")
	}
	pgtest.WaitFor(t, 30*time.Second, "the bad job's error", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE cardinality(errors) > 0 AND (args->>'event_id')::bigint = $1`, ids[0]) == 1
	})
	var msg string
	if err := s.Pool.QueryRow(context.Background(), `SELECT errors[1]->>'error' FROM river_job WHERE (args->>'event_id')::bigint = $1`, ids[0]).Scan(&msg); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(msg, "field invoice_id") || !strings.Contains(msg, "receipt") {
		t.Errorf("job error %q does not explain the decode failure", msg)
	}
}
