// Command bench is the outbox's benchmark suite: handoff and end-to-end
// latency (notify vs poll vs River alone), latency versus offered rate
// (notify vs River alone, optionally Graphile Worker), drain throughput (1, 2, 4
// dispatchers; batch 100 vs 1000; beside River's raw InsertMany), the
// producer cost of the wake trigger, the dispatcher's memory and CPU, and
// (on request) a long soak through outboxd.
//
// It creates a fresh database (outbox_bench_<pid>) on the server that
// TEST_DATABASE_URL / DATABASE_URL / 127.0.0.1:5432 names, runs every
// scenario in it, drops it, prints a markdown table and writes results.json
// and PNG plots under -out. See docs/benchmarks.md.
//
//	go run . -quick            # under a minute (CI)
//	go run .                   # the full suite, about eight minutes
//	go run . -scenarios latency -rate 500 -duration 20s
//	go run . -scenarios rates -peers graphile
//	go run . -scenarios soak -soak-rate 800 -soak-duration 20m
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Options are the command-line flags.
type Options struct {
	Scenarios        []string
	Rate             int
	Duration         time.Duration
	N                int
	Dispatchers      []int
	Batches          []int
	Clients          []int
	ProducerDuration time.Duration
	ProducerReps     int
	// ScalingConcurrency: also drain with this OUTBOX_DISPATCH_CONCURRENCY
	// per dispatcher (0: skip).
	ScalingConcurrency int
	Concurrency        int
	Quick              bool
	// Rates are the offered rates of the rates scenario, each run for
	// RatesDuration per mode; Peers are the peer job queues run beside.
	Rates         []int
	RatesDuration time.Duration
	Peers         []string
	// Warmup is how long each run of the latency and rates scenarios is
	// offered its rate before the events it measures (loadSpec.warmup).
	Warmup time.Duration
	// SoakRate, SoakDuration and SoakInterval are the soak scenario's
	// offered rate, length and sampling interval.
	SoakRate     int
	SoakDuration time.Duration
	SoakInterval time.Duration
	// OrderingModes selects the ordering scenario's modes (none: all);
	// OrderingKeys overrides its number of keys (0: 10,000, quick 1,000).
	OrderingModes []string
	OrderingKeys  int
	Out           string
	Repo          string
	URL           string
	Keep          bool
	Verbose       bool
}

func main() {
	os.Exit(run())
}

