package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// budget is a scenario's overall deadline: generous, a backstop against a
// hang, never an assertion about speed.
func budget() time.Duration {
	if long() {
		return 60 * time.Minute
	}
	return 5 * time.Minute
}

// settle is how long the dispatchers get, once the faults stop, to leave
// nothing pending.
const settle = 90 * time.Second

// TestChaosKill9Dispatchers runs two to four outboxd processes and SIGKILLs
// one of them again and again while producers publish and the others drain
// a backlog; a replacement starts after each kill. Nothing may be lost or
// handed off twice.
func TestChaosKill9Dispatchers(t *testing.T) {
	t.Parallel()
	start := time.Now()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, budget())
	n := events("kill9")
	nd := 3
	kills := envInt("CHAOS_KILLS", 4)
	if long() {
		nd, kills = 4, envInt("CHAOS_KILLS", 24)
	}
	pw := secret()
	env := daemonEnv(withPassword(s.URL, pw), routesFile(t), "OUTBOX_DISPATCH_CONCURRENCY=3")
	pool := producerPool(t, s.URL, 4)
	run := "kill9"

	// A backlog first, so that the kills land mid-drain.
	backlog := &producers{pool: pool, run: run, n: n / 2, batch: 50, workers: 3}
	<-backlog.start(ctx)
	rest := &producers{pool: pool, run: run, from: n / 2, n: n, batch: 20, workers: 2}
	var all []*daemon
	live := make([]*daemon, nd)
	for i := range live {
		live[i] = startDaemon(t, env)
		all = append(all, live[i])
	}
	producing := rest.start(ctx)
	for k := range kills {
		// Kill at evenly spaced points of the drain, by progress.
		target := (k + 1) * n / (kills + 2)
		if !waitDone(ctx, s.Pool, run, target, 2*time.Minute) {
			t.Fatalf("kill %d: the drain never reached %d done events", k+1, target)
		}
		i := rand.IntN(nd)
		live[i].kill9()
		live[i] = startDaemon(t, env)
		// Started, so that the next kill (or the final SIGTERM) hits a
		// running dispatcher, not one still starting up.
		live[i].waitLog(t, "outbox dispatcher started", time.Minute)
		all = append(all, live[i])
	}
	<-producing
	verify(t, ctx, s.Pool, &ledger{run: run, n: n}, report{Scenario: "kill9", Faults: kills, Elapsed: time.Since(start),
		Note: fmt.Sprintf("%d dispatchers, %d kill -9", nd, kills)}, settle, all...)
	for i, d := range live {
		if code := d.stop(60 * time.Second); code != 0 {
			t.Errorf("dispatcher %d: exit %d after SIGTERM:\n%s", i, code, tail(d.out.String(), 2000))
		}
	}
	noSecret(t, pw, all...)
}

// TestChaosTerminateBackends terminates, again and again, the listener
// connections and the connections running claim transactions of two
// outboxd processes while producers publish. The daemons must recover by
// themselves: reconnect the listener, roll back and retry the batches.
func TestChaosTerminateBackends(t *testing.T) {
	t.Parallel()
	start := time.Now()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, budget())
	n := events("terminate")
	pw := secret()
	env := daemonEnv(withPassword(s.URL, pw), routesFile(t))
	d1, d2 := startDaemon(t, env), startDaemon(t, env)
	d1.waitLog(t, "outbox listener connected", time.Minute)
	d2.waitLog(t, "outbox listener connected", time.Minute)
	admin := pgtest.Admin(t)
	pool := producerPool(t, s.URL, 4)
	run := "terminate"

	p := &producers{pool: pool, run: run, n: n, batch: 10, workers: 3}
	producing := p.start(ctx)
	// The listener's session: its last statement is a LISTEN, or, once a
	// heartbeat has come back, the read-only check the listener runs on
	// each pong (package listener). Matching LISTEN alone found no
	// listener once the first heartbeat had come back, and a slow drain
	// then faulted until the test's budget ran out.
	const listenQ = `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = $1 AND pid <> pg_backend_pid() AND xact_start IS NULL
		  AND (query ILIKE 'listen%' OR query ILIKE 'SHOW transaction_read_only%')`
	// Claim transactions: in a transaction (active or idle in it) and not
	// the listener or the wake lock's session.
	const claimQ = `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = $1 AND pid <> pg_backend_pid()
		  AND xact_start IS NOT NULL AND query NOT ILIKE 'listen%' AND query NOT ILIKE '%advisory%'
		  AND (query ILIKE '%SKIP LOCKED%' OR query ILIKE '%river_job%' OR query ILIKE '%outbox_event e%' OR state = 'idle in transaction')`
	var listeners, claims int
	minFaults := 6
	if long() {
		minFaults = 40
	}
	for ctx.Err() == nil {
		select {
		case <-producing:
			if listeners >= minFaults && claims >= minFaults {
				goto verify
			}
			// Keep faulting through the drain of what is left; once the
			// backlog is gone, publish a little more to fault against.
			if left, _ := settledCount(ctx, s.Pool, run); left == 0 {
				goto verify
			}
		default:
		}
		var k int
		if err := admin.QueryRow(ctx, claimQ, s.Name).Scan(&k); err != nil {
			t.Fatal(err)
		}
		claims += k
		if (claims+listeners)%3 == 0 || k == 0 {
			if err := admin.QueryRow(ctx, listenQ, s.Name).Scan(&k); err != nil {
				t.Fatal(err)
			}
			listeners += k
		}
		time.Sleep(15 * time.Millisecond) // fault cadence
	}
