package chaos

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestLedgerDetectsEveryKindOfLoss feeds the ledger a hand-made outbox
// with one of each fault, so that a chaos scenario passing means something:
// a done event without its job (lost), a second job for a pair
// (duplicated), a pending event (stuck), a missing event (lost), a job for
// an event the ledger does not know and a stored rolled-back event
// (phantom).
func TestLedgerDetectsEveryKindOfLoss(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	const run = "ledger"
	const n = 8
	// Events 0..7 as a healthy dispatcher leaves them: mail → one job,
	// audit (3) → two, unrouted (7) → failed.
	for i := range n {
		if i == 5 {
			continue // lost: never stored
		}
		status := "done"
		switch i {
		case 7:
			status = "failed"
		case 6:
			status = "pending" // stuck
		}
		var id int64
		if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, dispatch_key, status) VALUES ($1, '{}', $2, $3::outbox_status) RETURNING id`,
			eventType(i), keyOf(run, i), status).Scan(&id); err != nil {
			t.Fatal(err)
		}
		if status != "done" {
			continue
		}
		queues := queuesOf(eventType(i))
		if i == 1 {
			queues = nil // lost: done without its job
		}
		if i == 2 {
			queues = append(queues, queues...) // duplicated
		}
		var ids []int64
		for _, q := range queues {
			var jid int64
			if err := s.Pool.QueryRow(ctx, `INSERT INTO river_job (args, kind, max_attempts, queue, state)
				VALUES (jsonb_build_object('event_id', $1::bigint, 'dispatch_key', $2::text), 'outbox_event', 5, $3, 'available') RETURNING id`,
				id, keyOf(run, i), q).Scan(&jid); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, jid)
		}
		if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET river_job_ids = $2 WHERE id = $1`, id, ids); err != nil {
			t.Fatal(err)
		}
	}
	// A phantom job for an unknown event, and a "rolled-back" key stored.
	if _, err := s.Pool.Exec(ctx, `INSERT INTO river_job (args, kind, max_attempts, queue, state)
		VALUES (jsonb_build_object('event_id', 999999, 'dispatch_key', 'ledger:999'), 'outbox_event', 5, 'outbox_mail', 'available')`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, dispatch_key) VALUES ('mail.a.b', '{}', 'rb-1')`); err != nil {
		t.Fatal(err)
	}
	l := &ledger{run: run, n: n, rolledBack: []string{"rb-1"}}
	c, err := l.check(ctx, s.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if c.Lost != 2 || c.Duplicated < 1 || c.Pending != 1 || c.Phantom != 2 {
		t.Fatalf("ledger saw lost=%d duplicated=%d stuck=%d phantom=%d, want 2, ≥1, 1, 2\n%v", c.Lost, c.Duplicated, c.Pending, c.Phantom, c.Problems)
	}
}

// orderedFixture is a healthy ordered scenario by hand: two keys of one
// tenant in one queue, events 0, 2, 4 on key a (positions 10, 30, 50) and
// 1, 3, 5 on key b (20, 40, 60), one completed job each (job id 100 +
// index) and one successful run each, the runs of a key one after the
// other, 10 ms apart; the two keys run side by side.
func orderedFixture() (events []orderedEvent, jobs []orderedJob, runs []orderedRun) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := range 6 {
		key := "a"
		if i%2 == 1 {
			key = "b"
		}
		events = append(events, orderedEvent{Index: i, ID: int64(i + 1), Tenant: "t", Key: key, Position: int64(10 * (i + 1)),
			Status: "done", Queues: []string{"outbox_mail"}})
		jobs = append(jobs, orderedJob{ID: int64(100 + i), EventID: int64(i + 1), Queue: "outbox_mail", State: "completed", Attempt: 1, CreatedAt: t0})
		start := t0.Add(time.Duration(i/2) * 10 * time.Millisecond)
		runs = append(runs, orderedRun{Proc: "w0", JobID: int64(100 + i), Attempt: 1, EventID: int64(i + 1), Queue: "outbox_mail",
			Tenant: "t", Key: key, Position: int64(10 * (i + 1)), Start: start, End: start.Add(5 * time.Millisecond), OK: true})
	}
	return events, jobs, runs
}

// TestLedgerDetectsOrderingFaults feeds checkOrder hand-made records with
// one fault each, so that an ordering scenario passing means something: a
// healthy run and a killed-then-retried job pass; a reorder, a run that
// starts before its predecessor ended, an overlap with a killed run (or
// with a run whose process lives and never ended), a lost event, a
// completed job nobody ran, a second job, an attempt run twice, and a run
// of an unknown job are each caught, by the counter that names them.
func TestLedgerDetectsOrderingFaults(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	for _, tc := range []struct {
		name   string
		mutate func(evs []orderedEvent, jobs []orderedJob, runs []orderedRun, died map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun)
		want   func(c orderCounts) bool
	}{
		{"healthy", nil, func(c orderCounts) bool { return c.faults() == 0 && c.Keys == 2 && c.Killed == 0 }},
		{"killed then retried", func(e []orderedEvent, j []orderedJob, r []orderedRun, died map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			// Job 102 (key a, position 30): attempt 1 is cut by the kill
			// of w1 at +22 ms; attempt 2 runs in w0 from +23 ms; key a's
			// next job starts after that.
			k := r[2]
			r[2].Attempt, r[2].Start, r[2].End = 2, k.Start.Add(13*ms), k.Start.Add(18*ms)
			r[4].Start, r[4].End = k.Start.Add(20*ms), k.Start.Add(25*ms)
			j[2].Attempt = 2
			died["w1"] = k.Start.Add(12 * ms)
			cut := k
			cut.Proc, cut.End, cut.OK = "w1", time.Time{}, false
			return e, j, append(r, cut)
		}, func(c orderCounts) bool {
			return c.faults() == 0 && c.Killed == 1 && c.RetriedJobs == 1 && c.Reruns == 1
		}},
		{"reordered", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			// Key a's positions 10 and 30 run the wrong way round.
			r[0].Start, r[2].Start = r[2].Start, r[0].Start
			r[0].End, r[2].End = r[2].End, r[0].End
			return e, j, r
		}, func(c orderCounts) bool { return c.Reordered > 0 }},
		{"positions against publish order", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			e[0].Index, e[2].Index = 2, 0 // event 2 was published first but has the lower position
			return e, j, r
		}, func(c orderCounts) bool { return c.Reordered > 0 }},
		{"started before its predecessor ended", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			// A failed first attempt of job 102 while job 100 ran.
			early := r[2]
			early.Start, early.End, early.OK = r[0].Start.Add(ms), r[0].Start.Add(2*ms), false
			r[2].Attempt, j[2].Attempt = 2, 2
			return e, j, append(r, early)
		}, func(c orderCounts) bool { return c.Early > 0 && c.Overlaps > 0 }},
		{"overlaps a killed run", func(e []orderedEvent, j []orderedJob, r []orderedRun, died map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			// Attempt 1 of job 102 was cut, but its process died only
			// after attempt 2 had started: two runs of key a at once.
			k := r[2]
			r[2].Attempt, j[2].Attempt = 2, 2
			died["w1"] = k.Start.Add(2 * ms)
			cut := k
			cut.Proc, cut.Start, cut.End, cut.OK = "w1", k.Start.Add(-ms), time.Time{}, false
			return e, j, append(r, cut)
		}, func(c orderCounts) bool { return c.Overlaps > 0 && c.Early == 0 && c.Reordered == 0 }},
		{"a run that never ended in a live process", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			k := r[2]
			r[2].Attempt, j[2].Attempt = 2, 2
			cut := k
			cut.Proc, cut.Start, cut.End, cut.OK = "w1", k.Start.Add(-ms), time.Time{}, false
			return e, j, append(r, cut)
		}, func(c orderCounts) bool { return c.Overlaps > 0 && c.Stuck > 0 }},
		{"lost event", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			return e[1:], j[1:], r[1:]
		}, func(c orderCounts) bool { return c.Lost == 1 }},
		{"completed job nobody ran", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			return e, j, r[1:]
		}, func(c orderCounts) bool { return c.Lost == 1 }},
		{"event without its job", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			return e, j[:5], r[:5]
		}, func(c orderCounts) bool { return c.Lost == 1 }},
		{"second job worked", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			// Event 5 got a second job, worked after the first.
			dup := r[5]
			dup.JobID, dup.Start, dup.End = 200, r[5].End.Add(ms), r[5].End.Add(2*ms)
			return e, append(j, orderedJob{ID: 200, EventID: 6, Queue: "outbox_mail", State: "completed", Attempt: 1}), append(r, dup)
		}, func(c orderCounts) bool { return c.Duplicated > 0 }},
		{"one attempt run by two processes", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			dup := r[5]
			dup.Proc, dup.Start, dup.End = "w1", r[5].End.Add(ms), r[5].End.Add(2*ms)
			return e, j, append(r, dup)
		}, func(c orderCounts) bool { return c.Duplicated > 0 }},
		{"job still pending", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			j[5].State = "pending"
			return e, j, r[:5]
		}, func(c orderCounts) bool { return c.Stuck == 1 && c.Lost == 0 }},
		{"run of an unknown job", func(e []orderedEvent, j []orderedJob, r []orderedRun, _ map[string]time.Time) ([]orderedEvent, []orderedJob, []orderedRun) {
			ph := r[5]
			ph.JobID = 999
			return e, j, append(r, ph)
		}, func(c orderCounts) bool { return c.Phantom == 1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			evs, jobs, runs := orderedFixture()
			died := map[string]time.Time{}
			if tc.mutate != nil {
				evs, jobs, runs = tc.mutate(evs, jobs, runs, died)
			}
			c := checkOrder(6, evs, jobs, runs, died)
			if !tc.want(c) {
				t.Errorf("%s\n%s", c.summary(), c.problems())
			}
		})
	}
}

// TestLedgerReadsAKilledWorkersFile reads a worker's ledger as a kill leaves it: a
// finished run, a run without its end record, and a last line cut in the
// middle of its write, which is skipped; a bad line elsewhere is an error.
func TestLedgerReadsAKilledWorkersFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	good := `{"kind":"start","job_id":7,"attempt":1,"event_id":3,"queue":"q","tenant":"t","key":"k","position":9,"at":1000}
{"kind":"end","job_id":7,"attempt":1,"event_id":3,"queue":"q","tenant":"t","key":"k","position":9,"at":2000,"ok":true}
{"kind":"start","job_id":8,"attempt":2,"event_id":4,"queue":"q","tenant":"t","key":"k","position":11,"at":3000}
`
	p := filepath.Join(dir, "w.jsonl")
	if err := os.WriteFile(p, []byte(good+`{"kind":"end","job_id":8,"att`), 0o600); err != nil {
		t.Fatal(err)
	}
	runs, err := readLedgerFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if len(runs) != 2 || !runs[0].OK || runs[0].End.UnixNano() != 2000 || runs[0].Position != 9 ||
		runs[1].JobID != 8 || runs[1].Attempt != 2 || !runs[1].End.IsZero() || runs[1].Proc != "w.jsonl" {
		t.Fatalf("runs = %+v", runs)
	}
	if err := os.WriteFile(p, []byte(`{"kind":"start",`+"\n"+good), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := readLedgerFile(p); err == nil {
		t.Fatal("a bad line in the middle of a ledger was accepted")
	}
}
