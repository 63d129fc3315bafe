package outboxriver_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

// delivery is what a handler observed on one run.
type delivery struct {
	jobID     int64
	attempt   int
	duplicate bool
}

type log struct {
	mu  sync.Mutex
	got []delivery
}

func (l *log) add(d delivery) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, d)
}

func (l *log) all() []delivery {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]delivery(nil), l.got...)
}

// forceDuplicate inserts a second River job with the same args as the
// event's first job, into the same queue: a redelivery as an operator's
// re-insert or a buggy producer would cause it.
func forceDuplicate(t *testing.T, pool *pgxpool.Pool, client *river.Client[pgx.Tx], eventID int64) int64 {
	t.Helper()
	ctx := context.Background()
	var (
		raw   []byte
		queue string
	)
	if err := pool.QueryRow(ctx, `SELECT j.args, j.queue FROM outbox_event e JOIN river_job j ON j.id = e.river_job_ids[1] WHERE e.id = $1`, eventID).Scan(&raw, &queue); err != nil {
		t.Fatal(err)
	}
	var args outboxriver.EventArgs
	if err := json.Unmarshal(raw, &args); err != nil {
		t.Fatal(err)
	}
	res, err := client.Insert(ctx, args, &river.InsertOpts{Queue: queue})
	if err != nil {
		t.Fatal(err)
	}
	return res.Job.ID
}

func TestWithIdempotencyAppliesTheEffectOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	if _, err := s.Pool.Exec(ctx, `CREATE TABLE mailbox (event_id bigint NOT NULL, body text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	mailer := outboxriver.Receiver{Name: "mailer"}
	seen := &log{}
	var crashOnce, failOnce sync.Once

	hs := outboxriver.NewHandlers()
	hs.HandleFunc("mail.", func(ctx context.Context, ev outboxriver.Event) error {
		tx, err := s.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

		// First delivery of mail.receipt.requested: the effect and the
		// receipt commit, then the process "dies" before River records
		// the completion. An Event built by hand carries no job, so
		// WithIdempotency does not complete it: the job stays running
		// and fails, exactly as after a crash River's rescuer retries it.
		target := ev
		crash := false
		if ev.Type == "mail.receipt.requested" {
			crashOnce.Do(func() {
				crash = true
				target = outboxriver.Event{ID: ev.ID, Type: ev.Type, JobID: ev.JobID, Attempt: ev.Attempt}
			})
		}
		// First delivery of mail.welcome.sent: the handler fails after
		// writing its effect, inside the transaction.
		fail := false
		if ev.Type == "mail.welcome.sent" {
			failOnce.Do(func() { fail = true })
		}

		dup, err := outboxriver.WithIdempotency(ctx, tx, mailer, target, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO mailbox (event_id, body) VALUES ($1, $2)`, ev.ID, ev.Type); err != nil {
				return err
			}
			if fail {
				return errors.New("smtp: 451 try again later")
			}
			return nil
		})
		if err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		seen.add(delivery{jobID: ev.JobID, attempt: ev.Attempt, duplicate: dup})
		if crash {
			return errors.New("simulated crash after the commit, before River's completion")
		}
		return nil
	})

	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "mail.receipt.requested", Payload: json.RawMessage(`{}`)},
		outbox.Event{Type: "mail.welcome.sent", Payload: json.RawMessage(`{}`)},
	)
	handoff(t, s.Pool, testRoutes(t))
	client := startWorkers(t, s.Pool, hs, nil, "outbox_mail")

	pgtest.WaitFor(t, 30*time.Second, "both jobs completed", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == 2
	})
	// A forced second job with the same args, for both events.
	dupJobs := []int64{forceDuplicate(t, s.Pool, client, ids[0]), forceDuplicate(t, s.Pool, client, ids[1])}
	pgtest.WaitFor(t, 30*time.Second, "the duplicate jobs completed", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == 4
	})

	for _, id := range ids {
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM mailbox WHERE event_id = $1`, id); n != 1 {
			t.Errorf("event %d: %d mailbox rows, want exactly 1", id, n)
		}
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_receipt WHERE event_id = $1 AND receiver = 'mailer' AND state = 'done' AND expires_at > now() + interval '23 hours'`, id); n != 1 {
			t.Errorf("event %d: %d receipts, want 1 that lives 24 h", id, n)
		}
	}
	// Who applied and who was suppressed.
	var applied, suppressed []string
	for _, d := range seen.all() {
		s := fmt.Sprintf("job %d attempt %d", d.jobID, d.attempt)
		if d.duplicate {
			suppressed = append(suppressed, s)
		} else {
			applied = append(applied, s)
		}
	}
	if len(applied) != 2 {
		t.Errorf("applied by %v, want one delivery per event", applied)
	}
	// Suppressed: the crashed job's retry and the two forced duplicates.
	if len(suppressed) != 3 {
		t.Errorf("suppressed %v, want 3 (the retry after the crash and 2 forced duplicates)", suppressed)
	}
	for _, j := range dupJobs {
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'completed' AND attempt = 1`, j); n != 1 {
			t.Errorf("duplicate job %d was not completed on its first attempt", j)
		}
	}
	// The failed welcome mail was applied by its retry, which the receipt
	// records.
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_receipt WHERE event_id = $1 AND attempt = 2`, ids[1]); n != 1 {
		t.Errorf("the welcome mail's receipt is not from attempt 2")
	}
}

