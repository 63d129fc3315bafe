package dispatcher

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/outboxhq/outbox/claim"
)

// drain is one drain: batches claimed back to back until one comes back
// short, with several in flight while the controller finds that helps.
// Each drain is a value of its own and carries its own position in claim
// order: nothing of it outlives the drain or is shared with the next one.
type drain struct {
	d *Dispatcher
	// work cancels the batches in flight (a hard stop); run ends at Stop,
	// after which no new batch starts.
	work, run context.Context

	mu sync.Mutex
	// at is the furthest position claimed so far (nil before the first
	// claim). The first batch claims from the start of the claim order;
	// the batches after it claim after at (claim.Handoff.BatchAfter),
	// skipping the dead index entries the drain leaves behind. Whatever
	// they skip (a late commit, a rolled-back batch), the next drain's
	// first batch finds.
	at *claim.Position
	// soon: a batch left an ordered event waiting for an earlier one that
	// another batch holds (claim.Result.BlockedSoon).
	soon atomic.Bool
	// held: a batch left an ordered event waiting behind an earlier event
	// of its key (claim.Result.Blocked). Such an event stays pending; on
	// a schema before migration 021, or when it waits for an event that
	// another batch holds, it also stays due and is claimed again by every
	// pass until its key moves on (otherwise claim.Result.Held: its due
	// time was moved).
	held atomic.Bool
	// frontier counts the parallel drain's live workers that claim in
	// claim order, i.e. that do not walk a key (walk); walked holds the
	// keys being walked (guarded by mu).
	frontier atomic.Int64
	walked   map[claim.Key]bool
}

func (d *Dispatcher) newDrain(work, run context.Context) *drain {
	return &drain{d: d, work: work, run: run}
}

// all claims one batch and, when it comes back full, goes on with several
// batches in flight (parallel). It returns the events claimed.
func (dr *drain) all() (int, error) {
	n, full, err := dr.pass()
	if err != nil || !full || dr.run.Err() != nil {
		return n, err
	}
	more, err := dr.parallel()
	return n + more, err
}

// parallel drains with the number of workers (batches in flight) the
// controller decides, each claiming batches until one comes back short.
func (dr *drain) parallel() (int, error) {
	d := dr.d
	var (
		wg      sync.WaitGroup
		errOnce sync.Once
		first   error
		claimed atomic.Int64
		exited  = make(chan struct{}, d.cfg.Concurrency)
		quits   []chan struct{}
		active  int
	)
	spawn := func() {
		quit := make(chan struct{})
		quits = append(quits, quit)
		active++
		wg.Add(1)
		dr.frontier.Add(1)
		go func() {
			defer wg.Done()
			defer func() { exited <- struct{}{} }()
			defer dr.frontier.Add(-1)
			for dr.run.Err() == nil {
				select {
				case <-quit:
					return
				default:
				}
				res, n, full, err := dr.batch(nil)
				claimed.Add(int64(n))
				if err == nil && full && dr.hot(res) {
					var more int
					more, err = dr.walk(res.TopKey, quit)
					claimed.Add(int64(more))
				}
				if err != nil {
					errOnce.Do(func() { first = err })
					return
				}
				if !full {
					return
				}
			}
		}()
	}

	c := newController(d.cfg.Concurrency)
	for range c.workers {
		spawn()
	}
	d.drainWorkers.Store(int64(c.workers))
	tick := time.NewTicker(d.cfg.DrainWindow)
	defer tick.Stop()
	var last int64
	for active > 0 {
		select {
		case <-exited:
			active--
			c.exited()
		case <-tick.C:
			cur := claimed.Load()
			switch c.sample(cur - last) {
			case add:
				spawn()
			case retire:
				close(quits[len(quits)-1])
				quits = quits[:len(quits)-1]
			}
			last = cur
			d.drainWorkers.Store(int64(c.workers))
		}
	}
	wg.Wait()
	return int(claimed.Load()), first
}

