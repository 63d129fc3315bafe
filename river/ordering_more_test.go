package outboxriver_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// probeArgs is the payload of an event worked by probe, a plain
// river.Worker that knows nothing about the outbox.
type probeArgs struct {
	Key string `json:"key"`
	Seq int    `json:"seq"`
}

func (probeArgs) Kind() string { return "order_probe" }

// probe records, per queue and key ("queue/key"), the seqs in the order
// their jobs started and ended well, how many ran at once at most, and
// closes overlap the first time two jobs of one queue and key run at once.
// A hook, set per key before publishing, decides how a job behaves.
type probe struct {
	river.WorkerDefaults[probeArgs]

	mu          sync.Mutex
	running     map[string]int
	maxRunning  map[string]int
	starts      map[string][]int
	ends        map[string][]int
	hooks       map[string]func(context.Context, *river.Job[probeArgs]) error
	overlap     chan struct{}
	overlapSeen bool
}

func newProbe() *probe {
	return &probe{running: map[string]int{}, maxRunning: map[string]int{}, starts: map[string][]int{}, ends: map[string][]int{},
		hooks: map[string]func(context.Context, *river.Job[probeArgs]) error{}, overlap: make(chan struct{})}
}

func (p *probe) Work(ctx context.Context, job *river.Job[probeArgs]) error {
	id := job.Queue + "/" + job.Args.Key
	p.mu.Lock()
	p.running[id]++
	p.maxRunning[id] = max(p.maxRunning[id], p.running[id])
	if p.running[id] > 1 && !p.overlapSeen {
		p.overlapSeen = true
		close(p.overlap)
	}
	p.starts[id] = append(p.starts[id], job.Args.Seq)
	hook := p.hooks[job.Args.Key]
	p.mu.Unlock()
	var err error
	if hook != nil {
		err = hook(ctx, job)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.running[id]--
	if err == nil {
		p.ends[id] = append(p.ends[id], job.Args.Seq)
	}
	return err
}

// hook sets the behaviour of the jobs of key.
func (p *probe) hook(key string, f func(context.Context, *river.Job[probeArgs]) error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.hooks[key] = f
}

// holdSeq makes the job of key with seq (in queue; "" for any) wait, while it runs, until the
// returned release is called (or the test ends).
func (p *probe) holdSeq(t *testing.T, key, queue string, seq int) (release func()) {
	hold := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(hold) }) }
	t.Cleanup(release)
	p.hook(key, func(ctx context.Context, job *river.Job[probeArgs]) error {
		if job.Args.Seq != seq || (queue != "" && job.Queue != queue) {
			return nil
		}
		select {
		case <-hold:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	return release
}

// started returns the seqs of queue/key in the order their jobs started.
func (p *probe) started(id string) []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.starts[id])
}

// ended returns the seqs of queue/key whose jobs ended well, in order.
func (p *probe) ended(id string) []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.ends[id])
}

// most returns how many jobs of queue/key ran at once at most.
func (p *probe) most(id string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.maxRunning[id]
}

// waitOverlap is a hook that gives another job of the key the chance to
// start alongside: it returns when two jobs of one key run at once, after
// patience, or when ctx ends.
func (p *probe) waitOverlap(patience time.Duration) func(context.Context, *river.Job[probeArgs]) error {
	return func(ctx context.Context, _ *river.Job[probeArgs]) error {
		t := time.NewTimer(patience)
		defer t.Stop()
		select {
		case <-p.overlap:
		case <-t.C:
		case <-ctx.Done():
		}
		return nil
	}
}

