package chaos

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// soakDuration is SOAK_DURATION (a Go duration), else 15 s.
func soakDuration(t *testing.T) time.Duration {
	if v := os.Getenv("SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 5*time.Second {
			t.Fatalf("SOAK_DURATION=%q: want a Go duration of at least 5s, e.g. 2m", v)
		}
		return d
	}
	return 15 * time.Second
}

// rssKB reads VmRSS of pid from /proc.
func rssKB(pid int) (int, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			return strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(rest), " kB"))
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

type soakSample struct {
	At        time.Duration
	RSSKB     int
	Pending   int
	Published int64
	P50, P99  float64 // handoff latency (ms) of the events done since the last sample
	Done      int
}

// TestSoak publishes at a steady rate from several producers into one
// outboxd for SOAK_DURATION (15 s by default; `make soak` runs 2 minutes),
// sampling the daemon's RSS, the pending backlog and the handoff latency
// every second. Memory must stay flat-ish, the backlog bounded and the
// latency without drift (all with generous bounds: this is a 2-core CI
// machine shared with other tests), and the ledger must balance.
func TestSoak(t *testing.T) {
	if testing.Short() {
		t.Skip("soak: not in -short")
	}
	t.Parallel()
	dur := soakDuration(t)
	rate := envInt("SOAK_RATE", 200) // events per second, all producers
	workers := envInt("SOAK_PRODUCERS", 4)
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})
	ctx := pgtest.Context(t, dur+5*time.Minute)
	d := startDaemon(t, daemonEnv(s.URL, routesFile(t), "OUTBOX_DISPATCH_INTERVAL_MS=1000"))
	d.waitLog(t, "outbox listener connected", time.Minute)
	pool := producerPool(t, s.URL, int32(workers+1))
	run := "soak"

	var next, published, errs atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	interval := time.Duration(float64(time.Second) * float64(workers) / float64(rate))
	for range workers {
		wg.Go(func() {
			tick := time.NewTicker(interval)
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				i := int(next.Add(1) - 1)
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := outbox.Publish(ctx, tx, outbox.Event{Type: eventType(i), Payload: json.RawMessage(`{"soak": true, "pad": "` + strings.Repeat("x", 200) + `"}`), DispatchKey: keyOf(run, i)})
					return err
				})
				if err != nil {
					errs.Add(1)
					t.Errorf("publish %d: %v", i, err)
					return
				}
				published.Add(1)
			}
		})
	}

	var samples []soakSample
	start := time.Now()
	var dbLast time.Time
	if err := s.Pool.QueryRow(ctx, `SELECT now()`).Scan(&dbLast); err != nil {
		t.Fatal(err)
	}
	tick := time.NewTicker(time.Second)
	for time.Since(start) < dur {
		<-tick.C
		var sm soakSample
		sm.At = time.Since(start).Round(time.Second)
		var err error
		if sm.RSSKB, err = rssKB(d.cmd.Process.Pid); err != nil {
			t.Fatalf("outboxd is gone: %v\n%s", err, tail(d.out.String(), 2000))
		}
		var p50, p99 *float64
		var now time.Time
		if err := s.Pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM outbox_event WHERE status = 'pending'),
			(SELECT count(*) FROM outbox_event WHERE status = 'done' AND processed_at > $1),
			(SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM processed_at - created_at)) * 1000 FROM outbox_event WHERE status = 'done' AND processed_at > $1),
			(SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM processed_at - created_at)) * 1000 FROM outbox_event WHERE status = 'done' AND processed_at > $1),
			statement_timestamp()`, dbLast).Scan(&sm.Pending, &sm.Done, &p50, &p99, &now); err != nil {
			t.Fatal(err)
		}
		dbLast = now
		if p50 != nil {
			sm.P50, sm.P99 = *p50, *p99
		}
		sm.Published = published.Load()
		samples = append(samples, sm)
	}
	tick.Stop()
	close(stop)
	wg.Wait()
	elapsed := time.Since(start)

	n := int(next.Load())
	if errs.Load() > 0 {
		t.Fatalf("%d publishes failed", errs.Load())
	}
	verify(t, ctx, s.Pool, &ledger{run: run, n: n}, report{Scenario: "soak", Elapsed: elapsed,
		Note: fmt.Sprintf("%d events/s, %d producers, %s", rate, workers, dur)}, settle, d)

	// Figures: steady state is everything after the first fifth (warm-up).
	warm := samples[len(samples)/5:]
	third := max(1, len(warm)/3)
	first, last := warm[:third], warm[len(warm)-third:]
	median := func(xs []soakSample, f func(soakSample) float64) float64 {
		v := make([]float64, len(xs))
		for i, x := range xs {
			v[i] = f(x)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	rss := func(x soakSample) float64 { return float64(x.RSSKB) / 1024 }
	p50 := func(x soakSample) float64 { return x.P50 }
	p99 := func(x soakSample) float64 { return x.P99 }
	maxPending, maxRSS := 0, 0
	for _, x := range samples {
		maxPending = max(maxPending, x.Pending)
		maxRSS = max(maxRSS, x.RSSKB)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "soak: %d events in %s at %d/s from %d producers\n", n, elapsed.Round(time.Second), rate, workers)
	fmt.Fprintf(&b, "  RSS MiB    first third %.1f, last third %.1f, max %.1f\n", median(first, rss), median(last, rss), float64(maxRSS)/1024)
	fmt.Fprintf(&b, "  latency ms p50 first %.1f last %.1f; p99 first %.1f last %.1f\n", median(first, p50), median(last, p50), median(first, p99), median(last, p99))
	fmt.Fprintf(&b, "  pending    max %d, final 0 after settle\n", maxPending)
	fmt.Fprintf(&b, "  %6s %8s %8s %9s %8s %8s\n", "t", "rss_mib", "pending", "done/s", "p50_ms", "p99_ms")
	step := max(1, len(samples)/20)
	for i := 0; i < len(samples); i += step {
		x := samples[i]
		fmt.Fprintf(&b, "  %6s %8.1f %8d %9d %8.1f %8.1f\n", x.At, rss(x), x.Pending, x.Done, x.P50, x.P99)
	}
	t.Log("\n" + b.String())
	soakFigures.Store(b.String())

	// Generous bounds: a leak or a runaway backlog, not a busy machine.
	if a, z := median(first, rss), median(last, rss); z > a*1.5+32 {
		t.Errorf("RSS grew from %.1f MiB to %.1f MiB over the run", a, z)
	}
	if limit := max(5*rate, 2000); maxPending > limit {
		t.Errorf("pending backlog reached %d (bound %d): the dispatcher does not keep up with %d events/s", maxPending, limit, rate)
	}
	if a, z := median(first, p50), median(last, p50); z > 5*a+500 {
		t.Errorf("median handoff latency drifted from %.1f ms to %.1f ms", a, z)
	}
	if code := d.stop(60 * time.Second); code != 0 {
		t.Errorf("outboxd exit %d after SIGTERM", code)
	}
}

// soakFigures holds the last soak's summary for the report.
var soakFigures atomic.Value
