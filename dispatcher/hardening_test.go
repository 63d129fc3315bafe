package dispatcher_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/jsonlimit"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

// nested returns a JSON document nested depth levels deep: [[...[]...]].
func nested(depth int) string {
	return strings.Repeat("[", depth) + strings.Repeat("]", depth)
}

// TestDeepPayloadIsDeadLetteredAndDoesNotStall: a row nested 10,001 levels
// deep (Postgres accepts it; encoding/json refuses it), written by a plain
// INSERT first in claim order, used to fail every claim forever. It must be
// dead-lettered with a last_error naming the rule while the events behind
// it are handed off; a payload exactly at the depth limit is handed off and
// a real River worker decodes its args.
func TestDeepPayloadIsDeadLetteredAndDoesNotStall(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)

	var poison int64
	err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, scheduled_at)
		VALUES ('mail.deep.sent', $1::jsonb, now() - interval '1 hour') RETURNING id`, nested(10001)).Scan(&poison)
	if err != nil {
		t.Fatal(err)
	}
	ids := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "mail.user.welcomed", Payload: json.RawMessage(`{"n":1}`)},
		outbox.Event{Type: "mail.limit.sent", Payload: json.RawMessage(nested(jsonlimit.MaxDepth))},
		outbox.Event{Type: "mail.user.welcomed", Payload: json.RawMessage(`{"n":2}`)},
	)

	// A real worker on the mail queue decodes the args of what it gets.
	decoded := make(chan int, 10)
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(_ context.Context, job *river.Job[outboxriver.EventArgs]) error {
		decoded <- len(job.Args.Payload)
		return nil
	}))
	rc, err := river.NewClient(riverpgxv5.New(s.Pool), &river.Config{
		Queues:            map[string]river.QueueConfig{"outbox_mail": {MaxWorkers: 2}},
		Workers:           workers,
		FetchPollInterval: 50 * time.Millisecond,
		FetchCooldown:     10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Stop(context.Background()) })

	al := &alerts{}
	start(t, s.Pool, dispatcher.Config{Alerter: al, PollInterval: 100 * time.Millisecond})

	pgtest.WaitFor(t, 30*time.Second, "the events behind the deep row handed off", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND status = 'done'`, ids) == len(ids)
	})
	var st, lastErr string
	if err := s.Pool.QueryRow(ctx, `SELECT status::text, coalesce(last_error, '') FROM outbox_event WHERE id = $1`, poison).Scan(&st, &lastErr); err != nil {
		t.Fatal(err)
	}
	if st != "failed" || !strings.Contains(lastErr, "nested deeper than 1000 levels") {
		t.Fatalf("deep row: status %s, last_error %q; want failed naming the depth rule", st, lastErr)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE (args->>'event_id')::bigint = $1`, poison); n != 0 {
		t.Fatalf("deep row got %d River jobs", n)
	}
	if got := al.byReason(alert.DeadLetter); len(got) != 1 || got[0].EventID != poison {
		t.Fatalf("dead-letter alerts %+v, want one for event %d", got, poison)
	}
	want := len(nested(jsonlimit.MaxDepth))
	deadline := time.After(30 * time.Second)
	for seen := 0; seen < 3; seen++ {
		select {
		case n := <-decoded:
			if n == want {
				return
			}
		case <-deadline:
			t.Fatal("no worker decoded the job of the payload at the depth limit")
		}
	}
	t.Fatal("no worker decoded the job of the payload at the depth limit")
}