// upTo returns 0, 1, ..., n-1.
func upTo(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

// probeRoutes: order. to queue ord, park. to ord with one attempt, fan. to
// fan_fast and fan_slow; all payload args of kind order_probe.
func probeRoutes(t *testing.T) *route.Table {
	t.Helper()
	job := func(queue string, attempts int) route.Job {
		return route.Job{Queue: queue, Kind: "order_probe", Args: route.ArgsPayload, MaxAttempts: attempts}
	}
	routes, err := route.New([]route.Rule{
		{Prefix: "order.", Jobs: []route.Job{job("ord", 0)}},
		{Prefix: "park.", Jobs: []route.Job{job("ord", 1)}},
		{Prefix: "fan.", Jobs: []route.Job{job("fan_fast", 0), job("fan_slow", 0)}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return routes
}

// probeClient starts a River client working the queues with p through
// QueuesConfig (the ordered completion middleware installed).
func probeClient(t *testing.T, pool *pgxpool.Pool, p *probe, queues ...string) *river.Client[pgx.Tx] {
	t.Helper()
	workers := river.NewWorkers()
	river.AddWorker(workers, p)
	qs := make([]outboxriver.Queue, len(queues))
	for i, q := range queues {
		qs[i] = outboxriver.Queue{Name: q, MaxWorkers: 10}
	}
	return startClient(t, pool, outboxriver.QueuesConfig(workers, qs, outboxriver.WorkerLatency{}))
}

// publishSeqs publishes events of typ with payloads {key, seq} for each
// seq, in one transaction, with key as ordering key unless unordered.
func publishSeqs(t *testing.T, pool *pgxpool.Pool, typ, key string, ordered bool, seqs ...int) {
	t.Helper()
	events := make([]outbox.Event, len(seqs))
	for i, seq := range seqs {
		events[i] = outbox.Event{Type: typ, Payload: []byte(fmt.Sprintf(`{"key":%q,"seq":%d}`, key, seq))}
		if ordered {
			events[i].OrderingKey = key
		}
	}
	pgtest.Publish(t, pool, events...)
}

// probeJob is the River job of one probe event. A job that waits in its
// key's line (migration 024) is not in river_job: it reads state pending
// and inLine true.
type probeJob struct {
	id, event int64
	state     string
	inLine    bool
}

// jobOf returns the job of queue, key and seq (id 0 when there is none),
// whether it is in river_job or waits in its key's line.
func jobOf(t *testing.T, pool *pgxpool.Pool, queue, key string, seq int) probeJob {
	t.Helper()
	var j probeJob
	err := pool.QueryRow(context.Background(), `
		SELECT id, (metadata->>'outbox_event_id')::bigint, state, in_line FROM `+pgtest.Jobs+`
		WHERE queue = $1 AND args->>'key' = $2 AND (args->>'seq')::int = $3`, queue, key, seq).Scan(&j.id, &j.event, &j.state, &j.inLine)
	if errors.Is(err, pgx.ErrNoRows) {
		return probeJob{}
	}
	if err != nil {
		t.Fatal(err)
	}
	return j
}

// wantStates checks the states of the jobs of queue and key by seq. The
// state waiting is a job that waits in its key's line and has no river_job
// row (migration 024); pending is a pending river_job row, as a job queued
// before 024 waits; any other state is its river_job row's.
func wantStates(t *testing.T, pool *pgxpool.Pool, queue, key string, want map[int]string) {
	t.Helper()
	for seq, state := range want {
		j := jobOf(t, pool, queue, key, seq)
		got := j.state
		if j.inLine {
			got = "waiting"
		}
		if got != state {
			t.Errorf("%s/%s seq %d: job %d is %q, want %q", queue, key, seq, j.id, got, state)
		}
	}
}

// inRiver returns how many of ids have a river_job row.
func inRiver(t *testing.T, pool *pgxpool.Pool, ids ...int64) int {
	t.Helper()
	return pgtest.Count(t, pool, `SELECT count(*) FROM river_job WHERE id = ANY($1)`, ids)
}

// queueAsBefore024 turns the jobs of key in queue that wait in its line
// into pending river_job rows, with their ids, columns and places in line,
// as a handoff before migration 024 queued them (and as other code that
// inserts ordered jobs not shaped as the handoff's still does): the legacy
// path. The enqueue trigger puts each back in the line, by its position,
// as a pending row. The key's row is locked meanwhile, so no release runs.
// It returns how many jobs it moved.
func queueAsBefore024(t *testing.T, pool *pgxpool.Pool, queue, key string) int {
	t.Helper()
	ctx := context.Background()
	var n int
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `
			SELECT 1 FROM outbox_ordering_key WHERE tenant_id = '' AND ordering_key = $1 AND queue = $2
			FOR NO KEY UPDATE`, key, queue); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `
			DELETE FROM outbox_ordering_wait WHERE tenant_id = '' AND ordering_key = $1 AND queue = $2 AND kind IS NOT NULL
			RETURNING job_id, args, created_at, kind, max_attempts, metadata, priority, tags`, key, queue)
		if err != nil {
			return err
		}
		type waiting struct {
			id                 int64
			args, metadata     []byte
			created            time.Time
			kind               string
			attempts, priority int16
			tags               []string
		}
		jobs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (waiting, error) {
			var w waiting
			err := r.Scan(&w.id, &w.args, &w.created, &w.kind, &w.attempts, &w.metadata, &w.priority, &w.tags)
			return w, err
		})
		if err != nil {
			return err
		}
		for _, w := range jobs {
			var state string
			if err := tx.QueryRow(ctx, `
				INSERT INTO river_job (id, args, created_at, kind, max_attempts, metadata, priority, queue, state, tags)
				VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', $9)
				RETURNING state::text`,
				w.id, w.args, w.created, w.kind, w.attempts, w.metadata, w.priority, queue, w.tags).Scan(&state); err != nil {
				return err
			}
			if state != "pending" {
				return fmt.Errorf("job %d inserted as %s, want pending", w.id, state)
			}
		}
		n = len(jobs)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if w := pgtest.Count(t, pool, `
		SELECT count(*) FROM outbox_ordering_wait WHERE tenant_id = '' AND ordering_key = $1 AND queue = $2 AND kind IS NULL`, key, queue); w != n {
		t.Fatalf("%s/%s: %d legacy rows in line after moving %d jobs", queue, key, w, n)
	}
	return n
}

// keyRow is a row of outbox_ordering_key.
type keyRow struct {
	found       bool
	headJob     int64
	headEvent   int64
	waiting     int
	parkedState string
}

func keyOf(t *testing.T, pool *pgxpool.Pool, queue, key string) keyRow {
	t.Helper()
	var k keyRow
	var parked *string
	err := pool.QueryRow(context.Background(), `
		SELECT head_job_id, head_event_id,
		       (SELECT count(*) FROM outbox_ordering_wait w WHERE w.tenant_id = k.tenant_id AND w.ordering_key = k.ordering_key AND w.queue = k.queue),
		       parked_state
		FROM outbox_ordering_key k
		WHERE tenant_id = '' AND ordering_key = $1 AND queue = $2`, key, queue).Scan(&k.headJob, &k.headEvent, &k.waiting, &parked)
	if errors.Is(err, pgx.ErrNoRows) {
		return k
	}
	if err != nil {
		t.Fatal(err)
	}
	k.found = true
	if parked != nil {
		k.parkedState = *parked
	}
	return k
}

// unpark calls outbox_unpark and returns how many keys it touched.
func unpark(t *testing.T, pool *pgxpool.Pool, key, action string, dryRun bool) int {
	t.Helper()
	return pgtest.Count(t, pool, `SELECT count(*) FROM outbox_unpark('test', $1, $2, $3)`, dryRun, key, action)
}

// TestUnorderedWorkloadOverlaps is the negative control of the ordering
// tests: the same workload (events of one key, in one queue, worked by ten
// workers) overlaps without ordering keys, so a test that sees no overlap
// with them proves something. Each job waits until two jobs of its key run
// at once: without keys that happens as soon as River fetches the second;
// with keys it never does, and each job gives up after a short patience.
func TestUnorderedWorkloadOverlaps(t *testing.T) {
	t.Parallel()
	for _, ordered := range []bool{false, true} {
		t.Run(fmt.Sprintf("ordered=%v", ordered), func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t, nil)
			p := newProbe()
			patience := 30 * time.Second
			if ordered {
				patience = 200 * time.Millisecond
			}
			p.hook("k", p.waitOverlap(patience))
			probeClient(t, s.Pool, p, "ord")
			startDispatcher(t, s.Pool, probeRoutes(t))
			const n = 6
			publishSeqs(t, s.Pool, "order.item.changed", "k", ordered, upTo(n)...)
			pgtest.WaitFor(t, 90*time.Second, "every job worked", func() bool { return len(p.ended("ord/k")) == n })
			most, starts := p.most("ord/k"), p.started("ord/k")
			if !ordered {
				if most < 2 {
					t.Fatalf("without ordering keys at most %d job of the key ran at once: the workload cannot show a broken order", most)
				}
				t.Logf("without keys: %d jobs at once, start order %v", most, starts)
				return
			}
			if most != 1 || !slices.Equal(starts, upTo(n)) {
				t.Fatalf("with ordering keys: %d jobs at once, start order %v; want 1 and %v", most, starts, upTo(n))
			}
		})
	}
}