// TestWithIdempotencyConcurrentDeliveries runs two deliveries of one event
// at the same time: the second waits for the first's transaction and then
// applies nothing if it commits, or everything if it rolls back.
func TestWithIdempotencyConcurrentDeliveries(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	if _, err := s.Pool.Exec(ctx, `CREATE TABLE effect (event_id bigint NOT NULL, by_tx int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	r := outboxriver.Receiver{Name: "ledger"}

	for _, firstCommits := range []bool{true, false} {
		ev := outboxriver.Event{ID: map[bool]int64{true: 1, false: 2}[firstCommits], Type: "billing.invoice.paid"}
		tx1, err := s.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		dup, err := outboxriver.WithIdempotency(ctx, tx1, r, ev, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effect VALUES ($1, 1)`, ev.ID)
			return err
		})
		if err != nil || dup {
			t.Fatalf("first delivery: duplicate %v, %v", dup, err)
		}

		type outcome struct {
			dup bool
			err error
		}
		second := make(chan outcome, 1)
		var pid uint32
		conn, err := s.Pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pid = conn.Conn().PgConn().PID()
		go func() {
			defer conn.Release()
			var o outcome
			o.err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				var err error
				o.dup, err = outboxriver.WithIdempotency(ctx, tx, r, ev, func(ctx context.Context, tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `INSERT INTO effect VALUES ($1, 2)`, ev.ID)
					return err
				})
				return err
			})
			second <- o
		}()
		pgtest.WaitFor(t, 30*time.Second, "the second delivery to wait on the first's receipt", func() bool {
			return pgtest.Count(t, s.Pool, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`, pid) == 1
		})
		if firstCommits {
			err = tx1.Commit(ctx)
		} else {
			err = tx1.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		o := <-second
		if o.err != nil {
			t.Fatalf("second delivery: %v", o.err)
		}
		if o.dup != firstCommits {
			t.Errorf("first commits=%v: second delivery duplicate=%v", firstCommits, o.dup)
		}
		want := map[bool]int{true: 1, false: 2}[firstCommits]
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM effect WHERE event_id = $1 AND by_tx = $2`, ev.ID, want); n != 1 {
			t.Errorf("first commits=%v: the effect of delivery %d is missing", firstCommits, want)
		}
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM effect WHERE event_id = $1`, ev.ID); n != 1 {
			t.Errorf("first commits=%v: %d effects, want 1", firstCommits, n)
		}
	}
}

// hook is a local HTTP receiver: it fails the first POST with 503 and
// counts the successful ones per event.
type hook struct {
	mu       sync.Mutex
	posts    int
	accepted map[string]int
}

func (h *hook) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.posts++
	if h.posts == 1 {
		http.Error(w, "try later", http.StatusServiceUnavailable)
		return
	}
	h.accepted[string(body)]++
	fmt.Fprintf(w, "delivery-%d", h.posts)
}

type hookResult struct {
	DeliveryID string `json:"delivery_id"`
}

func TestWithClaimExternalEffectOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	h := &hook{accepted: map[string]int{}}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	webhook := outboxriver.Receiver{Name: "webhook", TTL: 48 * time.Hour}
	var (
		mu      sync.Mutex
		results []hookResult
		runs    []delivery
		crashed bool
	)
	hs := outboxriver.NewHandlers()
	hs.HandleFunc("webhook.", func(ctx context.Context, ev outboxriver.Event) error {
		res, dup, err := outboxriver.WithClaim(ctx, s.Pool, webhook, ev, func(ctx context.Context) (hookResult, error) {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(fmt.Sprint(ev.ID)))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return hookResult{}, err
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusOK {
				return hookResult{}, fmt.Errorf("webhook: %s", resp.Status)
			}
			return hookResult{DeliveryID: string(body)}, nil
		})
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		results = append(results, res)
		runs = append(runs, delivery{jobID: ev.JobID, attempt: ev.Attempt, duplicate: dup})
		if !crashed {
			// The effect is done and recorded; the process dies before
			// River records the completion, so River retries the job.
			crashed = true
			return errors.New("simulated crash after the effect, before completion")
		}
		return nil
	})

	ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "webhook.invoice.paid"})
	handoff(t, s.Pool, testRoutes(t))
	client := startWorkers(t, s.Pool, hs, nil, "outbox_webhook")
	pgtest.WaitFor(t, 30*time.Second, "the webhook job to complete", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == 1
	})
	dupJob := forceDuplicate(t, s.Pool, client, ids[0])
	pgtest.WaitFor(t, 30*time.Second, "the duplicate job to complete", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == 2
	})

	h.mu.Lock()
	posts, accepted := h.posts, h.accepted[fmt.Sprint(ids[0])]
	h.mu.Unlock()
	if posts != 2 || accepted != 1 {
		t.Errorf("webhook saw %d POSTs and accepted %d, want 2 and 1 (the 503, then one success)", posts, accepted)
	}
	mu.Lock()
	defer mu.Unlock()
	// Attempt 1 failed (503) and released its claim; attempt 2 applied the
	// effect; attempt 3 and the forced duplicate got the cached result.
	if len(runs) != 3 {
		t.Fatalf("handler returned from WithClaim %d times (%v), want 3", len(runs), runs)
	}
	if runs[0].attempt != 2 || runs[0].duplicate {
		t.Errorf("first successful run %+v, want attempt 2, not a duplicate", runs[0])
	}
	if runs[1].attempt != 3 || !runs[1].duplicate {
		t.Errorf("run after the crash %+v, want attempt 3, a duplicate", runs[1])
	}
	if runs[2].jobID != dupJob || !runs[2].duplicate {
		t.Errorf("forced duplicate run %+v, want job %d, a duplicate", runs[2], dupJob)
	}
	for i, r := range results {
		if r.DeliveryID != "delivery-2" {
			t.Errorf("result %d is %+v, want the cached delivery-2", i, r)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_receipt WHERE receiver = 'webhook' AND state = 'done' AND result->>'delivery_id' = 'delivery-2' AND expires_at > now() + interval '47 hours'`); n != 1 {
		t.Errorf("%d webhook receipts with the result and a 48 h TTL, want 1", n)
	}
}

