package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// keepUpRatio and keepUpDrain define "kept up": the producers achieved at
// least keepUpRatio of the offered rate, and the workers started the last
// job within keepUpDrain of the last producer commit (the backlog left at
// the end drained that fast).
const (
	keepUpRatio = 0.95
	keepUpDrain = 2 * time.Second
)

// keepUpRule states the definition in the report.
var keepUpRule = fmt.Sprintf("achieved ≥ %.0f%% of the offered rate, and every job started within %s of the last producer commit", keepUpRatio*100, keepUpDrain)

// RateResults is the latency-versus-rate scenario: each rate offered
// open-loop to each mode in turn.
type RateResults struct {
	Rates      []int     `json:"rates"`
	Duration   string    `json:"duration_per_run"`
	KeepUpRule string    `json:"keep_up_rule"`
	Runs       []RateRun `json:"runs"`
	// Notes say which peers or runs were skipped and why.
	Notes []string `json:"notes,omitempty"`
}

// RateRun is one mode at one rate.
type RateRun struct {
	LatencyResult
	KeptUp bool `json:"kept_up"`
	// Skipped is set when the mode was not run at this rate.
	Skipped string `json:"skipped,omitempty"`
}

func keptUp(r LatencyResult) bool {
	return r.Achieved >= keepUpRatio*float64(r.Rate) && r.DrainSeconds >= 0 && r.DrainSeconds <= keepUpDrain.Seconds()
}

// rateProducers sizes the producer goroutines so that commit latency
// under load does not cap the offered rate: about one per 125 events/s,
// 8 to 32.
func rateProducers(rate int) int { return min(32, max(8, rate/125)) }

func runRates(ctx context.Context, e *env, o *Options) (*RateResults, error) {
	res := &RateResults{Rates: o.Rates, Duration: o.RatesDuration.String(), KeepUpRule: keepUpRule}
	// The floor relay runs at every rate too: the least any relay adds on
	// this machine at that rate, beside what the outbox adds (floor.go).
	modes := []string{modeNotify, modeRiverDirect, modeFloor}
	var peer *graphilePeer
	for _, p := range o.Peers {
		if p == peerGraphile {
			var note string
			peer, note = prepareGraphile(ctx, o)
			if note != "" {
				res.Notes = append(res.Notes, note)
			}
			if peer != nil {
				modes = append(modes, modeGraphile)
			}
		}
	}
	// A mode whose backlog did not drain in time at one rate is not
	// offered the higher ones (its backlog only grows); a mode whose
	// producers merely fell short is.
	failedAt := map[string]int{}
	drainWait := 3 * keepUpDrain
	for _, rate := range o.Rates {
		for _, mode := range modes {
			if at, ok := failedAt[mode]; ok {
				res.Runs = append(res.Runs, RateRun{
					LatencyResult: LatencyResult{Mode: mode, Rate: rate, Duration: o.RatesDuration.String()},
					Skipped:       fmt.Sprintf("its backlog did not drain at %d ev/s", at),
				})
				continue
			}
			logf("rates %s: %d ev/s for %s", mode, rate, o.RatesDuration)
			var (
				r   LatencyResult
				err error
			)
			schema := fmt.Sprintf("rate_%s_%d", map[string]string{modeNotify: "notify", modeRiverDirect: "river", modeFloor: "floor", modeGraphile: "graphile"}[mode], rate)
			if mode == modeGraphile {
				r, err = peer.run(ctx, e, schema, rate, o.RatesDuration, o.Warmup, drainWait)
			} else {
				r, err = latencyMode(ctx, e, loadSpec{
					mode: mode, rate: rate, duration: o.RatesDuration, schema: schema,
					producers: rateProducers(rate), drainLimit: drainWait, tolerateBacklog: true,
					cutoff: producerCutoff(o.RatesDuration), sample: true, warmup: o.Warmup,
				})
			}
			if _, derr := e.admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); derr != nil && err == nil {
				err = fmt.Errorf("drop schema %s: %w", schema, derr)
			}
			if err != nil {
				if mode == modeGraphile {
					// A peer never fails the suite.
					note := fmt.Sprintf("graphile-worker at %d ev/s failed: %v", rate, err)
					logf("rates: %s", note)
					res.Notes = append(res.Notes, note)
					res.Runs = append(res.Runs, RateRun{LatencyResult: LatencyResult{Mode: mode, Rate: rate, Duration: o.RatesDuration.String()}, Skipped: "failed: " + err.Error()})
					failedAt[mode] = rate
					continue
				}
				return nil, fmt.Errorf("%s at %d ev/s: %w", mode, rate, err)
			}
			if r.EndToEnd != nil {
				r.EndToEnd.CDF = nil
			}
			if r.Handoff != nil {
				r.Handoff.CDF = nil
			}
			run := RateRun{LatencyResult: r, KeptUp: keptUp(r)}
			if r.DrainSeconds < 0 || r.DrainSeconds > keepUpDrain.Seconds() {
				failedAt[mode] = rate
			}
			logf("rates %s: %d ev/s: achieved %.0f ev/s, drain %.2f s, kept up %v; %s", mode, rate, r.Achieved, r.DrainSeconds, run.KeptUp, r.line())
			res.Runs = append(res.Runs, run)
		}
	}
	return res, nil
}