// TestFanOutOrdersEachQueueApart: events of a key routed to two queues are
// ordered in each queue on its own: while the slow queue's first job of
// the key is held, the fast queue works all of its jobs of the key in
// order, and the slow queue's later jobs wait in its line, not in River;
// once released, they enter River with their ids and run in order too.
func TestFanOutOrdersEachQueueApart(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	p := newProbe()
	release := p.holdSeq(t, "k", "fan_slow", 0)
	probeClient(t, s.Pool, p, "fan_fast", "fan_slow")
	startDispatcher(t, s.Pool, probeRoutes(t))
	const n = 5
	publishSeqs(t, s.Pool, "fan.item.changed", "k", true, upTo(n)...)

	pgtest.WaitFor(t, 60*time.Second, "the fast queue's jobs of the key", func() bool { return len(p.ended("fan_fast/k")) == n })
	if got := p.ended("fan_fast/k"); !slices.Equal(got, upTo(n)) || p.most("fan_fast/k") != 1 {
		t.Errorf("fast queue: ended %v with %d at once, want %v one at a time", got, p.most("fan_fast/k"), upTo(n))
	}
	// The slow queue's head was handed off with the fast one's, but its
	// fetch may come after the fast queue's five jobs.
	pgtest.WaitFor(t, 60*time.Second, "the slow queue's head started", func() bool { return len(p.started("fan_slow/k")) > 0 })
	if got := p.started("fan_slow/k"); !slices.Equal(got, []int{0}) {
		t.Errorf("slow queue while its head is held: started %v, want [0]", got)
	}
	wantStates(t, s.Pool, "fan_slow", "k", map[int]string{0: "running", 1: "waiting", 2: "waiting", 3: "waiting", 4: "waiting"})
	var waiting []int64
	for seq := 1; seq < n; seq++ {
		waiting = append(waiting, jobOf(t, s.Pool, "fan_slow", "k", seq).id)
	}
	if got := inRiver(t, s.Pool, waiting...); got != 0 {
		t.Errorf("%d of the slow queue's waiting jobs %v have a river_job row, want none", got, waiting)
	}

	release()
	pgtest.WaitFor(t, 60*time.Second, "the slow queue's jobs of the key", func() bool { return len(p.ended("fan_slow/k")) == n })
	if got := p.started("fan_slow/k"); !slices.Equal(got, upTo(n)) || p.most("fan_slow/k") != 1 {
		t.Errorf("slow queue: started %v with %d at once, want %v one at a time", got, p.most("fan_slow/k"), upTo(n))
	}
	// The released jobs entered River with the ids they waited with. The
	// last one's Work has returned, but its completion is written just
	// after (the probe records the end first): wait for it.
	pgtest.WaitFor(t, 30*time.Second, "the slow queue's released jobs completed in river_job with the ids they waited with", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = ANY($1) AND state = 'completed'`, waiting) == n-1
	})
	pgtest.WaitFor(t, 30*time.Second, "both queues' key rows gone", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_key`) == 0
	})
}