verify:
	if claims == 0 || listeners == 0 {
		t.Errorf("the fault never hit: %d claim and %d listener backends terminated", claims, listeners)
	}
	verify(t, ctx, s.Pool, &ledger{run: run, n: n}, report{Scenario: "terminate", Faults: claims + listeners, Elapsed: time.Since(start),
		Note: fmt.Sprintf("%d claim + %d listener backends terminated", claims, listeners)}, settle, d1, d2)
	// Recovery: each daemon's listener is connected again.
	for i, d := range []*daemon{d1, d2} {
		if c := strings.Count(d.out.String(), "outbox listener connected"); listeners > 0 && c < 2 {
			t.Logf("dispatcher %d: listener connected %d time(s)", i, c)
		}
	}
	for _, d := range []*daemon{d1, d2} {
		if !d.alive() {
			t.Errorf("a dispatcher exited:\n%s", tail(d.out.String(), 2000))
		}
	}
	noSecret(t, pw, d1, d2)
}

// TestChaosPostgresRestart restarts the server under two dispatchers and
// retrying producers: once with a fast shutdown, once with an immediate
// one (a crash: recovery replays the WAL). Producers retry a batch whose
// commit failed; its dispatch keys make the retry idempotent.
func TestChaosPostgresRestart(t *testing.T) {
	t.Parallel()
	start := time.Now()
	c := startCluster(t)
	pool, url := c.schema(t, "chaos_restart")
	ctx := pgtest.Context(t, budget())
	n := events("pg-restart")
	pw := secret()
	env := daemonEnv(withPassword(url, pw), routesFile(t), "OUTBOX_DISPATCH_TIMEOUT_MS=5000")
	d1, d2 := startDaemon(t, env), startDaemon(t, env)
	d1.waitLog(t, "outbox listener connected", time.Minute)
	run := "restart"
	p := &producers{pool: producerPool(t, url, 4), run: run, n: n, batch: 5, workers: 2}
	producing := p.start(ctx)
	modes := []string{"fast", "immediate"}
	if long() {
		modes = []string{"fast", "immediate", "fast", "immediate", "immediate", "fast"}
	}
	for i, mode := range modes {
		target := int64((i + 1) * n / (len(modes) + 1))
		for p.committed.Load() < target && ctx.Err() == nil {
			time.Sleep(10 * time.Millisecond)
		}
		c.restart(t, mode, time.Second)
	}
	<-producing
	verify(t, ctx, pool, &ledger{run: run, n: n}, report{Scenario: "pg-restart", Faults: len(modes), Elapsed: time.Since(start),
		Note: fmt.Sprintf("restarts %s; %d producer retries", strings.Join(modes, ","), p.errors.Load())}, settle, d1, d2)
	for i, d := range []*daemon{d1, d2} {
		if !d.alive() {
			t.Errorf("dispatcher %d exited after the restart:\n%s", i, tail(d.out.String(), 2000))
		}
		if !strings.Contains(d.out.String(), "outbox dispatch pass failed") && !strings.Contains(d.out.String(), "outbox listener disconnected") {
			t.Errorf("dispatcher %d never noticed the restart:\n%s", i, tail(d.out.String(), 2000))
		}
	}
	// The daemons' runtime errors (dial errors, terminated connections,
	// listener reconnects) never print the password.
	noSecret(t, pw, d1, d2)
}