// pass runs one batch and returns how many events it claimed and whether
// the batch was full (by count, or cut by the byte budget with more due).
// Each transaction of the pass is bounded by BatchTimeout
// (claim.Handoff.Timeout), so that a batch that times out can be retried
// event by event to find the slow event.
func (dr *drain) pass() (int, bool, error) {
	_, n, full, err := dr.batch(nil)
	return n, full, err
}

// batch runs one batch: from the drain's position in claim order, or, with
// key, of that ordering key alone (walk). It returns the batch's result,
// the events claimed that were not held back for their key, and whether the
// batch was full.
func (dr *drain) batch(key *claim.Key) (claim.Result, int, bool, error) {
	d := dr.d
	dr.mu.Lock()
	at := dr.at
	var skip []claim.Key
	if key == nil {
		// The keys being walked are the walkers' to hand off: a batch in
		// claim order passes their events by (claim.Handoff.BatchAfter).
		for k := range dr.walked {
			skip = append(skip, k)
		}
	}
	dr.mu.Unlock()
	var (
		res   claim.Result
		err   error
		limit = d.cfg.BatchSize
	)
	switch {
	case key != nil:
		limit = walkBatch(d.cfg.BatchSize)
		res, err = d.handoff.BatchOfKey(dr.work, limit, *key)
	case at != nil:
		res, err = d.handoff.BatchAfter(dr.work, d.cfg.BatchSize, *at, skip...)
	default:
		res, err = d.handoff.Batch(dr.work, d.cfg.BatchSize)
	}
	d.passes.Add(1)
	if err != nil {
		return res, 0, false, err
	}
	if res.BlockedSoon {
		dr.soon.Store(true)
	}
	if res.Blocked > res.Held {
		// Some stay due (their due time was not moved).
		dr.held.Store(true)
	}
	if res.Claimed > 0 {
		// A walk's batch does not move the drain's position: the key's
		// events may lie ahead of it in claim order, with unrelated
		// events in between that the position must not skip.
		if key == nil {
			dr.mu.Lock()
			if dr.at == nil || res.Last.After(*dr.at) {
				last := res.Last
				dr.at = &last
			}
			dr.mu.Unlock()
		}
		d.record(res)
	}
	// Blocked events (waiting for their ordering key) are not work done:
	// an idle re-check that finds only those goes back to sleep.
	return res, res.Claimed - res.Blocked, res.Claimed >= limit || res.More, nil
}

// hot reports whether one ordering key filled at least half of a full
// batch: a hot key's backlog, which only one batch at a time can hand off.
func (dr *drain) hot(res claim.Result) bool {
	return res.TopKeyDone >= 2 && 2*res.TopKeyDone >= res.Claimed
}

// walkRetries bounds the batches of a walk in a row that hand nothing off
// because another batch holds the key's next events: one that claimed them
// from the drain's position before the walk began (the drain's later
// batches pass a walked key by), or another dispatcher's, found them held
// back and is about to let go.
const walkRetries = 3

// walkScale and walkBatchMax size a walk's batches: walkScale times the
// drain's batch, at most walkBatchMax events unless the drain's batch is
// larger. A walk's batch holds one key's events, of which only one batch at
// a time can be handed off, and what a batch pays whatever its size (the
// claim's and the insert's statements, the commit and its WAL flush, the
// round trips) is paid beside the key's first jobs, which run while the
// walk hands the rest off: with batches of 500 instead of 100, the bench's
// 10,000-event hot key was handed off in 0.85-1.28 s instead of 1.06-1.88
// s, shorter in 18 of 19 interleaved pairs, with shorter gaps between its
// jobs meanwhile in every run that recorded them; its next job's p99 over
// the whole drain moved less than the machine's spread
// (docs/ordering-measurements.md, "Larger batches for a walk"). Each batch stays within the handoff's byte budget
// (claim.Handoff.BatchBytes).
const (
	walkScale    = 5
	walkBatchMax = 1000
)

