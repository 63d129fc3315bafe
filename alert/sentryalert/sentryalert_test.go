package sentryalert_test

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/getsentry/sentry-go"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/alert/sentryalert"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

// sentryServer is a local stand-in for Sentry's ingest endpoint: it
// records the raw body and the decoded event of every envelope.
type sentryServer struct {
	t      *testing.T
	srv    *httptest.Server
	events chan received
}

type received struct {
	raw   string
	event struct {
		Message     string                    `json:"message"`
		Level       string                    `json:"level"`
		Fingerprint []string                  `json:"fingerprint"`
		Tags        map[string]string         `json:"tags"`
		Contexts    map[string]map[string]any `json:"contexts"`
	}
}

func newSentryServer(t *testing.T) *sentryServer {
	s := &sentryServer{t: t, events: make(chan received, 100)}
	s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body io.Reader = r.Body
		if r.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				t.Errorf("sentry server: %v", err)
				return
			}
			body = zr
		}
		raw, err := io.ReadAll(body)
		if err != nil {
			t.Errorf("sentry server: %v", err)
			return
		}
		if !strings.HasSuffix(r.URL.Path, "/envelope/") {
			t.Errorf("sentry server: unexpected path %s", r.URL.Path)
		}
		// An envelope: a header line, then (item header, item payload) pairs.
		sc := bufio.NewScanner(bytes.NewReader(raw))
		sc.Buffer(make([]byte, 1<<20), 1<<24)
		var lines []string
		for sc.Scan() {
			lines = append(lines, sc.Text())
		}
		for i := 1; i+1 < len(lines); i += 2 {
			var hdr struct{ Type string }
			_ = json.Unmarshal([]byte(lines[i]), &hdr)
			if hdr.Type != "event" {
				continue
			}
			var rec received
			rec.raw = string(raw)
			if err := json.Unmarshal([]byte(lines[i+1]), &rec.event); err != nil {
				t.Errorf("sentry server: bad event %q: %v", lines[i+1], err)
				continue
			}
			s.events <- rec
		}
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(`{}`))
	}))
	t.Cleanup(s.srv.Close)
	return s
}

// dsn points a real sentry-go client at the local server.
func (s *sentryServer) dsn() string {
	return "http://public@" + strings.TrimPrefix(s.srv.URL, "http://") + "/1"
}

func (s *sentryServer) next(ctx context.Context, what string) received {
	s.t.Helper()
	select {
	case r := <-s.events:
		return r
	case <-ctx.Done():
		s.t.Fatalf("no Sentry event received: waited for %s", what)
		return received{}
	}
}

func (s *sentryServer) none(what string) {
	s.t.Helper()
	select {
	case r := <-s.events:
		s.t.Fatalf("%s: unexpected Sentry event %+v", what, r.event)
	default:
	}
}

const secret = "SECRET-CARD-4242424242424242"