// TestChaosClaimTimeouts forces the claim transaction into a lock wait: a
// session takes outbox_event in EXCLUSIVE mode (which FOR UPDATE must wait
// for) again and again. One daemon runs with lock_timeout, the other with
// statement_timeout; both must fail those passes, back off and recover.
func TestChaosClaimTimeouts(t *testing.T) {
	t.Parallel()
	start := time.Now()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, budget())
	n := events("claim-timeouts")
	routes := routesFile(t)
	dl := startDaemon(t, daemonEnv(s.URL+"&lock_timeout=100ms", routes))
	ds := startDaemon(t, daemonEnv(s.URL+"&statement_timeout=400ms", routes))
	run := "timeouts"
	pool := producerPool(t, s.URL, 4)
	p := &producers{pool: pool, run: run, n: n, batch: 10, workers: 2}
	producing := p.start(ctx)

	locks := 0
	minLocks := 4
	if long() {
		minLocks = 20
	}
	for ctx.Err() == nil {
		select {
		case <-producing:
			if locks >= minLocks {
				goto verify
			}
		default:
		}
		before := doneCount(ctx, s.Pool, run)
		tx, err := s.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE outbox_event IN EXCLUSIVE MODE`); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second) // the lock is the fault; hold it past both timeouts
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		locks++
		// Let the dispatchers make progress before the next lock.
		for doneCount(ctx, s.Pool, run) == before && ctx.Err() == nil {
			if left, _ := settledCount(ctx, s.Pool, run); left == 0 && p.committed.Load() == int64(n) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
verify:
	verify(t, ctx, s.Pool, &ledger{run: run, n: n}, report{Scenario: "claim-timeouts", Faults: locks, Elapsed: time.Since(start),
		Note: fmt.Sprintf("%d one-second EXCLUSIVE locks; lock_timeout and statement_timeout daemons", locks)}, settle, dl, ds)
	if !strings.Contains(dl.out.String(), "lock timeout") {
		t.Errorf("the lock_timeout daemon never hit its timeout:\n%s", tail(dl.out.String(), 2000))
	}
	if !strings.Contains(ds.out.String(), "statement timeout") {
		t.Errorf("the statement_timeout daemon never hit its timeout:\n%s", tail(ds.out.String(), 2000))
	}
	// Every event was handed off on its first successful attempt: a
	// timed-out claim is not the events' fault.
	var charged int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE starts_with(dispatch_key, $1) AND retries > 0 AND status = 'done'`, run+":").Scan(&charged); err != nil {
		t.Fatal(err)
	}
	if charged > 0 {
		t.Errorf("%d events were charged a failed attempt for a claim timeout", charged)
	}
}

// TestChaosRollbackProducers mixes committing producers with producers
// that publish and then roll back (the whole transaction, or a savepoint
// inside a transaction that commits). Rolled-back events must never be
// stored nor dispatched; the committed ones all must.
func TestChaosRollbackProducers(t *testing.T) {
	t.Parallel()
	start := time.Now()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, budget())
	n := events("rollback")
	d := startDaemon(t, daemonEnv(s.URL, routesFile(t)))
	d.waitLog(t, "outbox listener connected", time.Minute)
	run := "rollback"
	pool := producerPool(t, s.URL, 6)
	p := &producers{pool: pool, run: run, n: n, batch: 10, workers: 2}
	producing := p.start(ctx)

	l := &ledger{run: run, n: n}
	var rolled atomic.Int64
	type result struct {
		keys []string
		ids  []int64
	}
	results := make(chan result, 2)
	for w := range 2 {
		go func() {
			var r result
			defer func() { results <- r }()
			for j := 0; ; j++ {
				select {
				case <-producing:
					return
				default:
				}
				evs := make([]outbox.Event, 5)
				for k := range evs {
					key := fmt.Sprintf("rolledback-%d-%d-%d", w, j, k)
					evs[k] = outbox.Event{Type: "mail.user.welcome", DispatchKey: key}
					r.keys = append(r.keys, key)
				}
				tx, err := pool.Begin(ctx)
				if err != nil {
					return
				}
				if j%2 == 1 {
					// Publish in a savepoint, roll it back, commit the rest.
					sp, err := tx.Begin(ctx)
					if err == nil {
						res, err := outbox.PublishMany(ctx, sp, evs)
						if err == nil {
							for _, x := range res {
								r.ids = append(r.ids, x.ID)
							}
						}
						_ = sp.Rollback(ctx)
					}
					_ = tx.Commit(ctx)
				} else {
					res, err := outbox.PublishMany(ctx, tx, evs)
					if err == nil {
						for _, x := range res {
							r.ids = append(r.ids, x.ID)
						}
					}
					// Hold the uncommitted rows across a dispatch pass.
					time.Sleep(5 * time.Millisecond)
					_ = tx.Rollback(ctx)
				}
				rolled.Add(int64(len(evs)))
			}
		}()
	}
	<-producing
	for range 2 {
		r := <-results
		l.rolledBack = append(l.rolledBack, r.keys...)
		l.rolledBackIDs = append(l.rolledBackIDs, r.ids...)
	}
	if len(l.rolledBackIDs) == 0 {
		t.Fatal("no rolled-back publish happened: the scenario tested nothing")
	}
	verify(t, ctx, s.Pool, l, report{Scenario: "rollback", Faults: int(rolled.Load()), Elapsed: time.Since(start),
		Note: fmt.Sprintf("%d events published then rolled back", rolled.Load())}, settle, d)
}

