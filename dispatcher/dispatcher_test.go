package dispatcher_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/alert"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

func testRoutes(t *testing.T) *route.Table {
	t.Helper()
	tbl, err := route.New([]route.Rule{
		{Prefix: "mail.", Queues: []string{"outbox_mail"}},
		{Prefix: "plugin.hook.", Queues: []string{"outbox_plugin-hook", "outbox_audit"}},
		{Prefix: "billing.", Queues: []string{"outbox_notification"}},
		{Prefix: "poison.", Queues: []string{"outbox_poison"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return tbl
}

// alerts collects alerts for assertions.
type alerts struct {
	mu  sync.Mutex
	got []alert.Alert
}

func (a *alerts) Alert(_ context.Context, al alert.Alert) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.got = append(a.got, al)
}

func (a *alerts) byReason(r alert.Reason) []alert.Alert {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []alert.Alert
	for _, al := range a.got {
		if al.Reason == r {
			out = append(out, al)
		}
	}
	return out
}

func start(t *testing.T, pool *pgxpool.Pool, cfg dispatcher.Config) *dispatcher.Dispatcher {
	t.Helper()
	if cfg.Routes == nil {
		cfg.Routes = testRoutes(t)
	}
	d, err := dispatcher.New(pool, cfg)
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
			t.Errorf("stop: %v", err)
		}
	})
	return d
}

