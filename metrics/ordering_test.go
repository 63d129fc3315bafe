package metrics_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/metrics"
)

func ev(tenant, key string) outbox.Event {
	return outbox.Event{Type: "order.step.done", TenantID: tenant, OrderingKey: key}
}

// TestReadOrderingCountsParkedWaitingAndHeldKeys builds, with the real
// claim and triggers, a key parked by a discarded head with two jobs
// behind it, a key parked by a cancelled head with none, a running key
// with one job waiting and a key held in the outbox behind a failed
// event, and checks ReadOrdering and the /metrics gauges: each count by
// state, the waiting jobs with and without parked keys, the oldest waits
// (overall and among parked keys apart) and the held keys. An empty schema
// reads all zeros.
func TestReadOrderingCountsParkedWaitingAndHeldKeys(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, 120*time.Second)

	if o, err := metrics.ReadOrdering(ctx, s.Pool); err != nil || o != (metrics.Ordering{}) {
		t.Fatalf("unused ordering: %+v, %v; want all zero", o, err)
	}

	ids := pgtest.Publish(t, s.Pool,
		ev("acme", "parked-d"), ev("acme", "parked-d"), ev("acme", "parked-d"),
		ev("", "parked-c"),
		ev("acme", "running"), ev("acme", "running"),
		ev("beta", "held"), ev("beta", "held"), ev("beta", "held"),
		outbox.Event{Type: "order.unkeyed.done"})
	// The first event of "held" is dead-lettered before the handoff: the
	// claim keeps the two after it pending in the outbox.
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', last_error = 'test' WHERE id = $1`, ids[6]); err != nil {
		t.Fatal(err)
	}
	if res := ordertest.HandOff(t, s.Pool, nil); res.Jobs != 7 || res.Blocked != 2 {
		t.Fatalf("handoff %+v, want 7 jobs and the 2 held events blocked", res)
	}
	ordertest.FinalizeHead(t, s.Pool, "acme", "parked-d", "discarded")
	ordertest.FinalizeHead(t, s.Pool, "", "parked-c", "cancelled")
	// Back-date the waits and a parking so the ages tell the keys apart:
	// the longest wait overall is behind the running key, the longest
	// among parked keys behind parked-d.
	if _, err := s.Pool.Exec(ctx, `
		UPDATE outbox_ordering_wait SET since = now() - CASE ordering_key WHEN 'running' THEN interval '10 minutes' ELSE interval '5 minutes' END;
		UPDATE outbox_ordering_key SET parked_at = now() - interval '1 hour' WHERE ordering_key = 'parked-c'`); err != nil {
		t.Fatal(err)
	}

	o, err := metrics.ReadOrdering(ctx, s.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if o.Keys != 3 || o.ParkedDiscarded != 1 || o.ParkedCancelled != 1 || o.ParkedDeleted != 0 || o.Parked() != 2 ||
		o.Waiting != 3 || o.WaitingParked != 2 || o.HeldKeys != 1 {
		t.Fatalf("ordering %+v: want 3 keys, 1 parked discarded, 1 cancelled, 3 waiting (2 behind parked keys), 1 held", o)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait`); int64(n) != o.Waiting {
		t.Fatalf("Waiting %d  but %d rows in outbox_ordering_wait", o.Waiting, n)
	}
	if o.OldestWait < 10*time.Minute || o.OldestWait > 11*time.Minute ||
		o.OldestParkedWait < 5*time.Minute || o.OldestParkedWait > 6*time.Minute ||
		o.OldestParkedAge < time.Hour || o.OldestParkedAge > time.Hour+time.Minute {
		t.Fatalf("ages %+v: want the oldest wait 10m, the oldest behind a parked key 5m, parked for 1h", o)
	}

	got := gauges(t, s.Pool)
	want := map[string]float64{
		"outbox_database_up":                           1,
		"outbox_ordering_keys":                         3,
		"outbox_ordering_parked_keys{state=discarded}": 1,
		"outbox_ordering_parked_keys{state=cancelled}": 1,
		"outbox_ordering_parked_keys{state=deleted}":   0,
		"outbox_ordering_waiting_jobs":                 3,
		"outbox_ordering_parked_waiting_jobs":          2,
		"outbox_ordering_held_keys":                    1,
	}
	for name, v := range want {
		if g, ok := got[name]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", name, g, ok, v)
		}
	}
	if g := got["outbox_ordering_oldest_wait_seconds"]; g < 600 || g > 660 {
		t.Errorf("outbox_ordering_oldest_wait_seconds = %v, want about 600", g)
	}
	if g := got["outbox_ordering_parked_oldest_wait_seconds"]; g < 300 || g > 360 {
		t.Errorf("outbox_ordering_parked_oldest_wait_seconds = %v, want about 300", g)
	}
	if g := got["outbox_ordering_oldest_parked_age_seconds"]; g < 3600 || g > 3660 {
		t.Errorf("outbox_ordering_oldest_parked_age_seconds = %v, want about 3600", g)
	}
}

// gauges registers a metrics collector on pool and returns every gauge it
// reports, by name, with its labels as {name=value} after the name.
func gauges(t *testing.T, pool *pgxpool.Pool) map[string]float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := metrics.New(metrics.Config{Pool: pool}).Register(reg); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			name := f.GetName()
			for _, l := range m.GetLabel() {
				name += "{" + l.GetName() + "=" + l.GetValue() + "}"
			}
			if m.GetGauge() != nil {
				got[name] = m.GetGauge().GetValue()
			}
		}
	}
	return got
}
