package dispatcher

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/alert"
)

// The data path of one event, step by step, and where each step lives:
//
//  1. publish: the producer's transaction inserts a pending row into
//     outbox_event (outbox.Publish, or outbox_publish in SQL, or a plain
//     INSERT), due at scheduled_at (now() unless delayed).
//  2. wake: at commit, the wake trigger (sql/migrations) tries the wake key
//     shared and sends NOTIFY only when that fails, i.e. while an idle
//     dispatcher holds the key (wakeLock, taken in state idle below). The
//     listener (package listener) turns the notification into a token on
//     its one-slot Wake channel. Idle also ends at the poll tick
//     (PollInterval, which also rescues stale processing rows) and at the
//     next due time (nextDueSQL), so a delayed event needs no NOTIFY.
//  3. claim: a drain (drain.go) claims a batch with claim.Handoff.Batch and
//     continues from its own position with BatchAfter: due pending rows in
//     (scheduled_at, id) order, FOR UPDATE SKIP LOCKED, bounded by BatchSize
//     and BatchBytes.
//  4. route: in the same transaction each event's type is matched against
//     the routes (route.Table, longest prefix wins); an event no rule
//     matches is failed and alerted.
//  5. insert and done: one statement of that transaction inserts one River
//     job per (event, route queue), as River's InsertManyTx would, and
//     marks the events done with their job ids.
//  6. commit: the transaction commits; any failure rolls the whole batch
//     back to pending, and
//     claim.Handoff retries it event by event so that only the failing
//     event is charged (backoff, then failed).
//
// The loop around those steps is a state machine. Each state is one method
// of loop that does its work and returns the next state:
//
//	            start
//	              │ rescue stale processing rows
//	              ▼
//	  ┌──────► draining ── error ──────────────► backingOff
//	  │         │  │  ▲                              │ delay (200 ms × failures, ≤ 5 s)
//	  │         │  │  └──────────────────────────────┘
//	  │         │  └─ handed events off, Linger > 0 ─► lingering ─ Linger elapsed ─┐
//	  │         │                                                                  │
//	  │         └─ found nothing ─► idle                        draining ◄─────────┘
//	  │                              │ take the wake lock (unless held), re-check, read the next due time
//	  │                              ├─ re-check found work, or producers hold the key ─► draining
//	  │                              ├─ re-check failed ─► backingOff
//	  ├── poll tick ─────────────────┤ (sleep, holding the wake lock)
//	  │                              │ wake / due
//	  │                              ▼
//	  └─ full batch, wake pending, ── armed: one pass, keeping the wake lock
//	     ordered event soon,           │ a light stream: back to idle, no re-check
//	     listener down                 └─ error: release the lock ─► backingOff
//
//	any state ── Stop ──► stopping: release the wake lock and return
//
// Only the loop goroutine runs these methods and touches loop and the
// wakeLock; a drain's workers share only the drain value (drain.go).

// state is a state of the loop.
type state int

const (
	draining state = iota
	lingering
	idle
	armed
	backingOff
	stopping
)

func (s state) String() string {
	return [...]string{"draining", "lingering", "idle", "armed", "backingOff", "stopping"}[s]
}

// loop is the state of the dispatch loop, owned by its goroutine.
type loop struct {
	d *Dispatcher
	// run ends when Stop is called: take no new work. work ends only on a
	// hard stop (Stop's ctx ended): it cancels the batches in flight.
	run, work context.Context
	poll      *time.Ticker
	// failures counts consecutive failed passes (backoff, alert).
	failures int
	// waits counts consecutive drains that left an ordered event waiting
	// for an earlier one in another batch's hands (claim.Result.BlockedSoon).
	waits int
	// held: the last drain or pass left ordered events waiting behind an
	// earlier event of their key (drain.held). Those whose due time the
	// batch did not move (claim.Result.Held) are due and stay so: the next
	// due time leaves out events due for longer than heldGrace, which the
	// poll tick looks at again.
	held bool
}

// runLoop runs the state machine until it reaches stopping.
func (d *Dispatcher) runLoop(run, work context.Context) {
	l := &loop{d: d, run: run, work: work, poll: time.NewTicker(d.cfg.PollInterval)}
	defer l.poll.Stop()
	d.rescue(work)
	st := draining
	for st != stopping {
		if run.Err() != nil {
			break
		}
		switch st {
		case draining:
			st = l.drain()
		case lingering:
			st = l.linger()
		case idle:
			st = l.idle()
		case armed:
			st = l.armed()
		case backingOff:
			st = l.backoff()
		default:
			panic(fmt.Sprintf("dispatcher: unknown state %d", st))
		}
	}
	l.stop()
}