func status(t *testing.T, pool *pgxpool.Pool, id int64) string {
	t.Helper()
	var s string
	if err := pool.QueryRow(context.Background(), `SELECT status::text FROM outbox_event WHERE id = $1`, id).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// assertLedger checks the exactly-once invariant: every done event has
// exactly one River job per route queue, with matching args, and nothing
// else exists.
func assertLedger(t *testing.T, pool *pgxpool.Pool, routes *route.Table) {
	t.Helper()
	ctx := context.Background()
	rows, err := pool.Query(ctx, `
		SELECT e.id, e.event_type, e.status::text, coalesce(e.river_job_ids, '{}'),
		       coalesce((SELECT array_agg(j.queue ORDER BY j.queue) FROM river_job j WHERE (j.args->>'event_id')::bigint = e.id), '{}')
		FROM outbox_event e`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		id     int64
		typ    string
		status string
		jobIDs []int64
		queues []string
	}
	all, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		err := r.Scan(&x.id, &x.typ, &x.status, &x.jobIDs, &x.queues)
		return x, err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range all {
		switch r.status {
		case "done":
			rule, _ := routes.Match(r.typ)
			want := append([]string(nil), rule.Queues...)
			sortStrings(want)
			if strings.Join(r.queues, ",") != strings.Join(want, ",") {
				t.Fatalf("event %d (%s): jobs in queues %v, want exactly %v", r.id, r.typ, r.queues, want)
			}
			if len(r.jobIDs) != len(want) {
				t.Fatalf("event %d: river_job_ids %v, want %d ids", r.id, r.jobIDs, len(want))
			}
		default:
			if len(r.queues) != 0 {
				t.Fatalf("event %d is %s but has jobs %v", r.id, r.status, r.queues)
			}
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM river_job j WHERE NOT EXISTS (SELECT 1 FROM outbox_event e WHERE e.id = (j.args->>'event_id')::bigint)`); n != 0 {
		t.Fatalf("%d River jobs belong to no event", n)
	}
}

func sortStrings(s []string) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

func TestWakeHandsOffLongBeforePoll(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	d, batches := startReporting(t, s, time.Minute)
	// The first pass after connecting may already have run; drain signals.
	for len(batches) > 0 {
		<-batches
	}

	idle := idleWithWakeLock(t, s)
	for i := range 3 {
		// Publish once the dispatcher is idle (it lingers after a batch,
		// longer on a busy machine): an event published while it is still
		// busy is handed off without a wake.
		pgtest.WaitFor(t, 20*time.Second, "the dispatcher idle, holding the wake lock", idle)
		id := publishOneHandedOff(t, s, batches, i)
		if st := status(t, s.Pool, id); st != "done" {
			t.Fatalf("event %d is %s", id, st)
		}
	}
	if st := d.Stats(); st.Wakes == 0 {
		t.Fatalf("stats %+v: no wake recorded", st)
	}
	assertLedger(t, s.Pool, testRoutes(t))
}

// TestNoLostWakeUnderConcurrentProducers publishes from several producers
// at random moments while the poll fallback is an hour away: every event
// must still be handed off, so the idle re-check closes the race between a
// producer that skipped NOTIFY and a dispatcher going to sleep.
func TestNoLostWakeUnderConcurrentProducers(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 20})
	d := start(t, s.Pool, dispatcher.Config{PollInterval: time.Hour, Concurrency: 2})
	pgtest.WaitFor(t, 10*time.Second, "listener to connect", d.ListenerConnected)

	const producers, each = 4, 150
	var wg sync.WaitGroup
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(p), 7))
			for i := range each {
				// Not pgtest.Publish: t.Fatal must not run outside the
				// test's goroutine. Report and stop this producer.
				err := pgx.BeginFunc(context.Background(), s.Pool, func(tx pgx.Tx) error {
					_, err := outbox.Publish(context.Background(), tx, outbox.Event{Type: "billing.invoice.paid", Payload: json.RawMessage(fmt.Sprintf(`{"p":%d,"i":%d}`, p, i))})
					return err
				})
				if err != nil {
					t.Errorf("producer %d, event %d: %v", p, i, err)
					return
				}
				if r.IntN(4) == 0 {
					time.Sleep(time.Duration(r.IntN(3000)) * time.Microsecond)
				}
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	pgtest.WaitFor(t, 30*time.Second, "all events handed off without polling", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'pending'`) == 0
	})
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'done'`); n != producers*each {
		t.Fatalf("%d done, want %d", n, producers*each)
	}
	if st := d.Stats(); st.Polls != 0 {
		t.Fatalf("a poll tick ran (%+v): the test did not exercise the wake path alone", st)
	}
	assertLedger(t, s.Pool, testRoutes(t))
}

func TestPollOnlyModeDelivers(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	d := start(t, s.Pool, dispatcher.Config{PollInterval: 100 * time.Millisecond, ListenDisabled: true})
	// Publish only once the dispatcher is idle between ticks, so that the
	// delivery below can only come from a poll.
	pgtest.WaitFor(t, 10*time.Second, "a first poll tick", func() bool { return d.Stats().Polls > 0 })
	polls := d.Stats().Polls
	ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcome"}, outbox.Event{Type: "billing.invoice.paid"})
	pgtest.WaitFor(t, 10*time.Second, "poll-only handoff", func() bool {
		return status(t, s.Pool, ids[0]) == "done" && status(t, s.Pool, ids[1]) == "done"
	})
	if d.ListenerConnected() {
		t.Fatal("poll-only mode has a listener")
	}
	if d.Stats().Polls <= polls || d.Stats().Wakes != 0 {
		t.Fatalf("stats %+v: want a poll since publishing and no wake", d.Stats())
	}
	assertLedger(t, s.Pool, testRoutes(t))
}

func TestListenerReconnectsAfterTermination(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	d := start(t, s.Pool, dispatcher.Config{PollInterval: time.Hour, ReconnectDelay: 100 * time.Millisecond})
	pgtest.WaitFor(t, 10*time.Second, "listener to connect", d.ListenerConnected)

	admin := pgtest.Admin(t)
	ctx := context.Background()
	listenerPIDs := func() []int32 {
		rows, err := admin.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query ILIKE 'listen%'`, s.Name)
		if err != nil {
			t.Fatal(err)
		}
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			t.Fatal(err)
		}
		return pids
	}
	var pids []int32
	pgtest.WaitFor(t, 10*time.Second, "the LISTEN backend", func() bool { pids = listenerPIDs(); return len(pids) > 0 })

	for round := range 2 {
		for _, pid := range pids {
			if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
				t.Fatal(err)
			}
		}
		// Publish while the listener is (probably) down: the notification is
		// lost, so the claim pass after reconnect must find the event.
		ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(fmt.Sprintf(`{"round":%d}`, round))})
		pgtest.WaitFor(t, 15*time.Second, "handoff after reconnect", func() bool { return status(t, s.Pool, ids[0]) == "done" })
		pgtest.WaitFor(t, 15*time.Second, "a new LISTEN backend", func() bool {
			now := listenerPIDs()
			return len(now) > 0 && now[0] != pids[0]
		})
		pids = listenerPIDs()
	}
	pgtest.WaitFor(t, 10*time.Second, "listener connected", d.ListenerConnected)
	// And the wake path works again after the reconnects.
	ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcome"})
	pgtest.WaitFor(t, 30*time.Second, "wake after reconnect", func() bool { return status(t, s.Pool, ids[0]) == "done" })
	if d.Stats().Polls != 0 {
		t.Fatal("a poll tick ran; the test must show recovery without polling")
	}
}