// TestDispatcherAlertsReachSentryWithoutPayload runs a real dispatcher
// whose alerter is a real sentry-go client pointed at a local server: an
// unroutable event and a dead-lettered event must arrive with their
// fingerprints, ids and errors, and without the payload.
func TestDispatcherAlertsReachSentryWithoutPayload(t *testing.T) {
	t.Parallel()
	srv := newSentryServer(t)
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)

	al, err := sentryalert.New(sentryalert.Config{DSN: srv.dsn(), Environment: "test"})
	if err != nil {
		t.Fatal(err)
	}
	// The receiver side rejects mail jobs: with MaxRetries -1 the first
	// failure dead-letters the event.
	_, err = s.Pool.Exec(ctx, `
		CREATE FUNCTION reject_mail() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'receiver rejects %', NEW.args->>'event_type'; END $$;
		CREATE TRIGGER reject_mail BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION reject_mail();`)
	if err != nil {
		t.Fatal(err)
	}
	routes, err := route.New([]route.Rule{{Prefix: "mail.", Queues: []string{"outbox_mail"}}})
	if err != nil {
		t.Fatal(err)
	}
	d, err := dispatcher.New(s.Pool, dispatcher.Config{Routes: routes, MaxRetries: -1, Alerter: al, PollInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}

	payload := json.RawMessage(`{"card":"` + secret + `","email":"someone@example.com"}`)
	var ids []int64
	err = pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		res, err := outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "billing.invoice.paid", Payload: payload, TenantID: "tenant-7"},
			{Type: "mail.user.welcome", Payload: payload, TenantID: "tenant-7"},
		})
		for _, r := range res {
			ids = append(ids, r.ID)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Stop(context.Background()) })

	byReason := map[string]received{}
	for len(byReason) < 2 {
		r := srv.next(ctx, "the unroutable and dead-letter alerts")
		byReason[r.event.Tags["outbox.reason"]] = r
	}
	al.Flush(5 * time.Second)

	un, dl := byReason["unroutable"], byReason["dead_letter"]
	if got := un.event.Fingerprint; !slices.Equal(got, []string{"outbox", "unroutable", "billing.invoice."}) {
		t.Errorf("unroutable fingerprint %v", got)
	}
	if got := dl.event.Fingerprint; !slices.Equal(got, []string{"outbox", "dead_letter", "mail.user."}) {
		t.Errorf("dead-letter fingerprint %v", got)
	}
	for name, r := range byReason {
		if strings.Contains(r.raw, secret) || strings.Contains(r.raw, "someone@example.com") {
			t.Errorf("%s alert carries the payload:\n%s", name, r.raw)
		}
		if r.event.Tags["outbox.tenant_id"] != "tenant-7" || r.event.Level != "error" {
			t.Errorf("%s alert: tags %v level %q", name, r.event.Tags, r.event.Level)
		}
	}
	if got := un.event.Contexts["outbox"]["event_id"]; got != jsonID(ids[0]) {
		t.Errorf("unroutable event_id %v, want %d", got, ids[0])
	}
	if got := dl.event.Contexts["outbox"]["event_id"]; got != jsonID(ids[1]) {
		t.Errorf("dead-letter event_id %v, want %d", got, ids[1])
	}
	if e, _ := dl.event.Contexts["outbox"]["error"].(string); !strings.Contains(e, "receiver rejects mail.user.welcome") {
		t.Errorf("dead-letter error %q", e)
	}
}

func jsonID(id int64) string { return strings.TrimSpace(string(must(json.Marshal(id)))) }

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestIncludePayloadOptIn shows the payload check above can fail: with
// IncludePayload the payload is attached.
func TestIncludePayloadOptIn(t *testing.T) {
	t.Parallel()
	srv := newSentryServer(t)
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	var id int64
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		p, err := outbox.Publish(ctx, tx, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(`{"card":"` + secret + `"}`)})
		id = p.ID
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	al, err := sentryalert.New(sentryalert.Config{DSN: srv.dsn(), IncludePayload: true, Pool: s.Pool})
	if err != nil {
		t.Fatal(err)
	}
	al.Alert(ctx, alert.Alert{Reason: alert.DeadLetter, Message: "x", EventID: id, EventType: "mail.user.welcome"})
	al.Flush(5 * time.Second)
	if r := srv.next(ctx, "the alert"); !strings.Contains(r.raw, secret) {
		t.Fatalf("IncludePayload: payload missing:\n%s", r.raw)
	}
	if _, err := sentryalert.New(sentryalert.Config{DSN: srv.dsn(), IncludePayload: true}); err == nil {
		t.Fatal("IncludePayload without Pool accepted")
	}
}

