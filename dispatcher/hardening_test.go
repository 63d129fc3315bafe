package dispatcher_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/jsonlimit"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/internal/proctest"
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
	// A row stored before the payload rule existed (or by a writer that
	// bypassed it): today's guard trigger would refuse it.
	pgtest.AllowAnyPayload(t, s.Pool)

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
	// The alert follows the commit that dead-letters the row.
	pgtest.WaitFor(t, 30*time.Second, "the dead-letter alert", func() bool { return len(al.byReason(alert.DeadLetter)) > 0 })
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

// wakeKeySQL computes the wake lock's second key as the trigger does.
const wakeKeySQL = `SELECT hashtext('outbox_wake:' || $1)`

// TestSlowCommitDoesNotLoseTheWake: a producer whose commit holds the wake
// key shared for 4 s while the dispatcher goes idle used to make the
// dispatcher's lock attempt time out, read that as "another dispatcher is
// idle" and sleep without the lock: the event waited for the poll (60 s
// here). It must be handed off right after that commit.
func TestSlowCommitDoesNotLoseTheWake(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)

	producer, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = producer.Close(context.Background()) })
	var key int32
	if err := producer.QueryRow(ctx, wakeKeySQL, s.Name).Scan(&key); err != nil {
		t.Fatal(err)
	}

	var (
		// armed counts down the batches until the one to act on.
		armed   atomic.Int32
		slowID  atomic.Int64
		slowTx  pgx.Tx
		attempt = make(chan bool, 1)
	)
	onBatch := func(claim.Result) {
		// A batch is done and the dispatcher is about to look once more and
		// go idle: a producer starts its (slow) commit now, holding the wake
		// key shared, as the wake trigger does at commit time. Each try
		// publishes two events and the batches take one each: the first is
		// handed off by the woken dispatcher with the wake lock still held
		// (state armed), and, that batch being full, the second by a drain
		// that releases it. Act on the second.
		if armed.Add(-1) != 0 {
			return
		}
		ok := false
		defer func() { attempt <- ok }()
		tx, err := producer.Begin(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		res, err := outbox.Publish(ctx, tx, outbox.Event{Type: "mail.user.welcomed", Payload: json.RawMessage(`{}`)})
		if err != nil {
			t.Error(err)
			return
		}
		// Waits until the draining dispatcher has released the lock. If the
		// batch was the re-check of a dispatcher holding the lock, it is
		// never released while this callback runs: give up and try again.
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '2s'`); err != nil {
			t.Error(err)
			return
		}
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock_shared(1868720215, $1)`, key); err != nil {
			_ = tx.Rollback(ctx)
			return
		}
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = 0`); err != nil {
			t.Error(err)
			return
		}
		slowID.Store(res.ID)
		slowTx, ok = tx, true
	}
	start(t, s.Pool, dispatcher.Config{PollInterval: time.Minute, BatchSize: 1, OnBatch: onBatch})
	idle := func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
			AND classid = 1868720215 AND objid = $1::int4::oid AND mode = 'ExclusiveLock' AND granted`, key) == 1
	}
	for try := 0; ; try++ {
		if try == 5 {
			t.Fatal("the producer never took the wake key shared after a batch")
		}
		pgtest.WaitFor(t, 30*time.Second, "the dispatcher idle, holding the wake lock", idle)
		armed.Store(2)
		ev := outbox.Event{Type: "mail.user.welcomed", Payload: json.RawMessage(`{}`)}
		pgtest.Publish(t, s.Pool, ev, ev)
		var ok bool
		select {
		case ok = <-attempt:
		case <-ctx.Done():
			t.Fatal("no batch ran")
		}
		if t.Failed() {
			t.FailNow()
		}
		if ok {
			break
		}
	}
	held := time.Now()
	pgtest.WaitFor(t, 20*time.Second, "the dispatcher queued for the wake key", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
			AND classid = 1868720215 AND objid = $1::int4::oid AND mode = 'ExclusiveLock' AND NOT granted`, key) == 1
	})
	// Meanwhile another producer commits: the dispatcher, queued for the
	// key, makes it notify, and must not be stuck behind the slow commit.
	// The slow transaction stays open until this event is handed off, so
	// the deadline (generous, below the 60 s poll) only bounds a failure.
	other := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcomed", Payload: json.RawMessage(`{}`)})[0]
	pgtest.WaitFor(t, 30*time.Second, "an event committed during the slow commit handed off while it is still open", func() bool {
		return status(t, s.Pool, other) == "done"
	})
	// The slow commit takes at least 4 s (a slow fsync, a synchronous
	// replica): the fault's duration, not a wait for a signal.
	time.Sleep(time.Until(held.Add(4 * time.Second)))
	if err := slowTx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	committed := time.Now()
	pgtest.WaitFor(t, 30*time.Second, "the event behind the slow commit handed off (poll is 60 s)", func() bool {
		return status(t, s.Pool, slowID.Load()) == "done"
	})
	// A figure, not an assertion (docs/reliability.md quotes it).
	t.Logf("handed off %s after the slow commit (slow commit held the wake key %s)", time.Since(committed).Round(time.Millisecond), committed.Sub(held).Round(time.Millisecond))
}

// TestWakeWithUserSchemaFirstInSearchPath: with search_path "$user", <outbox
// schema> and a schema named after the connecting role, current_schema() is
// the role's schema while the trigger keys on the outbox schema. The
// dispatcher used to hold the wrong key and filter the wrong payload, and
// never woke; it must wake on NOTIFY with the poll a minute away.
func TestWakeWithUserSchemaFirstInSearchPath(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)
	admin := pgtest.Admin(t)

	role := "u_" + s.Name[2:]
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN SUPERUSER; CREATE SCHEMA `+role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		_, _ = admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, role)
		if _, err := admin.Exec(ctx, `DROP SCHEMA `+role+` CASCADE; DROP ROLE `+role); err != nil {
			t.Logf("drop role %s: %v", role, err)
		}
	})
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = role
	cfg.ConnConfig.RuntimeParams["search_path"] = `"$user", ` + s.Name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var cur string
	if err := pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&cur); err != nil || cur != role {
		t.Fatalf("current_schema() = %q, %v; the test needs the role's schema first", cur, err)
	}

	d := start(t, pool, dispatcher.Config{PollInterval: time.Minute})
	pgtest.WaitFor(t, 30*time.Second, "the dispatcher idle", func() bool { return d.ListenerConnected() })
	// Idle: the re-check after taking the wake lock has run once.
	var key int32
	if err := s.Pool.QueryRow(ctx, wakeKeySQL, s.Name).Scan(&key); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, 30*time.Second, "the dispatcher holding the outbox schema's wake key", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
			AND classid = 1868720215 AND objid = $1::int4::oid AND granted`, key) == 1
	})
	id := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcomed", Payload: json.RawMessage(`{}`)})[0]
	pgtest.WaitFor(t, 20*time.Second, "the event handed off on NOTIFY (poll is a minute away)", func() bool {
		return status(t, s.Pool, id) == "done"
	})
}

// TestStartRefusesWithoutOutboxTable: a search_path without outbox_event
// is refused with a message that names it.
func TestStartRefusesWithoutOutboxTable(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = "pg_temp"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	d, err := dispatcher.New(pool, dispatcher.Config{Routes: testRoutes(t)})
	if err != nil {
		t.Fatal(err)
	}
	err = d.Start(context.Background())
	if err == nil || !strings.Contains(err.Error(), "no table outbox_event in search_path") {
		t.Fatalf("Start: %v; want a refusal naming outbox_event and the search_path", err)
	}
}

// TestWarnsWhenWorkersMayCommitAsynchronously: a dispatcher whose sessions
// run with synchronous_commit=off (as River workers on the same settings
// would) warns loudly and alerts at start-up, since the asynchronous handoff
// is exactly-once only while workers commit synchronously.
func TestWarnsWhenWorkersMayCommitAsynchronously(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	logs := &proctest.SyncBuffer{}
	al := &alerts{}
	start(t, pool, dispatcher.Config{Alerter: al, Logger: slog.New(slog.NewTextHandler(logs, nil)), ListenDisabled: true})
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "synchronous_commit is off for this session") {
		t.Fatalf("no warning about synchronous_commit in:\n%s", logs.String())
	}
	if got := al.byReason(alert.SynchronousCommitOff); len(got) != 1 {
		t.Fatalf("alerts %+v, want one %s", got, alert.SynchronousCommitOff)
	}

	// With the handoff committing synchronously there is nothing to warn about.
	logs2 := &proctest.SyncBuffer{}
	start(t, pool, dispatcher.Config{Logger: slog.New(slog.NewTextHandler(logs2, nil)), ListenDisabled: true, SynchronousCommit: true})
	if strings.Contains(logs2.String(), "synchronous_commit is") {
		t.Fatalf("warned although the handoff commits synchronously:\n%s", logs2.String())
	}
}

// TestHandoffThatAlwaysTimesOutIsChargedToItsEvent: an event whose River
// insert always blocks used to time its batch out forever, treated as the
// database's fault: it and every event in its batch stalled. The batch is
// now retried event by event, the others are handed off, and after
// claim.TimeoutsBeforeCharge lone timeouts the slow event is charged a
// failed attempt (retries+1, backoff, last_error).
func TestHandoffThatAlwaysTimesOutIsChargedToItsEvent(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)
	_, err := s.Pool.Exec(ctx, `
		CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.args->>'event_type' = 'poison.slow.sent' THEN
				PERFORM pg_sleep(60);
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER slow_insert BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION slow_insert();`)
	if err != nil {
		t.Fatal(err)
	}
	slow := pgtest.Publish(t, s.Pool, outbox.Event{Type: "poison.slow.sent", Payload: json.RawMessage(`{}`)})[0]
	others := pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "mail.user.welcomed", Payload: json.RawMessage(`{}`)},
		outbox.Event{Type: "mail.user.welcomed", Payload: json.RawMessage(`{}`)})

	start(t, s.Pool, dispatcher.Config{BatchTimeout: time.Second, PollInterval: 100 * time.Millisecond})
	pgtest.WaitFor(t, 30*time.Second, "the events batched with the slow one handed off", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND status = 'done'`, others) == len(others)
	})
	pgtest.WaitFor(t, 60*time.Second, "the slow event charged a failed attempt", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT retries FROM outbox_event WHERE id = $1`, slow) == 1
	})
	var st, lastErr string
	var later bool
	if err := s.Pool.QueryRow(ctx, `SELECT status::text, last_error, scheduled_at > now() FROM outbox_event WHERE id = $1`, slow).Scan(&st, &lastErr, &later); err != nil {
		t.Fatal(err)
	}
	if st != "pending" || !later || !strings.Contains(lastErr, "timed out 3 times in a row") {
		t.Fatalf("slow event: status %s, rescheduled %v, last_error %q", st, later, lastErr)
	}
}