func TestThreeDispatchersExactlyOnce(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("slow")
	}
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 40})
	const n = 10000
	events := make([]outbox.Event, 0, n)
	for i := range n {
		typ := "mail.user.welcome"
		if i%10 == 0 {
			typ = "plugin.hook.workflow.executed" // fans out to two queues
		}
		events = append(events, outbox.Event{Type: typ, Payload: json.RawMessage(fmt.Sprintf(`{"i":%d}`, i))})
	}
	for i := 0; i < n; i += 2000 {
		pgtest.Publish(t, s.Pool, events[i:i+2000]...)
	}
	routes := testRoutes(t)
	for range 3 {
		start(t, s.Pool, dispatcher.Config{Routes: routes, Concurrency: 4, BatchSize: 100, PollInterval: 200 * time.Millisecond})
	}
	pgtest.WaitFor(t, 120*time.Second, "drain of 10,000 events by 3 dispatchers", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status <> 'done'`) == 0
	})
	if got, want := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job`), n+n/10; got != want {
		t.Fatalf("%d River jobs, want %d", got, want)
	}
	if dup := pgtest.Count(t, s.Pool, `SELECT count(*) FROM (SELECT args->>'event_id', queue FROM river_job GROUP BY 1, 2 HAVING count(*) > 1) d`); dup != 0 {
		t.Fatalf("%d (event, queue) pairs have more than one job", dup)
	}
	assertLedger(t, s.Pool, routes)
}

func TestUnroutableFailsAtOnceAndAlerts(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	al := &alerts{}
	start(t, s.Pool, dispatcher.Config{Alerter: al, PollInterval: 100 * time.Millisecond})
	ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "nothing.routes.this", TenantID: "t9"}, outbox.Event{Type: "mail.user.welcome"})
	pgtest.WaitFor(t, 10*time.Second, "unroutable event failed", func() bool { return status(t, s.Pool, ids[0]) == "failed" })
	pgtest.WaitFor(t, 10*time.Second, "routable event done", func() bool { return status(t, s.Pool, ids[1]) == "done" })
	var lastErr string
	if err := s.Pool.QueryRow(context.Background(), `SELECT last_error FROM outbox_event WHERE id = $1`, ids[0]).Scan(&lastErr); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(lastErr, "no route matches event type nothing.routes.this") {
		t.Fatalf("last_error = %q", lastErr)
	}
	pgtest.WaitFor(t, 30*time.Second, "unroutable alert", func() bool { return len(al.byReason(alert.Unroutable)) == 1 })
	a := al.byReason(alert.Unroutable)[0]
	if a.EventID != ids[0] || a.EventType != "nothing.routes.this" || a.TenantID != "t9" {
		t.Fatalf("alert = %+v", a)
	}
	assertLedger(t, s.Pool, testRoutes(t))
}

func TestFanOut(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	start(t, s.Pool, dispatcher.Config{PollInterval: 100 * time.Millisecond})
	ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "plugin.hook.workflow.executed", Payload: json.RawMessage(`{"w":1}`), DispatchKey: "fan:1", TenantID: "t1"})
	pgtest.WaitFor(t, 10*time.Second, "fan-out handoff", func() bool { return status(t, s.Pool, ids[0]) == "done" })
	rows, err := s.Pool.Query(context.Background(), `SELECT queue, kind, args FROM river_job ORDER BY queue`)
	if err != nil {
		t.Fatal(err)
	}
	type job struct {
		queue, kind string
		args        map[string]any
	}
	jobs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (job, error) {
		var j job
		err := r.Scan(&j.queue, &j.kind, &j.args)
		return j, err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 2 || jobs[0].queue != "outbox_audit" || jobs[1].queue != "outbox_plugin-hook" {
		t.Fatalf("jobs = %+v", jobs)
	}
	for _, j := range jobs {
		if j.kind != "outbox_event" || j.args["event_id"] != float64(ids[0]) || j.args["event_type"] != "plugin.hook.workflow.executed" ||
			j.args["tenant_id"] != "t1" || j.args["dispatch_key"] != "fan:1" {
			t.Fatalf("job args = %+v", j)
		}
		if p, ok := j.args["payload"].(map[string]any); !ok || p["w"] != float64(1) {
			t.Fatalf("payload = %v", j.args["payload"])
		}
	}
	assertLedger(t, s.Pool, testRoutes(t))
}