// TestChaosLateCommit holds producer transactions open while newer events
// commit and are dispatched, then commits them: their ids are older than
// everything already handed off, and they must still be delivered. The
// daemon polls once a minute, so delivery within the settle time comes
// from the commit's wake, not the poll; a dispatcher that tracked a
// high-water id would never deliver them.
func TestChaosLateCommit(t *testing.T) {
	t.Parallel()
	start := time.Now()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, budget())
	n := events("late-commit")
	late := 3
	if long() {
		late = 8
	}
	d := startDaemon(t, daemonEnv(s.URL, routesFile(t), "OUTBOX_DISPATCH_INTERVAL_MS=60000"))
	d.waitLog(t, "outbox listener connected", time.Minute)
	run := "late"
	pool := producerPool(t, s.URL, int32(late+3))

	// The late transactions take the oldest ids: events [0, late).
	txs := make([]pgx.Tx, late)
	lateIDs := make([]int64, late)
	for i := range txs {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		res, err := outbox.Publish(ctx, tx, outbox.Event{Type: eventType(i), DispatchKey: keyOf(run, i)})
		if err != nil {
			t.Fatal(err)
		}
		txs[i], lateIDs[i] = tx, res.ID
	}
	p := &producers{pool: pool, run: run, from: late, n: n, batch: 10, workers: 2}
	<-p.start(ctx)
	// Everything newer is handed off (or failed) while the old ids are
	// still uncommitted.
	if !waitSettled(ctx, s.Pool, run, settle) {
		t.Fatal("the newer events were not handed off")
	}
	var minNewer int64
	if err := s.Pool.QueryRow(ctx, `SELECT min(id) FROM outbox_event WHERE starts_with(dispatch_key, $1)`, run+":").Scan(&minNewer); err != nil {
		t.Fatal(err)
	}
	for i, id := range lateIDs {
		if id >= minNewer {
			t.Fatalf("late event %d has id %d, not older than the first committed one (%d)", i, id, minNewer)
		}
	}
	for _, tx := range txs {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	verify(t, ctx, s.Pool, &ledger{run: run, n: n}, report{Scenario: "late-commit", Faults: late, Elapsed: time.Since(start),
		Note: fmt.Sprintf("%d transactions committed older ids after %d newer events; poll 60 s", late, n-late)}, 45*time.Second, d)
}

// TestChaosRiverLockWaitIsNotChargedToEvents takes River's job table in
// EXCLUSIVE mode for a second, so the dispatcher's River insert hits
// lock_timeout. That is an infrastructure fault, not the events': they
// must be handed off as soon as the lock is gone, with no failed attempt
// recorded, no backoff and no dead-lettering.
func TestChaosRiverLockWaitIsNotChargedToEvents(t *testing.T) {
	t.Parallel()
	start := time.Now()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, budget())
	const n = 200
	run := "riverlock"
	pool := producerPool(t, s.URL, 2)
	p := &producers{pool: pool, run: run, n: n, batch: 50, workers: 1}
	<-p.start(ctx)

	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE river_job IN EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, daemonEnv(s.URL+"&lock_timeout=100ms", routesFile(t)))
	d.waitLog(t, "lock timeout", time.Minute)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	c := verify(t, ctx, s.Pool, &ledger{run: run, n: n}, report{Scenario: "river-lock-wait", Faults: 1, Elapsed: time.Since(start),
		Note: "river_job locked past lock_timeout"}, 30*time.Second, d)
	// Unroutable events get retries = 1 when they are failed; count the
	// routable ones.
	var charged int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE starts_with(dispatch_key, $1) AND retries > 0 AND NOT starts_with(event_type, 'unrouted.')`, run+":").Scan(&charged); err != nil {
		t.Fatal(err)
	}
	if charged > 0 {
		t.Errorf("%d routable events were charged a failed attempt (retries > 0, rescheduled minutes later) for a lock wait on river_job (pending after settle: %d)", charged, c.Pending)
	}
}