// TestBurstIsRateLimitedPerFingerprint sends a burst through a client
// with a synchronous transport and a fake clock.
func TestBurstIsRateLimitedPerFingerprint(t *testing.T) {
	t.Parallel()
	srv := newSentryServer(t)
	client, err := sentry.NewClient(sentry.ClientOptions{Dsn: srv.dsn(), Transport: sentry.NewHTTPSyncTransport()})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	now := time.Date(2024, 5, 1, 3, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	al, err := sentryalert.New(sentryalert.Config{Client: client, Burst: 3, Window: time.Minute, Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	ctx := pgtest.Context(t, time.Minute)
	for i := range 25 {
		al.Alert(ctx, alert.Alert{Reason: alert.DeadLetter, Message: "dead", EventID: int64(i + 1), EventType: "mail.user.welcome"})
	}
	// Another type prefix is another fingerprint with its own budget.
	al.Alert(ctx, alert.Alert{Reason: alert.DeadLetter, Message: "dead", EventID: 99, EventType: "webhook.order.created"})
	al.Flush(5 * time.Second)
	got := map[string]int{}
	for range 4 {
		r := srv.next(ctx, "the first alerts of the burst")
		got[strings.Join(r.event.Fingerprint, "/")]++
	}
	srv.none("the rest of the burst")
	if got["outbox/dead_letter/mail.user."] != 3 || got["outbox/dead_letter/webhook.order."] != 1 {
		t.Fatalf("sent per fingerprint: %v, want 3 and 1", got)
	}

	// After the window, the next alert reports how many were suppressed.
	mu.Lock()
	now = now.Add(time.Minute)
	mu.Unlock()
	al.Alert(ctx, alert.Alert{Reason: alert.DeadLetter, Message: "dead", EventID: 100, EventType: "mail.user.reset"})
	r := srv.next(ctx, "the alert after the window")
	if n, _ := r.event.Contexts["outbox"]["suppressed"].(float64); n != 22 {
		t.Fatalf("suppressed = %v, want 22", r.event.Contexts["outbox"]["suppressed"])
	}
}

func TestTypePrefixAndConfig(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"mail.user.welcome":             "mail.user.",
		"plugin.hook.workflow.executed": "plugin.hook.",
		"a.b":                           "a.b.",
		"":                              "-",
	} {
		if got := sentryalert.TypePrefix(in, 2); got != want {
			t.Errorf("TypePrefix(%q) = %q, want %q", in, got, want)
		}
	}
	if got := sentryalert.TypePrefix("plugin.hook.workflow.executed", 1); got != "plugin." {
		t.Errorf("TypePrefix(_, 1) = %q", got)
	}
	if _, err := sentryalert.New(sentryalert.Config{}); err == nil || !strings.Contains(err.Error(), "SENTRY_DSN") {
		t.Errorf("New without DSN = %v", err)
	}
	if _, err := sentryalert.New(sentryalert.Config{DSN: "not a dsn"}); err == nil || !strings.Contains(err.Error(), "SENTRY_DSN") {
		t.Errorf("New with a bad DSN = %v", err)
	}
}

// TestParkedKeyIsOneIssuePerKey: parked-key alerts are grouped per
// (tenant, ordering key, queue), not per event type, and each group has
// its own rate limit; the alert carries the key, queue and head job.
func TestParkedKeyIsOneIssuePerKey(t *testing.T) {
	t.Parallel()
	srv := newSentryServer(t)
	client, err := sentry.NewClient(sentry.ClientOptions{Dsn: srv.dsn(), Transport: sentry.NewHTTPSyncTransport()})
	if err != nil {
		t.Fatal(err)
	}
	al, err := sentryalert.New(sentryalert.Config{Client: client, Burst: 2, Window: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := pgtest.Context(t, time.Minute)
	parked := func(tenant, key string, job int64) alert.Alert {
		return alert.Alert{Reason: alert.ParkedKey, Message: "parked", TenantID: tenant, OrderingKey: key,
			Queue: "outbox_order", JobID: job, EventID: job + 1000, EventType: "order.step.done"}
	}
	for i := range 5 {
		al.Alert(ctx, parked("acme", "order-42", int64(i+1)))
	}
	al.Alert(ctx, parked("acme", "order-43", 7))
	al.Alert(ctx, parked("", "order-42", 8))
	al.Flush(5 * time.Second)
	got := map[string]int{}
	for range 4 {
		r := srv.next(ctx, "the parked-key alerts")
		got[strings.Join(r.event.Fingerprint, "/")]++
		if r.event.Tags["outbox.queue"] != "outbox_order" || r.event.Contexts["outbox"]["ordering_key"] == nil || r.event.Contexts["outbox"]["job_id"] == nil {
			t.Errorf("parked-key alert without its queue tag, key or job: tags %v, context %v", r.event.Tags, r.event.Contexts["outbox"])
		}
	}
	srv.none("the rest of one key's burst")
	want := map[string]int{
		"outbox/parked_key/acme/order-42/outbox_order": 2,
		"outbox/parked_key/acme/order-43/outbox_order": 1,
		"outbox/parked_key/-/order-42/outbox_order":    1,
	}
	if !maps.Equal(got, want) {
		t.Fatalf("sent per fingerprint: %v, want %v", got, want)
	}
}