// drain claims batches until one comes back short (drain.go). It releases
// the wake lock if idle left it held, concurrently with the first batch:
// a busy dispatcher must not make producers notify.
func (l *loop) drain() state {
	var wait func()
	if l.d.lock != nil && l.d.lock.held {
		wait = l.d.lock.releaseAsync(l.work, l.d.logger)
	}
	dr := l.d.newDrain(l.work, l.run)
	n, err := dr.all()
	if wait != nil {
		wait()
	}
	l.held = dr.held.Load()
	switch {
	case err != nil:
		l.fail(err)
		return backingOff
	case l.run.Err() != nil:
		return stopping
	}
	l.failures = 0
	if dr.soon.Load() {
		// An ordered event waits for an earlier event of its key that
		// another batch (of this or another dispatcher) holds; that batch
		// commits shortly, and no NOTIFY will say so. Claim again soon: 1,
		// 2, 4 ... 64 ms after consecutive such drains.
		l.waits++
		t := time.NewTimer(time.Millisecond << min(l.waits-1, 6))
		defer t.Stop()
		select {
		case <-t.C:
			return draining
		case <-l.run.Done():
			return stopping
		}
	}
	l.waits = 0
	// Work arrived: stay busy for Linger and look again, rather than going
	// idle at once. Idle takes the wake lock, and while it is held (or
	// queued for) producers pay for NOTIFY; under a steady stream that
	// would make every producer notify. Only an empty drain goes idle.
	if n > 0 && l.d.cfg.Linger > 0 {
		return lingering
	}
	return idle
}

// linger waits Linger, then drains again.
func (l *loop) linger() state {
	t := time.NewTimer(l.d.cfg.Linger)
	defer t.Stop()
	select {
	case <-t.C:
		return draining
	case <-l.run.Done():
		return stopping
	}
}

// idle goes to sleep until a wake, the poll tick or the next due time.
//
// With a live listener it first takes the wake lock (so that producers
// committing from now on notify) and then re-checks the table: rows
// committed by producers that skipped NOTIFY before the lock was granted
// are visible now. The lock attempt is bounded by WakeLockTimeout; when it
// times out, pg_locks tells who holds the key (wakeLock.acquire): another
// idle dispatcher (sleep without the lock: producers notify, and NOTIFY
// reaches every listener) or producers in a slow commit (do not sleep:
// their rows and every commit after them would wait for the poll; drain
// once more and try the lock again).
//
// Back from armed, it may still hold the lock: it keeps it, without a
// re-check, while keepLock says the lock is still good; otherwise it
// releases it and takes it again as above.
func (l *loop) idle() state {
	d := l.d
	connected := d.lis != nil && d.lis.Connected()
	if d.lock != nil && d.lock.held && !l.keepLock(connected) {
		d.lock.releaseLogged(l.work, d.logger)
	}
	switch {
	case connected && d.lock.held:
		// Back from armed: the lock was held before that pass began, so
		// every commit the pass did not see notifies. No re-check.
	case connected:
		connects := d.lis.Connects()
		got, err := d.lock.acquire(l.work)
		d.lock.connects = connects
		if err != nil {
			d.logger.Warn("outbox wake lock unavailable; relying on polling", slog.String("error", err.Error()))
		}
		switch got {
		case lockProducers:
			return draining
		case lockHeld:
			dr := d.newDrain(l.work, l.run)
			n, _, err := dr.pass()
			l.held = dr.held.Load()
			if err != nil || n > 0 {
				// Work arrived: drain without the lock.
				d.lock.releaseLogged(l.work, d.logger)
				if err != nil {
					l.fail(err)
					return backingOff
				}
				return draining
			}
		}
	}

	// The next due time is read after the lock and the re-check, so a
	// delayed event committed later notifies (or is seen by the poll).
	// After a pass that left events held back for their key, the events
	// due for longer than heldGrace are left out: they are those (or in
	// another dispatcher's batch), and a due time read from them would
	// claim them again every dueFloor for as long as their key is held
	// (its earlier event dead-lettered, backing off or delayed). The poll
	// tick looks at them again; the earlier event's own due time, or an
	// operator's requeue (whose commit notifies), moves the key on.
	var due <-chan time.Time
	var since time.Duration
	if l.held {
		since = heldGrace
	}
	if wait, ok := d.nextDue(l.work, since); ok && wait < d.cfg.PollInterval {
		t := time.NewTimer(wait)
		defer t.Stop()
		due = t.C
	}
	select {
	case <-l.run.Done():
		return stopping
	case <-d.wakeC():
		d.wakes.Add(1)
	case <-l.poll.C:
		// The poll also renews the wake lock: draining releases it, and
		// the next idle takes it again on a session that answers.
		d.polls.Add(1)
		d.rescue(l.work)
		return draining
	case <-due:
		d.dues.Add(1)
	}
	if d.lock != nil && d.lock.held {
		return armed
	}
	return draining
}

// keepLock reports whether the wake lock held since an armed pass can stay
// held into the next sleep: the listener is up and has not reconnected
// since the lock was taken. A reconnect says notifications may have been
// lost and the server may have restarted under the lock's session, whose
// lock is only a flag on this side; idle then releases the lock and takes
// it again, with a re-check. (A lock session that dies while the
// dispatcher sleeps is noticed at the poll tick, which always takes the
// lock again, as before armed existed.)
func (l *loop) keepLock(connected bool) bool {
	return connected && l.d.lis.Connects() == l.d.lock.connects
}