// TestParkedKeys works keys whose jobs fail, in one schema with one River
// client, and checks the failure policy: a discarded or cancelled head
// parks its key, later jobs wait in its line and nothing is lost; outbox_unpark
// retry runs the head again and then the rest in order, skip leaves it and
// runs the rest; River's own JobRetry of a parked head unparks it; a
// retrying job holds its key; a waiting job cancelled by hand parks the key
// when its turn comes (the legacy path: River cannot cancel a job that
// waits in its line); and unordered events and other keys in the same
// queue are not held back by a parked key.
func TestParkedKeys(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 300*time.Second)
	p := newProbe()
	client := probeClient(t, s.Pool, p, "ord")
	startDispatcher(t, s.Pool, probeRoutes(t))

	// failSeq makes seq fail (or, with cancel, cancel itself) while fail
	// holds.
	failSeq := func(key string, seq int, cancel bool, fail *atomic.Bool) {
		p.hook(key, func(_ context.Context, job *river.Job[probeArgs]) error {
			if job.Args.Seq != seq || !fail.Load() {
				return nil
			}
			if cancel {
				return river.JobCancel(errors.New("the receiver gives up"))
			}
			return errors.New("the receiver fails")
		})
	}
	// parkAt publishes seqs 0..3 of key (park.: one attempt), waits until
	// seq 1's job is in state, and checks that the key is parked on it with
	// seqs 2 and 3 waiting in line behind it, not in River.
	parkAt := func(t *testing.T, key, state string) {
		t.Helper()
		publishSeqs(t, s.Pool, "park.item.changed", key, true, 0, 1, 2, 3)
		pgtest.WaitFor(t, 60*time.Second, key+" seq 1 "+state, func() bool { return jobOf(t, s.Pool, "ord", key, 1).state == state })
		pgtest.WaitFor(t, 30*time.Second, key+" jobs of seq 2 and 3", func() bool {
			return jobOf(t, s.Pool, "ord", key, 3).id != 0
		})
		wantStates(t, s.Pool, "ord", key, map[int]string{0: "completed", 1: state, 2: "waiting", 3: "waiting"})
		head := jobOf(t, s.Pool, "ord", key, 1)
		if k := keyOf(t, s.Pool, "ord", key); k.parkedState != state || k.headJob != head.id || k.headEvent != head.event || k.waiting != 2 {
			t.Fatalf("%s: key row %+v, want parked %s on job %d (event %d) with 2 waiting", key, k, state, head.id, head.event)
		}
		if got := p.started("ord/" + key); !slices.Equal(got, []int{0, 1}) {
			t.Fatalf("%s: started %v while parked, want [0 1]", key, got)
		}
	}
	// drained waits until key's jobs ended well are want, and checks
	// that the key row is gone.
	drained := func(t *testing.T, key string, want []int) {
		t.Helper()
		pgtest.WaitFor(t, 60*time.Second, key+" drained", func() bool { return len(p.ended("ord/"+key)) >= len(want) })
		if got := p.ended("ord/" + key); !slices.Equal(got, want) || p.most("ord/"+key) != 1 {
			t.Errorf("%s: ended %v with %d at once, want %v one at a time", key, got, p.most("ord/"+key), want)
		}
		pgtest.WaitFor(t, 30*time.Second, key+" row gone", func() bool { return !keyOf(t, s.Pool, "ord", key).found })
	}

	t.Run("discarded head, unpark retry", func(t *testing.T) {
		var fail atomic.Bool
		fail.Store(true)
		failSeq("retry", 1, false, &fail)
		parkAt(t, "retry", "discarded")
		if n := unpark(t, s.Pool, "retry", "retry", true); n != 1 || keyOf(t, s.Pool, "ord", "retry").parkedState != "discarded" {
			t.Fatalf("dry run touched %d keys or unparked it", n)
		}
		fail.Store(false)
		if n := unpark(t, s.Pool, "retry", "retry", false); n != 1 {
			t.Fatalf("unpark retry touched %d keys", n)
		}
		drained(t, "retry", []int{0, 1, 2, 3})
		if got := p.started("ord/retry"); !slices.Equal(got, []int{0, 1, 1, 2, 3}) {
			t.Errorf("start order %v, want [0 1 1 2 3]", got)
		}
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit WHERE action = 'unpark' AND filter->>'ordering_key' = 'retry'`); n != 1 {
			t.Errorf("%d audit rows, want 1", n)
		}
	})

	t.Run("discarded head, unpark skip; others go on meanwhile", func(t *testing.T) {
		var fail atomic.Bool
		fail.Store(true)
		failSeq("skip", 1, false, &fail)
		parkAt(t, "skip", "discarded")
		// The parked key holds back neither unordered events nor other
		// keys of its queue.
		publishSeqs(t, s.Pool, "order.item.changed", "free", false, upTo(5)...)
		publishSeqs(t, s.Pool, "order.item.changed", "busy", true, upTo(5)...)
		pgtest.WaitFor(t, 60*time.Second, "unordered events and another key", func() bool {
			return len(p.ended("ord/free")) == 5 && len(p.ended("ord/busy")) == 5
		})
		if k := keyOf(t, s.Pool, "ord", "skip"); k.parkedState != "discarded" {
			t.Fatalf("the parked key changed meanwhile: %+v", k)
		}
		if n := unpark(t, s.Pool, "skip", "skip", false); n != 1 {
			t.Fatalf("unpark skip touched %d keys", n)
		}
		drained(t, "skip", []int{0, 2, 3})
		wantStates(t, s.Pool, "ord", "skip", map[int]string{1: "discarded", 2: "completed", 3: "completed"})
		if got := p.started("ord/skip"); !slices.Equal(got, []int{0, 1, 2, 3}) {
			t.Errorf("start order %v, want [0 1 2 3]", got)
		}
	})

	t.Run("cancelled head parks", func(t *testing.T) {
		var fail atomic.Bool
		fail.Store(true)
		failSeq("cancel", 1, true, &fail)
		parkAt(t, "cancel", "cancelled")
		if n := unpark(t, s.Pool, "cancel", "skip", false); n != 1 {
			t.Fatalf("unpark skip touched %d keys", n)
		}
		drained(t, "cancel", []int{0, 2, 3})
	})

	t.Run("River's retry of a parked head unparks", func(t *testing.T) {
		var fail atomic.Bool
		fail.Store(true)
		failSeq("riverretry", 1, false, &fail)
		parkAt(t, "riverretry", "discarded")
		// The retried head is held while it runs, to see the key unparked.
		release := p.holdSeq(t, "riverretry", "", 1)
		head := jobOf(t, s.Pool, "ord", "riverretry", 1)
		if _, err := client.JobRetry(ctx, head.id); err != nil {
			t.Fatal(err)
		}
		pgtest.WaitFor(t, 60*time.Second, "the retried head running", func() bool { return jobOf(t, s.Pool, "ord", "riverretry", 1).state == "running" })
		if k := keyOf(t, s.Pool, "ord", "riverretry"); k.parkedState != "" || k.headJob != head.id {
			t.Errorf("key row while River's retry of the head runs: %+v, want unparked on job %d", k, head.id)
		}
		wantStates(t, s.Pool, "ord", "riverretry", map[int]string{2: "waiting", 3: "waiting"})
		release()
		drained(t, "riverretry", []int{0, 1, 2, 3})
		if got := p.started("ord/riverretry"); !slices.Equal(got, []int{0, 1, 1, 2, 3}) {
			t.Errorf("start order %v, want [0 1 1 2 3]", got)
		}
	})

	t.Run("a retrying job holds its key", func(t *testing.T) {
		second := make(chan struct{})
		var once sync.Once
		t.Cleanup(func() { once.Do(func() { close(second) }) })
		p.hook("retrying", func(ctx context.Context, job *river.Job[probeArgs]) error {
			if job.Args.Seq != 1 {
				return nil
			}
			if job.Attempt == 1 {
				return errors.New("the receiver fails once")
			}
			select {
			case <-second:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})
		publishSeqs(t, s.Pool, "order.item.changed", "retrying", true, 0, 1, 2)
		pgtest.WaitFor(t, 60*time.Second, "the second attempt of seq 1", func() bool {
			return slices.Equal(p.started("ord/retrying"), []int{0, 1, 1})
		})
		wantStates(t, s.Pool, "ord", "retrying", map[int]string{0: "completed", 1: "running", 2: "waiting"})
		if k := keyOf(t, s.Pool, "ord", "retrying"); k.parkedState != "" || k.headJob != jobOf(t, s.Pool, "ord", "retrying", 1).id {
			t.Errorf("key row while seq 1 retries: %+v", k)
		}
		once.Do(func() { close(second) })
		drained(t, "retrying", []int{0, 1, 2})
		if got := p.started("ord/retrying"); !slices.Equal(got, []int{0, 1, 1, 2}) {
			t.Errorf("start order %v, want [0 1 1 2]", got)
		}
	})

	// A job that waits in its line (migration 024) is not in River: River
	// cannot cancel it. This is the legacy path, a waiting job queued as a
	// pending river_job row before 024 (or inserted so by other code).
	t.Run("a waiting job cancelled by hand parks the key at its turn", func(t *testing.T) {
		release := p.holdSeq(t, "byhand", "", 0)
		publishSeqs(t, s.Pool, "order.item.changed", "byhand", true, 0, 1, 2)
		pgtest.WaitFor(t, 60*time.Second, "seq 0 running and seq 2 queued", func() bool {
			return jobOf(t, s.Pool, "ord", "byhand", 0).state == "running" && jobOf(t, s.Pool, "ord", "byhand", 2).id != 0
		})
		waiting := jobOf(t, s.Pool, "ord", "byhand", 1)
		if _, err := client.JobCancel(ctx, waiting.id); !errors.Is(err, rivertype.ErrNotFound) {
			t.Fatalf("River's cancel of job %d waiting in line: %v, want %v", waiting.id, err, rivertype.ErrNotFound)
		}
		wantStates(t, s.Pool, "ord", "byhand", map[int]string{1: "waiting", 2: "waiting"})
		if n := queueAsBefore024(t, s.Pool, "ord", "byhand"); n != 2 {
			t.Fatalf("moved %d waiting jobs to River, want 2", n)
		}
		wantStates(t, s.Pool, "ord", "byhand", map[int]string{0: "running", 1: "pending", 2: "pending"})
		cancelled := jobOf(t, s.Pool, "ord", "byhand", 1)
		if _, err := client.JobCancel(ctx, cancelled.id); err != nil {
			t.Fatal(err)
		}
		if k := keyOf(t, s.Pool, "ord", "byhand"); k.parkedState != "" {
			t.Fatalf("the key parked before the cancelled job's turn: %+v", k)
		}
		release()
		pgtest.WaitFor(t, 60*time.Second, "the key parked on the cancelled job", func() bool {
			k := keyOf(t, s.Pool, "ord", "byhand")
			return k.parkedState == "cancelled" && k.headJob == cancelled.id && k.headEvent == cancelled.event
		})
		wantStates(t, s.Pool, "ord", "byhand", map[int]string{0: "completed", 1: "cancelled", 2: "pending"})
		if n := unpark(t, s.Pool, "byhand", "skip", false); n != 1 {
			t.Fatalf("unpark skip touched %d keys", n)
		}
		drained(t, "byhand", []int{0, 2})
	})

	// Nothing lost: every event was handed off, and every job is
	// completed except the ones left discarded or cancelled on purpose.
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status <> 'done'`); n != 0 {
		t.Errorf("%d events not handed off", n)
	}
	pgtest.WaitFor(t, 30*time.Second, "every job finalized", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM `+pgtest.Jobs+` WHERE state NOT IN ('completed', 'discarded', 'cancelled')`) == 0
	})
}

// TestOrderWithoutCompletionMiddleware: a River client configured by hand,
// without NewOrderedCompletionMiddleware (River's completer completes the
// jobs), still works the jobs of each key one at a time and in order.
func TestOrderWithoutCompletionMiddleware(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	p := newProbe()
	workers := river.NewWorkers()
	river.AddWorker(workers, p)
	startClient(t, s.Pool, &river.Config{
		FetchCooldown:     10 * time.Millisecond,
		FetchPollInterval: 200 * time.Millisecond,
		Queues:            map[string]river.QueueConfig{"ord": {MaxWorkers: 10}},
		Workers:           workers,
	})
	startDispatcher(t, s.Pool, probeRoutes(t))
	const keys, per = 3, 8
	for k := range keys {
		p.hook(fmt.Sprintf("k%d", k), p.waitOverlap(20*time.Millisecond))
	}
	for seq := range per {
		for k := range keys {
			publishSeqs(t, s.Pool, "order.item.changed", fmt.Sprintf("k%d", k), true, seq)
		}
	}
	for k := range keys {
		id := fmt.Sprintf("ord/k%d", k)
		pgtest.WaitFor(t, 90*time.Second, id+" worked", func() bool { return len(p.ended(id)) == per })
		if got := p.started(id); !slices.Equal(got, upTo(per)) || p.most(id) != 1 {
			t.Errorf("%s: started %v with %d at once, want %v one at a time", id, got, p.most(id), upTo(per))
		}
	}
}

// NextRetry retries the first failed attempt of keys "cancelmark" and
// "deletedhead" an hour later, so that a test can cancel or delete it by
// hand while it is retryable; other jobs use the client's retry policy.
func (p *probe) NextRetry(job *river.Job[probeArgs]) time.Time {
	if (job.Args.Key == "cancelmark" || job.Args.Key == "deletedhead") && job.Attempt == 1 {
		return time.Now().Add(time.Hour)
	}
	return time.Time{}
}

// TestRiverActionsKeepTheOrder: what an operator does to ordered jobs with
// River's own tools (River UI, the client's JobRetry and JobCancel) keeps
// the order. A job that waits in its key's line (migration 024) is not in
// River, so River can neither retry nor cancel it; a waiting job queued as
// a pending river_job row (before 024, or by other code) can be, and
// River's retry of it, or of it cancelled by hand, does not let it
// overtake the head: it waits for its turn; and a head cancelled by River and retried through
// outbox_unpark is retried again when that attempt fails, as any job,
// instead of being cancelled by River's leftover cancel mark; a head
// deleted in River (River UI's delete of a retryable job) parks its key as
// deleted instead of leaving it stuck unseen.
func TestRiverActionsKeepTheOrder(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 180*time.Second)
	p := newProbe()
	client := probeClient(t, s.Pool, p, "ord")
	startDispatcher(t, s.Pool, probeRoutes(t))

	t.Run("River's retry of a waiting job", func(t *testing.T) {
		release := p.holdSeq(t, "jump", "", 0)
		publishSeqs(t, s.Pool, "order.item.changed", "jump", true, 0, 1, 2)
		pgtest.WaitFor(t, 60*time.Second, "seq 0 running and seq 2 queued", func() bool {
			return jobOf(t, s.Pool, "ord", "jump", 0).state == "running" && jobOf(t, s.Pool, "ord", "jump", 2).id != 0
		})
		// Waiting in line, seqs 1 and 2 are not River's to cancel or retry.
		if _, err := client.JobCancel(ctx, jobOf(t, s.Pool, "ord", "jump", 1).id); !errors.Is(err, rivertype.ErrNotFound) {
			t.Fatalf("River's cancel of seq 1 waiting in line: %v, want %v", err, rivertype.ErrNotFound)
		}
		for _, seq := range []int{1, 2} {
			if _, err := client.JobRetry(ctx, jobOf(t, s.Pool, "ord", "jump", seq).id); !errors.Is(err, rivertype.ErrNotFound) {
				t.Fatalf("River's retry of seq %d waiting in line: %v, want %v", seq, err, rivertype.ErrNotFound)
			}
		}
		wantStates(t, s.Pool, "ord", "jump", map[int]string{0: "running", 1: "waiting", 2: "waiting"})
		// The legacy path: seqs 1 and 2 wait as pending river_job rows.
		if n := queueAsBefore024(t, s.Pool, "ord", "jump"); n != 2 {
			t.Fatalf("moved %d waiting jobs to River, want 2", n)
		}
		// Seq 1 is cancelled by hand and then retried: it takes its turn
		// again. Seq 2 is retried while it waits: it keeps its turn.
		if _, err := client.JobCancel(ctx, jobOf(t, s.Pool, "ord", "jump", 1).id); err != nil {
			t.Fatal(err)
		}
		for _, seq := range []int{1, 2} {
			if _, err := client.JobRetry(ctx, jobOf(t, s.Pool, "ord", "jump", seq).id); err != nil {
				t.Fatal(err)
			}
		}
		wantStates(t, s.Pool, "ord", "jump", map[int]string{0: "running", 1: "pending", 2: "pending"})
		release()
		pgtest.WaitFor(t, 60*time.Second, "the key drained", func() bool { return len(p.ended("ord/jump")) == 3 })
		if got := p.started("ord/jump"); !slices.Equal(got, []int{0, 1, 2}) || p.most("ord/jump") != 1 {
			t.Errorf("start order %v with %d at once, want [0 1 2] one at a time", got, p.most("ord/jump"))
		}
	})

	t.Run("outbox_unpark retry of a head River cancelled", func(t *testing.T) {
		p.hook("cancelmark", func(_ context.Context, job *river.Job[probeArgs]) error {
			if job.Args.Seq == 0 && job.Attempt < 3 {
				return fmt.Errorf("attempt %d fails", job.Attempt)
			}
			return nil
		})
		publishSeqs(t, s.Pool, "order.item.changed", "cancelmark", true, 0, 1)
		pgtest.WaitFor(t, 60*time.Second, "the head retryable", func() bool { return jobOf(t, s.Pool, "ord", "cancelmark", 0).state == "retryable" })
		head := jobOf(t, s.Pool, "ord", "cancelmark", 0)
		if _, err := client.JobCancel(ctx, head.id); err != nil {
			t.Fatal(err)
		}
		if k := keyOf(t, s.Pool, "ord", "cancelmark"); k.parkedState != "cancelled" {
			t.Fatalf("key row after River cancelled the head: %+v, want parked cancelled", k)
		}
		if n := unpark(t, s.Pool, "cancelmark", "retry", false); n != 1 {
			t.Fatalf("unpark retry touched %d keys", n)
		}
		// Attempt 2 fails: the head must be retried (attempt 3 succeeds),
		// not cancelled again.
		pgtest.WaitFor(t, 60*time.Second, "the head finalized", func() bool {
			st := jobOf(t, s.Pool, "ord", "cancelmark", 0).state
			return st == "completed" || st == "cancelled" || st == "discarded"
		})
		if st := jobOf(t, s.Pool, "ord", "cancelmark", 0).state; st != "completed" {
			t.Fatalf("the head retried by outbox_unpark is %s after a failed attempt, want retried and completed (River's cancel mark left in its metadata?)", st)
		}
		pgtest.WaitFor(t, 60*time.Second, "the key drained", func() bool { return len(p.ended("ord/cancelmark")) == 2 })
	})
	t.Run("River's delete of the head", func(t *testing.T) {
		p.hook("deletedhead", func(_ context.Context, job *river.Job[probeArgs]) error {
			if job.Args.Seq == 0 {
				return errors.New("the receiver fails")
			}
			return nil
		})
		publishSeqs(t, s.Pool, "order.item.changed", "deletedhead", true, 0, 1)
		pgtest.WaitFor(t, 60*time.Second, "the head retryable", func() bool { return jobOf(t, s.Pool, "ord", "deletedhead", 0).state == "retryable" })
		head := jobOf(t, s.Pool, "ord", "deletedhead", 0)
		if _, err := client.JobDelete(ctx, head.id); err != nil {
			t.Fatal(err)
		}
		if k := keyOf(t, s.Pool, "ord", "deletedhead"); k.parkedState != "deleted" || k.headJob != head.id {
			t.Fatalf("key row after River deleted the head: %+v, want parked deleted on job %d", k, head.id)
		}
		if n := unpark(t, s.Pool, "deletedhead", "skip", false); n != 1 {
			t.Fatalf("unpark skip touched %d keys", n)
		}
		pgtest.WaitFor(t, 60*time.Second, "the key drained", func() bool { return len(p.ended("ord/deletedhead")) == 1 })
	})
}