func TestStaleProcessingRowsAreRescued(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	ids := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcome"}, outbox.Event{Type: "mail.user.welcome"}, outbox.Event{Type: "mail.user.welcome"})
	// As if a crashed worker of another tool had left them mid-flight: one
	// lock expired, one still valid, one without a lock time at all.
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'processing', locked_until = now() - interval '1 minute' WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'processing', locked_until = NULL WHERE id = $1`, ids[2]); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'processing', locked_until = now() + interval '1 hour' WHERE id = $1`, ids[1]); err != nil {
		t.Fatal(err)
	}
	d := start(t, s.Pool, dispatcher.Config{PollInterval: 100 * time.Millisecond})
	pgtest.WaitFor(t, 10*time.Second, "stale row handed off", func() bool { return status(t, s.Pool, ids[0]) == "done" })
	pgtest.WaitFor(t, 10*time.Second, "processing row without locked_until handed off", func() bool { return status(t, s.Pool, ids[2]) == "done" })
	// Three more rescue passes (one per poll tick) must leave the live lock alone.
	polls := d.Stats().Polls
	pgtest.WaitFor(t, 10*time.Second, "three more poll ticks", func() bool { return d.Stats().Polls >= polls+3 })
	if st := status(t, s.Pool, ids[1]); st != "processing" {
		t.Fatalf("event with a live lock is %s, want processing", st)
	}
}

func TestStopFinishesInFlightAndLeavesConsistentState(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 20})
	evs := make([]outbox.Event, 3000)
	for i := range evs {
		evs[i] = outbox.Event{Type: "mail.user.welcome"}
	}
	pgtest.Publish(t, s.Pool, evs...)
	batches := make(chan claim.Result, 1000)
	d, err := dispatcher.New(s.Pool, dispatcher.Config{Routes: testRoutes(t), BatchSize: 50, Concurrency: 3,
		OnBatch: func(r claim.Result) { batches <- r }})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-batches // a drain is under way
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if d.Running() {
		t.Fatal("still running after Stop")
	}
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	done := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'done'`)
	pending := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'pending'`)
	if done+pending != len(evs) || done == 0 {
		t.Fatalf("done=%d pending=%d after stop, want all accounted for and some done", done, pending)
	}
	if done%50 != 0 {
		t.Fatalf("done=%d is not a whole number of 50-event batches: a batch was cut short", done)
	}
	assertLedger(t, s.Pool, testRoutes(t))
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true})
	cases := []struct {
		cfg  dispatcher.Config
		want string
	}{
		{dispatcher.Config{}, "Routes is required"},
		{dispatcher.Config{Routes: testRoutes(t), BatchSize: -1}, "BatchSize"},
		{dispatcher.Config{Routes: testRoutes(t), Concurrency: 5000}, "Concurrency"},
		{dispatcher.Config{Routes: testRoutes(t), PollInterval: time.Microsecond}, "PollInterval"},
	}
	for _, c := range cases {
		_, err := dispatcher.New(s.Pool, c.cfg)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New(%+v) err = %v, want %q", c.cfg, err, c.want)
		}
	}
	// An unmigrated schema is refused at Start with a hint.
	d, err := dispatcher.New(s.Pool, dispatcher.Config{Routes: testRoutes(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err == nil || !strings.Contains(err.Error(), "outboxctl migrate") {
		t.Fatalf("Start on an unmigrated schema: err = %v", err)
	}
}

// TestAdaptiveDrainStaysWithinConcurrency: a parallel drain starts with two
// batches in flight (one when Concurrency is 1), may add more while that
// helps, never exceeds Concurrency, and hands every event off once.
func TestAdaptiveDrainStaysWithinConcurrency(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ concurrency, min int64 }{{1, 1}, {5, 2}} {
		t.Run(fmt.Sprint("concurrency ", c.concurrency), func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 20})
			ctx := context.Background()
			if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload) SELECT 'mail.user.welcome', '{}' FROM generate_series(1, 3000)`); err != nil {
				t.Fatal(err)
			}
			d := start(t, s.Pool, dispatcher.Config{BatchSize: 50, Concurrency: int(c.concurrency), DrainWindow: 20 * time.Millisecond, PollInterval: 100 * time.Millisecond})
			pgtest.WaitFor(t, 60*time.Second, "the drain", func() bool {
				return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'pending'`) == 0
			})
			if w := d.Stats().DrainWorkers; w < c.min || w > c.concurrency {
				t.Fatalf("drain settled on %d batches in flight, want %d..%d", w, c.min, c.concurrency)
			}
			if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job`); n != 3000 {
				t.Fatalf("%d jobs, want 3000", n)
			}
			assertLedger(t, s.Pool, testRoutes(t))
		})
	}
}

// startReporting starts a dispatcher with the given poll interval whose
// batches are sent to the returned channel, and waits for its listener.
func startReporting(t *testing.T, s *pgtest.Schema, poll time.Duration) (*dispatcher.Dispatcher, chan claim.Result) {
	t.Helper()
	batches := make(chan claim.Result, 16)
	d := start(t, s.Pool, dispatcher.Config{
		PollInterval: poll,
		OnBatch:      func(r claim.Result) { batches <- r },
	})
	pgtest.WaitFor(t, 10*time.Second, "listener to connect", d.ListenerConnected)
	return d, batches
}

// publishOneHandedOff publishes event i of a test and waits for the batch
// that hands it off alone (startReporting's channel); it returns its id.
func publishOneHandedOff(t *testing.T, s *pgtest.Schema, batches <-chan claim.Result, i int) int64 {
	t.Helper()
	id := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcome", Payload: json.RawMessage(fmt.Sprintf(`{"i":%d}`, i))})[0]
	select {
	case r := <-batches:
		if r.Done != 1 {
			t.Fatalf("batch handed off %d events, want 1", r.Done)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("event %d not handed off within 20s, with the poll far away: the wake path is broken", id)
	}
	return id
}

// idleWithWakeLock reports whether an idle dispatcher holds the wake lock of
// schema s.
func idleWithWakeLock(t *testing.T, s *pgtest.Schema) func() bool {
	var key int32
	if err := s.Pool.QueryRow(context.Background(), `SELECT hashtext('outbox_wake:' || $1)`, s.Name).Scan(&key); err != nil {
		t.Fatal(err)
	}
	return func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
			AND classid = 1868720215 AND objid = $1::int4::oid AND mode = 'ExclusiveLock' AND granted`, key) == 1
	}
}

