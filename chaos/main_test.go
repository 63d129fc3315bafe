package chaos

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Binaries built once by TestMain (without -race: the daemons are the
// system under test, and the soak measures their memory).
var (
	outboxdBin   string
	outboxctlBin string
	// ledgerworkerBin is the River worker of the ordering scenarios.
	ledgerworkerBin string
)

func TestMain(m *testing.M) {
	flag.Parse()
	dir, err := os.MkdirTemp("", "outbox-chaos")
	if err != nil {
		panic(err)
	}
	outboxdBin = filepath.Join(dir, "outboxd")
	outboxctlBin = filepath.Join(dir, "outboxctl")
	ledgerworkerBin = filepath.Join(dir, "ledgerworker")
	for bin, pkg := range map[string]string{outboxdBin: "../cmd/outboxd", outboxctlBin: "../cmd/outboxctl", ledgerworkerBin: "./ledgerworker"} {
		if out, err := exec.Command("go", "build", "-o", bin, pkg).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "chaos: build %s: %v\n%s", pkg, err, out)
			os.Exit(1)
		}
	}
	code := m.Run()
	printReport()
	os.RemoveAll(dir)
	os.Exit(code)
}

// long reports whether the long form runs (make chaos sets CHAOS_EVENTS).
func long() bool { return os.Getenv("CHAOS_EVENTS") != "" }

// scenarioWeights split the events of a run between the scenarios.
var scenarioWeights = map[string]int{
	"kill9":           30,
	"terminate":       20,
	"pg-restart":      16,
	"claim-timeouts":  14,
	"rollback":        12,
	"late-commit":     8,
	"river-lock-wait": 0, // fixed size, see the test
}

// events returns how many events scenario publishes: its share of
// CHAOS_EVENTS (default 10,000 in all: the short form of `go test`;
// 1,500 with -short).
func events(name string) int {
	total := 10000
	if testing.Short() {
		total = 1500
	}
	if v, err := strconv.Atoi(os.Getenv("CHAOS_EVENTS")); err == nil && v > 0 {
		total = v
	}
	sum := 0
	for _, w := range scenarioWeights {
		sum += w
	}
	return max(100, total*scenarioWeights[name]/sum)
}

// envInt reads a positive int from the environment, or def.
func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// report is one scenario's line in the final table.
type report struct {
	Scenario   string
	Events     int
	Done       int
	Failed     int
	Lost       int
	Duplicated int
	Stuck      int
	Phantom    int
	Faults     int
	Elapsed    time.Duration
	Note       string
}

var (
	reportMu sync.Mutex
	reports  []report
)

func addReport(r report) {
	reportMu.Lock()
	defer reportMu.Unlock()
	reports = append(reports, r)
}

func printReport() {
	reportMu.Lock()
	defer reportMu.Unlock()
	if len(reports) == 0 {
		return
	}
	sort.Slice(reports, func(i, j int) bool { return reports[i].Scenario < reports[j].Scenario })
	var b strings.Builder
	fmt.Fprintf(&b, "\nchaos report (%s)\n", time.Now().UTC().Format(time.RFC3339))
	fmt.Fprintf(&b, "%-22s %8s %8s %7s %5s %6s %6s %8s %7s %9s  %s\n", "scenario", "events", "done", "failed", "lost", "dup", "stuck", "phantom", "faults", "elapsed", "note")
	tot := report{}
	for _, r := range reports {
		fmt.Fprintf(&b, "%-22s %8d %8d %7d %5d %6d %6d %8d %7d %9s  %s\n", r.Scenario, r.Events, r.Done, r.Failed, r.Lost, r.Duplicated, r.Stuck, r.Phantom, r.Faults, r.Elapsed.Round(100*time.Millisecond), r.Note)
		tot.Events += r.Events
		tot.Done += r.Done
		tot.Failed += r.Failed
		tot.Lost += r.Lost
		tot.Duplicated += r.Duplicated
		tot.Stuck += r.Stuck
		tot.Phantom += r.Phantom
		tot.Faults += r.Faults
	}
	fmt.Fprintf(&b, "%-22s %8d %8d %7d %5d %6d %6d %8d %7d\n", "total", tot.Events, tot.Done, tot.Failed, tot.Lost, tot.Duplicated, tot.Stuck, tot.Phantom, tot.Faults)
	if f, ok := soakFigures.Load().(string); ok {
		b.WriteString("\n" + f)
	}
	fmt.Print(b.String())
	if p := os.Getenv("CHAOS_REPORT"); p != "" {
		_ = os.WriteFile(p, []byte(b.String()), 0o644)
	}
}