// walkBatch is the most events of one batch of a walk, for a drain whose
// batches take batch events.
func walkBatch(batch int) int {
	return max(batch, min(walkScale*batch, walkBatchMax))
}

// walkProbeBatches bounds the events a lone walk hands off between two of
// its batches in claim order, once these keep finding nothing, in the
// drain's batches: the walker takes one before each of its batches, then
// every 2, 4, ... of them, up to walkProbeMax.
const walkProbeBatches = 8

// walkBatches bounds the events of one walk (walkMax), in the drain's
// batches. A walker alone claims in claim order after the drain's
// position, which an event committed late with an earlier scheduled_at
// (its transaction's start) is behind; only the next drain, which starts
// from the beginning of the claim order, finds it, and a drain does not
// end while a walk goes on. A bound in events, not in time, keeps a walk's
// work the same on a slow machine.
const walkBatches = 100

// walkProbeMax and walkMax are walkProbeBatches and walkBatches in batches
// of a walk, rounded up, for a drain whose batches take batch events: with
// the default batch of 100, a walk's batches take 500 events, a lone
// walker takes a batch in claim order before each of them, or every 2
// while those find nothing (1,000 events, against 800 before 2026-12-04:
// batches of 100, every 8; in time about the same, two batches of 500
// taking about as long as eight of 100 on the bench's machine), and a walk
// takes at most 20 (the same 10,000 events as 100 batches of 100 before).
func walkProbeMax(batch int) int {
	return ceilDiv(walkProbeBatches*batch, walkBatch(batch))
}

func walkMax(batch int) int {
	return ceilDiv(walkBatches*batch, walkBatch(batch))
}

// ceilDiv is a/b rounded up, for a, b > 0.
func ceilDiv(a, b int) int { return (a + b - 1) / b }

// walk hands off a hot key's backlog batch by batch, in the key's order,
// after a batch that the key filled, and returns the events it claimed.
//
// Without it, the drain's other workers, claiming from the drain's
// position, claimed the key's next events while this batch held the
// earlier ones, had to hold them back, and moved the position past them:
// the key got one batch per drain, and every drain claimed the rest of its
// backlog again. A walk goes on with the key's next events wherever they
// are in claim order, while the other workers go on in claim order past
// them to the events behind, without claiming them (batch passes the keys
// being walked to claim.Handoff.BatchAfter): a batch that claimed them
// would only find them held back behind the walk's batch and let go, and
// did so for nearly the whole backlog in the walk's first second, on the
// cores the key's releases run on. An unrelated event must never wait for
// a key's backlog, so:
//   - a walk starts only while another worker claims in claim order, and
//     one key is walked by one worker at a time;
//   - when no worker claims in claim order any more (they ran out of work
//     and left, or were retired), the walker takes a batch in claim order
//     between the walk's batches (before each, or every 2, 4, ... while
//     those find nothing, up to walkProbeMax): events committed meanwhile
//     notify nobody (a draining dispatcher does not hold the wake lock)
//     and are found only there;
//   - a walk's batches by key never move the drain's position;
//   - a walk takes at most walkMax batches (as many events as walkBatches
//     of the drain's), so that the drain can end and the next one start
//     from the beginning of the claim order.
//
// A walk's batches are larger than the drain's (walkBatch). A walk ends
// when its batch is not full, after walkRetries batches in a row that
// handed nothing off, after walkMax batches, or when its worker
// is retired (quit).
func (dr *drain) walk(key claim.Key, quit <-chan struct{}) (int, error) {
	dr.mu.Lock()
	if dr.walked[key] || dr.frontier.Load() < 2 {
		dr.mu.Unlock()
		return 0, nil
	}
	if dr.walked == nil {
		dr.walked = map[claim.Key]bool{}
	}
	dr.walked[key] = true
	dr.frontier.Add(-1)
	dr.mu.Unlock()
	defer func() {
		dr.mu.Lock()
		delete(dr.walked, key)
		dr.frontier.Add(1)
		dr.mu.Unlock()
	}()

	var (
		total, idle int
		// every and due pace a lone walker's batches in claim order.
		every, due = 1, 0
	)
	probeMax, most := walkProbeMax(dr.d.cfg.BatchSize), walkMax(dr.d.cfg.BatchSize)
	for batches := 0; dr.run.Err() == nil && batches < most; batches++ {
		select {
		case <-quit:
			return total, nil
		default:
		}
		if dr.frontier.Load() == 0 {
			if due--; due <= 0 {
				_, n, _, err := dr.batch(nil)
				total += n
				if err != nil {
					return total, err
				}
				if n > 0 {
					every = 1
				} else {
					every = min(2*every, probeMax)
				}
				due = every
			}
		}
		res, n, full, err := dr.batch(&key)
		total += n
		if err != nil {
			return total, err
		}
		switch {
		case res.Done > 0 && full:
			idle = 0
			continue
		case res.Done == 0 && res.BlockedSoon && idle < walkRetries:
			idle++
			select {
			case <-time.After(time.Millisecond):
			case <-dr.run.Done():
			}
			continue
		}
		return total, nil
	}
	return total, nil
}