// TestDelayedEventHandedOffWhenDue: events inserted by a plain INSERT with
// a future scheduled_at are handed off when due, with the poll a minute
// away: the idle dispatcher sleeps until the earliest due time. One is
// inserted while the dispatcher is idle holding the wake lock (its commit
// notifies: the dispatcher wakes, finds nothing due, and sleeps again until
// the due time), one before the dispatcher starts (its first idle reads the
// due time). Neither is handed off before its time, and the dispatcher does
// not spin while waiting.
func TestDelayedEventHandedOffWhenDue(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)
	insert := func(in time.Duration) int64 {
		var id int64
		if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, scheduled_at)
			VALUES ('mail.user.reminded', '{}', now() + make_interval(secs => $1)) RETURNING id`, in.Seconds()).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	early := insert(2 * time.Second)
	d := start(t, s.Pool, dispatcher.Config{PollInterval: time.Minute})
	pgtest.WaitFor(t, 30*time.Second, "the dispatcher idle, holding the wake lock", idleWithWakeLock(t, s))
	wakes := d.Stats().Wakes
	late := insert(3 * time.Second)
	pgtest.WaitFor(t, 10*time.Second, "the wake of the delayed event's commit", func() bool { return d.Stats().Wakes > wakes })

	// Due in 2 and 3 s; the poll would take 60 s. 10 s leaves room for a
	// loaded machine and still fails without the due timer.
	for _, id := range []int64{early, late} {
		pgtest.WaitFor(t, 10*time.Second, "the delayed event handed off when due (poll is a minute away)", func() bool {
			return status(t, s.Pool, id) == "done"
		})
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'done' AND processed_at < scheduled_at`); n != 0 {
		t.Fatalf("%d delayed events handed off before their scheduled_at", n)
	}
	st := d.Stats()
	if st.Polls != 0 {
		t.Fatalf("stats %+v: a poll tick ran; the test must show the due timer alone", st)
	}
	// One sleep per due time (and one per wake); a dispatcher that polled
	// while nothing was due would show many more.
	if st.Due < 1 || st.Due > 4 {
		t.Fatalf("stats %+v: %d sleeps ended by a due time, want 1..4", st, st.Due)
	}
	assertLedger(t, s.Pool, testRoutes(t))
}