// TestWithClaimHolders drives the claim by hand: a claim in progress makes
// other deliveries wait (ErrClaimHeld), the same job's next attempt takes
// over an abandoned claim, and the abandoned holder learns it lost it.
func TestWithClaimHolders(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	r := outboxriver.Receiver{Name: "mailer"}
	first := outboxriver.Event{ID: 10, Type: "mail.receipt.requested", JobID: 100, Attempt: 1}

	inside := make(chan struct{})
	release := make(chan struct{})
	type outcome struct {
		res string
		err error
	}
	firstDone := make(chan outcome, 1)
	go func() {
		res, _, err := outboxriver.WithClaim(ctx, s.Pool, r, first, func(context.Context) (string, error) {
			close(inside)
			<-release
			return "sent by attempt 1", nil
		})
		firstDone <- outcome{res, err}
	}()
	<-inside

	// Another job for the same event: held.
	other := first
	other.JobID, other.Attempt = 101, 1
	ran := false
	_, _, err := outboxriver.WithClaim(ctx, s.Pool, r, other, func(context.Context) (string, error) { ran = true; return "", nil })
	if !errors.Is(err, outboxriver.ErrClaimHeld) || ran {
		t.Fatalf("other job: ran=%v err=%v, want ErrClaimHeld without running", ran, err)
	}
	if !strings.Contains(err.Error(), "job 100 (attempt 1)") {
		t.Errorf("ErrClaimHeld %q does not name the holder", err)
	}

	// The same job's next attempt: the first attempt is presumed dead.
	retry := first
	retry.Attempt = 2
	res, dup, err := outboxriver.WithClaim(ctx, s.Pool, r, retry, func(context.Context) (string, error) { return "sent by attempt 2", nil })
	if err != nil || dup || res != "sent by attempt 2" {
		t.Fatalf("retry: %q dup=%v err=%v", res, dup, err)
	}

	close(release)
	o := <-firstDone
	if !errors.Is(o.err, outboxriver.ErrClaimLost) {
		t.Errorf("abandoned first attempt: %v, want ErrClaimLost", o.err)
	}
	// The recorded result is the retry's, and duplicates get it.
	res, dup, err = outboxriver.WithClaim(ctx, s.Pool, r, other, func(context.Context) (string, error) { ran = true; return "", nil })
	if err != nil || !dup || ran || res != "sent by attempt 2" {
		t.Errorf("after completion: %q dup=%v ran=%v err=%v", res, dup, ran, err)
	}

	// A panicking effect releases the claim, and the panic goes on.
	panicky := outboxriver.Event{ID: 11, Type: "mail.receipt.requested", JobID: 200, Attempt: 1}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("the panic was swallowed")
			}
		}()
		_, _, _ = outboxriver.WithClaim(ctx, s.Pool, r, panicky, func(context.Context) (int, error) { panic("boom") })
	}()
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_receipt WHERE event_id = 11`); n != 0 {
		t.Errorf("the panicking effect left its claim")
	}
}

func TestReceiptTTLAndPurge(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	r := outboxriver.Receiver{Name: "ledger", TTL: time.Hour}
	apply := func(id int64) (bool, int) {
		runs := 0
		var dup bool
		err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			var err error
			dup, err = outboxriver.WithIdempotency(ctx, tx, r, outboxriver.Event{ID: id}, func(context.Context, pgx.Tx) error { runs++; return nil })
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return dup, runs
	}
	for id := int64(1); id <= 5; id++ {
		if dup, runs := apply(id); dup || runs != 1 {
			t.Fatalf("event %d: dup=%v runs=%d", id, dup, runs)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_receipt WHERE expires_at BETWEEN now() + interval '59 minutes' AND now() + interval '61 minutes'`); n != 5 {
		t.Errorf("%d receipts with a 1 h TTL, want 5", n)
	}
	// Events 1-3 expire. An expired receipt no longer suppresses.
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_receipt SET expires_at = now() - interval '1 second' WHERE event_id <= 3`); err != nil {
		t.Fatal(err)
	}
	if dup, runs := apply(3); dup || runs != 1 {
		t.Errorf("after its TTL, event 3: dup=%v runs=%d, want the effect applied again", dup, runs)
	}
	if dup, runs := apply(4); !dup || runs != 0 {
		t.Errorf("within its TTL, event 4: dup=%v runs=%d, want suppressed", dup, runs)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_receipt SET expires_at = now() - interval '1 second' WHERE event_id <= 3`); err != nil {
		t.Fatal(err)
	}
	n, err := outboxriver.PurgeReceipts(ctx, s.Pool, 2)
	if err != nil || n != 2 {
		t.Fatalf("first purge batch: %d, %v; want 2", n, err)
	}
	n, err = outboxriver.PurgeReceipts(ctx, s.Pool, 2)
	if err != nil || n != 1 {
		t.Fatalf("second purge batch: %d, %v; want 1", n, err)
	}
	if left := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_receipt WHERE event_id IN (4, 5)`); left != 2 || pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_receipt`) != 2 {
		t.Errorf("the purge deleted live receipts")
	}
}

func TestReceiverValidation(t *testing.T) {
	t.Parallel()
	cases := map[string]outboxriver.Receiver{
		"Receiver.Name is empty": {},
		"is negative":            {Name: "x", TTL: -time.Second},
		"the limit is 128":       {Name: strings.Repeat("x", 129)},
	}
	for want, r := range cases {
		_, err := outboxriver.WithIdempotency(context.Background(), nil, r, outboxriver.Event{}, nil)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%+v: %v, want %q", r, err, want)
		}
		_, _, err = outboxriver.WithClaim(context.Background(), nil, r, outboxriver.Event{}, func(context.Context) (int, error) { return 0, nil })
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("WithClaim %+v: %v, want %q", r, err, want)
		}
	}
}