func run() int {
	var (
		o           Options
		scenarios   string
		dispatchers string
		batches     string
		clients     string
		rates       string
		peers       string
	)
	flag.StringVar(&scenarios, "scenarios", "latency,rates,drain,producer,scheduled", "comma-separated scenarios to run: latency, rates (latency versus rate), drain (includes resources), producer, scheduled (claim of due events beside a backlog due tomorrow), ordering (per-key ordering: drains with and without keys, a hot key; not in the default list), soak (a long run through outboxd at -soak-rate; not run by default)")
	flag.StringVar(&rates, "rates", "200,500,1000,2000,4000,8000", "rates: offered events per second (quick mode: 200,1000)")
	flag.DurationVar(&o.RatesDuration, "rates-duration", 10*time.Second, "rates: duration per rate and mode (quick mode: 2s)")
	flag.DurationVar(&o.Warmup, "warmup", time.Second, "latency, rates: how long each run is offered its rate before the events it measures; the warmup's events (a cold start: new sessions, first plans) are kept out of the percentiles and reported apart")
	flag.StringVar(&peers, "peers", "", "rates: peer job queues to run beside the outbox: graphile (Graphile Worker on Node; skipped with a note when Node or the package cannot be installed)")
	flag.IntVar(&o.SoakRate, "soak-rate", 1000, "soak: offered events per second (not in the default scenarios: -scenarios soak)")
	flag.DurationVar(&o.SoakDuration, "soak-duration", 2*time.Minute, "soak: how long the producers run")
	flag.DurationVar(&o.SoakInterval, "soak-interval", 10*time.Second, "soak: sampling interval")
	var orderingModes string
	flag.StringVar(&orderingModes, "ordering-modes", "", "ordering: comma-separated subset of the modes to run: "+strings.Join(orderingModeNames, ", ")+" (default all; the ratio needs unordered)")
	flag.IntVar(&o.OrderingKeys, "ordering-keys", 0, "ordering: number of keys of the many-keys mode and events of the hot key (default 10000, quick 1000)")
	flag.IntVar(&o.Rate, "rate", 200, "latency: events per second")
	flag.DurationVar(&o.Duration, "duration", 10*time.Second, "latency: duration per mode")
	flag.IntVar(&o.N, "n", 100_000, "drain: backlog size")
	flag.StringVar(&dispatchers, "dispatchers", "1,2,4", "drain: dispatcher counts (outboxd processes)")
	flag.StringVar(&batches, "batches", "100,1000", "drain: batch sizes (OUTBOX_DISPATCH_BATCH_SIZE)")
	flag.IntVar(&o.Concurrency, "concurrency", 0, "drain: OUTBOX_DISPATCH_CONCURRENCY of each outboxd (0: its default, 10)")
	flag.StringVar(&clients, "clients", "1,8,32", "producer: client counts")
	flag.DurationVar(&o.ProducerDuration, "producer-duration", 1500*time.Millisecond, "producer: measurement time per cell and repetition")
	flag.IntVar(&o.ScalingConcurrency, "scaling-concurrency", 1, "drain: also run the dispatcher counts at this concurrency each, to show scaling (0: skip; quick mode skips)")
	flag.IntVar(&o.ProducerReps, "producer-reps", 3, "producer: repetitions per cell (interleaved across variants; the median counts)")
	flag.BoolVar(&o.Quick, "quick", false, "quick mode (CI): 2 s latency runs, N=10000, 0.7 s producer cells")
	flag.StringVar(&o.Out, "out", "", "output directory (default results/<timestamp>)")
	flag.StringVar(&o.Repo, "repo", "..", "root of the outbox module (to build cmd/outboxd)")
	flag.StringVar(&o.URL, "db", "", "server connection string (default TEST_DATABASE_URL, DATABASE_URL, postgres://postgres@127.0.0.1:5432/postgres)")
	flag.BoolVar(&o.Keep, "keep", false, "keep the bench database (for EXPLAIN and friends) instead of dropping it")
	flag.BoolVar(&o.Verbose, "v", false, "log the dispatchers' info messages")
	flag.Parse()
	for _, m := range strings.Split(orderingModes, ",") {
		if m = strings.TrimSpace(m); m != "" {
			if !slices.Contains(orderingModeNames, m) {
				fmt.Fprintf(os.Stderr, "bench: -ordering-modes: unknown mode %q (want one of %s)\n", m, strings.Join(orderingModeNames, ", "))
				return 2
			}
			o.OrderingModes = append(o.OrderingModes, m)
		}
	}

	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if o.Quick {
		if !set["duration"] {
			o.Duration = 2 * time.Second
		}
		if !set["n"] {
			o.N = 10_000
		}
		if !set["scaling-concurrency"] {
			o.ScalingConcurrency = 0
		}
		if !set["rates"] {
			rates = "200,1000"
		}
		if !set["rates-duration"] {
			o.RatesDuration = 2 * time.Second
		}
		if !set["producer-duration"] {
			o.ProducerDuration = 700 * time.Millisecond
			o.ProducerReps = 1
		}
	}
	var err error
	o.Scenarios = splitList(scenarios)
	for _, s := range o.Scenarios {
		switch s {
		case "latency", "rates", "drain", "producer", "scheduled", "ordering", "soak":
		default:
			fmt.Fprintf(os.Stderr, "bench: -scenarios: unknown scenario %q (want latency, rates, drain, producer, scheduled, ordering, soak)\n", s)
			return 2
		}
	}
	if o.Rates, err = splitInts(rates); err != nil {
		fmt.Fprintln(os.Stderr, "bench: -rates:", err)
		return 2
	}
	o.Peers = splitList(peers)
	for _, p := range o.Peers {
		if p != peerGraphile {
			fmt.Fprintf(os.Stderr, "bench: -peers: unknown peer %q (want %s)\n", p, peerGraphile)
			return 2
		}
	}
	if o.Dispatchers, err = splitInts(dispatchers); err != nil {
		fmt.Fprintln(os.Stderr, "bench: -dispatchers:", err)
		return 2
	}
	if o.Batches, err = splitInts(batches); err != nil {
		fmt.Fprintln(os.Stderr, "bench: -batches:", err)
		return 2
	}
	if o.Clients, err = splitInts(clients); err != nil {
		fmt.Fprintln(os.Stderr, "bench: -clients:", err)
		return 2
	}
	if o.Rate < 1 || o.Duration <= 0 || o.RatesDuration <= 0 || o.Warmup < 0 || o.N < 1 || o.ProducerDuration <= 0 || o.ProducerReps < 1 ||
		o.SoakRate < 1 || o.SoakDuration <= 0 || o.SoakInterval <= 0 {
		fmt.Fprintln(os.Stderr, "bench: -rate, -duration, -rates-duration, -n, -producer-duration, -soak-rate, -soak-duration and -soak-interval must be positive")
		return 2
	}
	if o.URL == "" {
		o.URL = defaultURL()
	}
	start := time.Now()
	if o.Out == "" {
		o.Out = filepath.Join("results", start.Format("20060102-150405"))
	}
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}

	level := slog.LevelWarn
	if o.Verbose {
		level = slog.LevelInfo
	}
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	env, err := newEnv(ctx, &o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	defer env.close()

	res := &Results{Meta: env.meta(ctx, &o, start)}
	for _, s := range o.Scenarios {
		logf("scenario %s", s)
		var err error
		switch s {
		case "latency":
			res.Latency, err = runLatency(ctx, env, &o)
		case "rates":
			res.Rates, err = runRates(ctx, env, &o)
		case "drain":
			res.Drain, err = runDrain(ctx, env, &o)
		case "producer":
			res.Producer, err = runProducer(ctx, env, &o, res.Drain)
		case "scheduled":
			res.Scheduled, err = runScheduled(ctx, env, &o)
		case "ordering":
			res.Ordering, err = runOrdering(ctx, env, &o)
		case "soak":
			res.Soak, err = runSoak(ctx, env, &o)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "bench: scenario %s: %v\n", s, err)
			return 1
		}
	}
	res.Meta.Elapsed = time.Since(start).Round(time.Millisecond).String()
	res.Meta.LoadAvgEnd = loadAvg()
	res.Goals = checkGoals(res)

	md := markdown(res)
	fmt.Print(md)
	if err := os.WriteFile(filepath.Join(o.Out, "results.md"), []byte(md), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	js, _ := json.MarshalIndent(res, "", "  ")
	if err := os.WriteFile(filepath.Join(o.Out, "results.json"), append(js, '\n'), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	if err := writePlots(res, o.Out); err != nil {
		fmt.Fprintln(os.Stderr, "bench: plots:", err)
		return 1
	}
	logf("wrote %s (results.json, results.md, *.png) in %s", o.Out, res.Meta.Elapsed)
	return 0
}

func defaultURL() string {
	for _, k := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func splitInts(s string) ([]int, error) {
	var out []int
	for _, f := range splitList(s) {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%q is not a positive number", f)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty list")
	}
	return out, nil
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench %s: %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}