// firstFailure is the lowest rate at which mode did not keep up (0: it
// kept up at every rate it was offered).
func (r *RateResults) firstFailure(mode string) int {
	for _, run := range r.Runs {
		if run.Mode == mode && run.Skipped == "" && !run.KeptUp {
			return run.Rate
		}
	}
	return 0
}

// modes lists the modes in the order they ran.
func (r *RateResults) modes() []string {
	var out []string
	seen := map[string]bool{}
	for _, run := range r.Runs {
		if !seen[run.Mode] {
			seen[run.Mode] = true
			out = append(out, run.Mode)
		}
	}
	return out
}

// run returns mode's run at rate, or nil.
func (r *RateResults) run(mode string, rate int) *RateRun {
	for i := range r.Runs {
		if r.Runs[i].Mode == mode && r.Runs[i].Rate == rate {
			return &r.Runs[i]
		}
	}
	return nil
}

// rateGoals checks issue 13's goals against the rates this run offered:
// end-to-end p99 at most twice River-direct's up to 4,000 events/s;
// handoff p99 at most 5 ms at 1,000 and 25 ms at 4,000 events/s;
// end-to-end p50 within 1 ms of River-direct's up to 1,000 events/s.
// Each measurement names the floor relay's at the same rate where it ran:
// what any relay adds on this machine at that rate.
func rateGoals(r *RateResults) []Goal {
	var g []Goal
	notRun := func(run *RateRun) string {
		if run == nil {
			return "not run"
		}
		return "not run: " + run.Skipped
	}
	for _, rate := range r.Rates {
		n, d, f := r.run(modeNotify, rate), r.run(modeRiverDirect, rate), r.run(modeFloor, rate)
		ok := n != nil && n.Skipped == "" && n.EndToEnd != nil
		okd := d != nil && d.Skipped == "" && d.EndToEnd != nil
		okf := f != nil && f.Skipped == "" && f.EndToEnd != nil
		// floor names the floor relay's figure s; callers check okf.
		floor := func(s string) string { return "; " + modeFloor + " " + s }
		if rate <= 4000 {
			goal := Goal{Name: fmt.Sprintf("rates, %d ev/s: end-to-end p99 vs river-direct", rate), Target: "≤ 2×"}
			switch {
			case !ok:
				goal.Measured = "outbox " + notRun(n)
			case !okd:
				goal.Measured = "river-direct " + notRun(d)
			default:
				x := n.EndToEnd.P99 / d.EndToEnd.P99
				goal.Measured = fmt.Sprintf("%.1f× (%.2f vs %.2f ms)", x, n.EndToEnd.P99, d.EndToEnd.P99)
				if okf {
					goal.Measured += floor(fmt.Sprintf("%.1f×", f.EndToEnd.P99/d.EndToEnd.P99))
				}
				goal.Pass = x <= 2
			}
			g = append(g, goal)
		}
		if limit := map[int]float64{1000: 5, 4000: 25}[rate]; limit > 0 {
			goal := Goal{Name: fmt.Sprintf("rates, %d ev/s: handoff p99", rate), Target: fmt.Sprintf("≤ %.0f ms", limit)}
			if ok && n.Handoff != nil {
				goal.Measured = fmt.Sprintf("%.2f ms", n.Handoff.P99)
				if okf && f.Handoff != nil {
					goal.Measured += floor(fmt.Sprintf("%.2f ms", f.Handoff.P99))
				}
				goal.Pass = n.Handoff.P99 <= limit
			} else {
				goal.Measured = notRun(n)
			}
			g = append(g, goal)
		}
		if rate <= 1000 {
			goal := Goal{Name: fmt.Sprintf("rates, %d ev/s: end-to-end p50 vs river-direct", rate), Target: "within 1 ms"}
			switch {
			case !ok:
				goal.Measured = "outbox " + notRun(n)
			case !okd:
				goal.Measured = "river-direct " + notRun(d)
			default:
				diff := n.EndToEnd.P50 - d.EndToEnd.P50
				goal.Measured = fmt.Sprintf("%+.2f ms (%.2f vs %.2f ms)", diff, n.EndToEnd.P50, d.EndToEnd.P50)
				if okf {
					goal.Measured += floor(fmt.Sprintf("%+.2f ms", f.EndToEnd.P50-d.EndToEnd.P50))
				}
				goal.Pass = diff <= 1
			}
			g = append(g, goal)
		}
	}
	return g
}