// armed runs one pass while still holding the wake lock, for a wake (or a
// due time) that found the dispatcher idle. Every producer whose commit
// began after the lock was taken notifies, so once the pass is done no
// re-check is needed and the loop goes back to sleep with the lock: one
// batch transaction per wake, instead of a release, a linger's pass, a
// new lock and a re-check. A light stream of events (each finding the
// dispatcher idle) then costs a handoff and the next due time's read per
// wake.
//
// A stream that keeps the dispatcher busy is drained without the lock, as
// before (producers skip NOTIFY while it is not held): a full batch, an
// ordered event waiting for another batch, or a wake that arrived while
// the pass ran (the producers outpace one pass per wake) sends the loop
// draining, which releases the lock.
func (l *loop) armed() state {
	d := l.d
	dr := d.newDrain(l.work, l.run)
	_, full, err := dr.pass()
	l.held = dr.held.Load()
	switch {
	case err != nil:
		// Back off without the lock, as idle's re-check does: producers
		// must not pay for NOTIFY while nobody listens for it.
		d.lock.releaseLogged(l.work, d.logger)
		l.fail(err)
		return backingOff
	case l.run.Err() != nil:
		return stopping
	}
	l.failures = 0
	if full || dr.soon.Load() || len(d.wakeC()) > 0 || !d.lis.Connected() {
		return draining
	}
	return idle
}

// backoff waits 200 ms per consecutive failure (at most 5 s), then drains
// again.
func (l *loop) backoff() state {
	t := time.NewTimer(min(time.Duration(l.failures)*200*time.Millisecond, 5*time.Second))
	defer t.Stop()
	select {
	case <-t.C:
		return draining
	case <-l.run.Done():
		return stopping
	}
}

// fail records a failed pass: log, count, and raise DispatcherFailing on
// the FailureAlertAfter-th failure in a row.
func (l *loop) fail(err error) {
	d := l.d
	d.logger.Error("outbox dispatch pass failed", slog.String("error", err.Error()))
	l.failures++
	d.errs.Add(1)
	if l.failures == d.cfg.FailureAlertAfter {
		d.cfg.Alerter.Alert(l.work, alert.Alert{
			Reason:  alert.DispatcherFailing,
			Message: fmt.Sprintf("the dispatch loop failed %d times in a row (last: %v)", l.failures, err),
		})
	}
}

// stop releases the wake lock and closes its connection.
func (l *loop) stop() {
	if l.d.lock != nil {
		_ = l.d.lock.release(l.work)
		l.d.lock.close()
	}
}

func (d *Dispatcher) wakeC() <-chan struct{} {
	if d.lis == nil {
		return nil
	}
	return d.lis.Wake()
}

// nextDueSQL says how long, by the database's clock, until the earliest
// pending event is due (NULL when none is pending). min(scheduled_at) over
// status = 'pending' is the first entry of the claim index
// outbox_event_claim_idx (scheduled_at, id) WHERE status = 'pending': an
// index-only scan that stops at the first live entry, as the claim's own
// scan does.
const nextDueSQL = `SELECT extract(epoch FROM min(scheduled_at) - clock_timestamp())::float8 FROM outbox_event WHERE status = 'pending'`

// nextDueSinceSQL is nextDueSQL without the events due for longer than $1
// seconds: a range of the same index from that time on.
const nextDueSinceSQL = nextDueSQL + ` AND scheduled_at > clock_timestamp() - make_interval(secs => $1)`

// heldGrace is how long an event may have been due and still count for
// the next due time after a pass that left events held back for their key
// (loop.held): one that became due just now, between the pass and the
// read, is claimed within dueFloor; older ones wait for the poll tick.
const heldGrace = time.Second

// dueFloor is the shortest sleep until a due time. A pending event that is
// due already but was not claimed is locked by another dispatcher's batch
// (or became due between the re-check and nextDueSQL): look again soon,
// without spinning.
const dueFloor = 100 * time.Millisecond

// nextDue reads how long until the next pending event is due, leaving out
// those due for longer than since when since is not 0; ok is false when
// none is pending or the query failed (the poll tick covers it).
func (d *Dispatcher) nextDue(ctx context.Context, since time.Duration) (time.Duration, bool) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var (
		secs *float64
		row  pgx.Row
	)
	if since > 0 {
		row = d.pool.QueryRow(qctx, nextDueSinceSQL, since.Seconds())
	} else {
		row = d.pool.QueryRow(qctx, nextDueSQL)
	}
	if err := row.Scan(&secs); err != nil {
		if ctx.Err() == nil {
			d.logger.Warn("outbox could not read the next due time; relying on the poll", slog.String("error", err.Error()))
		}
		return 0, false
	}
	if secs == nil {
		return 0, false
	}
	// Round up to the millisecond so the claim's now() is past the due time.
	wait := time.Duration(*secs*float64(time.Second)) + time.Millisecond
	if wait <= time.Millisecond {
		wait = dueFloor
	}
	return wait, true
}