// record counts a batch that claimed events and reports it (OnBatch).
func (d *Dispatcher) record(res claim.Result) {
	d.batches.Add(1)
	d.events.Add(int64(res.Done))
	d.jobs.Add(int64(res.Jobs))
	d.unroutable.Add(int64(res.Unroutable))
	d.retried.Add(int64(res.Retried))
	d.dead.Add(int64(res.DeadLettered + res.Broken))
	if d.cfg.OnBatch != nil {
		d.cfg.OnBatch(res)
	}
	if res.Fallback {
		d.logger.Warn("outbox batch failed; retried event by event",
			slog.Int("claimed", res.Claimed), slog.Int("done", res.Done),
			slog.Int("retried", res.Retried), slog.Int("dead_lettered", res.DeadLettered),
			slog.Int("timed_out", res.TimedOut), slog.Int("skipped", res.Skipped))
	}
}

// decision is what the controller tells a parallel drain to do.
type decision int

const (
	hold   decision = iota // keep the workers
	add                    // start one more worker
	retire                 // stop the worker added last
)

func (x decision) String() string { return [...]string{"hold", "add", "retire"}[x] }

// controller decides how many batches a parallel drain keeps in flight: drain
// rate samples in, a decision out; no clock, no goroutine, no database.
// Concurrency is a ceiling, not a target: what limits a drain is the
// database, and past its knee (about its core count) more batches in flight
// only add lock and buffer contention (docs/benchmarks-record.md, "Drain: the
// database's two cores are the limit"). So a drain starts with two workers
// (one when the ceiling is 1) and, one sample per DrainWindow, adds a worker
// while the rate still rises by at least 5 % over the window before the last
// addition; when an added worker brings less, it is retired and the count
// stays (settled). A worker that runs out of work settles it too: the backlog
// is ending.
type controller struct {
	max     int
	workers int
	// prevRate is the rate of the window before the last addition; trial
	// is true while that addition is on trial.
	prevRate int64
	trial    bool
	settled  bool
}

func newController(max int) *controller {
	return &controller{max: max, workers: min(2, max)}
}

// sample takes the events claimed in the last window and decides.
func (c *controller) sample(rate int64) decision {
	switch {
	case c.settled:
		return hold
	case c.trial && rate*100 < c.prevRate*105:
		c.workers--
		c.settled = true
		return retire
	case c.workers < c.max:
		c.prevRate, c.trial = rate, true
		c.workers++
		return add
	default:
		c.settled = true
		return hold
	}
}

// exited tells the controller that a worker found a short batch (or
// failed): the drain is ending, so it adds and retires no more.
func (c *controller) exited() { c.settled = true }
