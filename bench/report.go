package main

import (
	"fmt"
	"strings"
)

// Results is everything one run measured (results.json).
type Results struct {
	Meta     Meta            `json:"meta"`
	Latency  []LatencyResult `json:"latency,omitempty"`
	Rates    *RateResults    `json:"rates,omitempty"`
	Drain    *DrainResults   `json:"drain,omitempty"`
	Producer []ProducerCell  `json:"producer,omitempty"`
	// Scheduled is the claim beside a backlog of delayed events.
	Scheduled []ScheduledResult `json:"scheduled,omitempty"`
	// Ordering is the per-key ordering scenario.
	Ordering *OrderingResults `json:"ordering,omitempty"`
	// Soak is the long run through outboxd (-scenarios soak).
	Soak  *SoakResults `json:"soak,omitempty"`
	Goals []Goal       `json:"goals"`
}

// Goal is one of the targets the issues name (5, 11, 13), checked against
// this run.
type Goal struct {
	Name     string `json:"name"`
	Target   string `json:"target"`
	Measured string `json:"measured"`
	Pass     bool   `json:"pass"`
}

func (r *Results) latency(mode string) *LatencyResult {
	for i := range r.Latency {
		if r.Latency[i].Mode == mode {
			return &r.Latency[i]
		}
	}
	return nil
}

func (r *Results) drainRun(k, batch, concurrency int) *DrainResult {
	if r.Drain == nil {
		return nil
	}
	for i := range r.Drain.Runs {
		if d := r.Drain.Runs[i]; d.Dispatchers == k && d.Batch == batch && d.Concurrency == concurrency {
			return &r.Drain.Runs[i]
		}
	}
	return nil
}

func checkGoals(r *Results) []Goal {
	var g []Goal
	add := func(name, target, measured string, pass bool) {
		g = append(g, Goal{Name: name, Target: target, Measured: measured, Pass: pass})
	}
	notify, poll, direct := r.latency(modeNotify), r.latency(modePoll), r.latency(modeRiverDirect)
	if notify != nil && notify.Handoff != nil {
		h := notify.Handoff
		add("handoff p50", "≤ 1.5 ms", fmt.Sprintf("%.2f ms", h.P50), h.P50 <= 1.5)
		add("handoff p99", "≤ 5 ms", fmt.Sprintf("%.2f ms", h.P99), h.P99 <= 5)
		if poll != nil && poll.Handoff != nil {
			x := poll.Handoff.P50 / h.P50
			add("handoff p50 vs poll", "≥ 100× lower", fmt.Sprintf("%.0f× (poll %.1f ms)", x, poll.Handoff.P50), x >= 100)
		}
	}
	if notify != nil && notify.EndToEnd != nil {
		e := notify.EndToEnd
		if direct != nil && direct.EndToEnd != nil {
			diff := e.P50 - direct.EndToEnd.P50
			add("end-to-end p50 vs river-direct", "within 1.5 ms", fmt.Sprintf("%+.2f ms (%.2f vs %.2f ms)", diff, e.P50, direct.EndToEnd.P50), diff <= 1.5)
		}
		add("end-to-end p99", "≤ 10 ms", fmt.Sprintf("%.2f ms", e.P99), e.P99 <= 10)
	}
	if r.Drain != nil {
		def := 0
		if len(r.Drain.Runs) > 0 {
			def = r.Drain.Runs[0].Concurrency
		}
		for _, run := range r.Drain.Runs {
			if run.Dispatchers != 1 || run.Concurrency != def {
				continue
			}
			add(fmt.Sprintf("drain, 1 dispatcher, batch %d", run.Batch), "≥ 0.6× raw River InsertMany",
				fmt.Sprintf("%.2f× (%.0f ev/s)", run.RawRatio, run.PerSecond), run.RawRatio >= 0.6)
		}
		for _, b := range []int{100, 1000} {
			series := []int{def}
			if def != 1 {
				series = append(series, 1)
			}
			for _, c := range series {
				one, two := r.drainRun(1, b, c), r.drainRun(2, b, c)
				if one != nil && two != nil {
					what := fmt.Sprintf("drain, 2 dispatchers > 1, batch %d", b)
					if c == 1 {
						what += ", 1 batch in flight each"
					}
					add(what, "more with 2 than 1",
						fmt.Sprintf("%.0f vs %.0f ev/s", two.PerSecond, one.PerSecond), two.PerSecond > one.PerSecond)
				}
			}
		}
		if one := r.drainRun(1, 100, def); one != nil && len(one.PeakRSSMiB) > 0 {
			add("peak RSS draining", "≤ 64 MiB", fmt.Sprintf("%.1f MiB (%d events)", one.MaxRSSMiB, one.Events), one.MaxRSSMiB <= 64)
		}
	}
	if r.Rates != nil {
		g = append(g, rateGoals(r.Rates)...)
	}
	if r.Ordering != nil {
		g = append(g, orderingGoals(r.Ordering)...)
	}
	for _, c := range r.Producer {
		if c.Variant != variantShipped || c.Clients < 8 || c.State == "none" {
			continue
		}
		add(fmt.Sprintf("producer (a)/(b), %d clients, dispatcher %s", c.Clients, c.State), "≥ 0.9×",
			fmt.Sprintf("%.2f×", c.Ratio), c.Ratio >= 0.9)
	}
	return g
}

func markdown(r *Results) string {
	var b strings.Builder
	m := r.Meta
	fmt.Fprintf(&b, "# Outbox benchmark, %s\n\n", m.Started)
	fmt.Fprintf(&b, "- command: `%s` (quick: %v), commit %s, took %s\n", m.Command, m.Quick, m.Commit, m.Elapsed)
	fmt.Fprintf(&b, "- machine: %s, %d cores, %s, Linux %s, %s\n", m.CPU, m.Cores, m.MemTotal, m.Kernel, m.GoVersion)
	fmt.Fprintf(&b, "- Postgres: %s; fsync=%s synchronous_commit=%s full_page_writes=%s autovacuum=%s shared_buffers=%s max_wal_size=%s\n", firstWords(m.Postgres, 2),
		m.PGSettings["fsync"], m.PGSettings["synchronous_commit"], m.PGSettings["full_page_writes"], m.PGSettings["autovacuum"],
		m.PGSettings["shared_buffers"], m.PGSettings["max_wal_size"])
	if m.Warning != "" {
		fmt.Fprintf(&b, "- **WARNING: %s**\n", m.Warning)
	}
	fmt.Fprintf(&b, "- load average: %s at start, %s at end; %d other client connections on the server at start\n\n", m.LoadAvg, m.LoadAvgEnd, m.OtherConns)

	if len(r.Latency) > 0 {
		fmt.Fprintf(&b, "## Latency at %d events/s for %s per mode (ms)\n\n", m.Rate, m.Duration)
		b.WriteString("| mode | measure | events | p50 | p90 | p99 | p99.9 | max |\n|---|---|--:|--:|--:|--:|--:|--:|\n")
		row := func(mode, what string, s *Summary) {
			if s == nil {
				return
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %.2f | %.2f | %.2f | %.2f | %.2f |\n", mode, what, s.Count, s.P50, s.P90, s.P99, s.P999, s.Max)
		}
		for _, l := range r.Latency {
			row(l.Mode, "handoff", l.Handoff)
			row(l.Mode, "end to end", l.EndToEnd)
		}
		for _, l := range r.Latency {
			row(l.Mode, "producer tx", l.Commit)
		}
		b.WriteString("\n")
		if s := warmupLine(r.Latency, false); s != "" {
			b.WriteString(s + "\n\n")
		}
		if s := floorLine(r); s != "" {
			b.WriteString(s + "\n\n")
		}
	}
	if r.Rates != nil {
		ratesMarkdown(&b, r.Rates)
	}
	if r.Drain != nil {
		fmt.Fprintf(&b, "## Drain of %d events\n\n", r.Drain.N)
		b.WriteString("| what | batch | events/s | s to last handoff | × raw River | peak RSS MiB | CPU s / 100k |\n|---|--:|--:|--:|--:|--:|--:|\n")
		for _, raw := range r.Drain.Raw {
			fmt.Fprintf(&b, "| raw River InsertManyTx (%d goroutines) | %d | %.0f | %.2f | 1.00 | | |\n", raw.Concurrency, raw.Batch, raw.PerSecond, raw.Seconds)
		}
		for _, d := range r.Drain.Runs {
			rss := make([]string, len(d.PeakRSSMiB))
			for i, v := range d.PeakRSSMiB {
				rss[i] = fmt.Sprintf("%.1f", v)
			}
			label := fmt.Sprintf("%d × outboxd", d.Dispatchers)
			if d.Concurrency > 0 {
				label += fmt.Sprintf(", %d batch(es) in flight each", d.Concurrency)
			}
			fmt.Fprintf(&b, "| %s | %d | %.0f | %.2f | %.2f | %s | %.2f |\n", label, d.Batch, d.PerSecond, d.Seconds, d.RawRatio, strings.Join(rss, ", "), d.CPUPer100k)
		}
		b.WriteString("\nWhat the dispatchers' backends were doing (pg_stat_activity samples every 10 ms, active backends):\n\n")
		for _, d := range r.Drain.Runs {
			fmt.Fprintf(&b, "- %d × outboxd (concurrency %d), batch %d: %s\n", d.Dispatchers, d.Concurrency, d.Batch, strings.Join(d.WaitEvents, ", "))
		}
		b.WriteString("\n")
	}
	if len(r.Scheduled) > 0 {
		b.WriteString("## Claim of due events beside events scheduled for tomorrow (ms)\n\n")
		b.WriteString("| scheduled backlog | batch of due events p50 | p99 | empty pass p50 | p99 | rounds |\n|--:|--:|--:|--:|--:|--:|\n")
		for _, sr := range r.Scheduled {
			fmt.Fprintf(&b, "| %d | %.2f | %.2f | %.2f | %.2f | %d |\n", sr.Backlog, sr.Batch.P50, sr.Batch.P99, sr.Empty.P50, sr.Empty.P99, sr.Batch.Count)
		}
		b.WriteString("\n")
	}
	if r.Ordering != nil {
		b.WriteString(orderingMarkdown(r.Ordering))
	}
	if len(r.Producer) > 0 {
		b.WriteString("## Producer transactions per second, one event per transaction\n\n")
		b.WriteString("| dispatcher | clients | (a) shipped | (b) no trigger | (c) naive NOTIFY | (a)/(b) | (c)/(b) | batches (a) / (b) / (c) |\n|---|--:|--:|--:|--:|--:|--:|--:|\n")
		type key struct {
			state   string
			clients int
		}
		rows := map[key]map[string]ProducerCell{}
		var order []key
		for _, c := range r.Producer {
			k := key{c.State, c.Clients}
			if rows[k] == nil {
				rows[k] = map[string]ProducerCell{}
				order = append(order, k)
			}
			rows[k][c.Variant] = c
		}
		for _, k := range order {
			a, bb, c := rows[k][variantShipped], rows[k][variantNone], rows[k][variantNaive]
			state := k.state
			if k.state == "busy" && (!a.BusyThroughout || !bb.BusyThroughout || !c.BusyThroughout) {
				state += " (ran out of backlog)"
			}
			fmt.Fprintf(&b, "| %s | %d | %.0f | %.0f | %.0f | %.2f | %.2f | %d / %d / %d |\n", state, k.clients, a.TPS, bb.TPS, c.TPS, a.Ratio, c.Ratio, a.Batches, bb.Batches, c.Batches)
		}
		b.WriteString("\nDispatcher none: no dispatcher runs (the trigger's own cost; nobody holds the wake lock). Idle: a live dispatcher that starts idle (holding the wake lock) and hands off what the producers write. Busy: it drains a backlog throughout.\n\n")
		b.WriteString("What the producers' and dispatcher's backends were doing at the largest client count (pg_stat_activity samples every 10 ms):\n\n")
		maxClients := 0
		for _, c := range r.Producer {
			maxClients = max(maxClients, c.Clients)
		}
		for _, c := range r.Producer {
			if c.Clients == maxClients {
				fmt.Fprintf(&b, "- %s, %s: %s\n", c.State, c.Variant, strings.Join(c.WaitEvents, ", "))
			}
		}
		b.WriteString("\n")
	}
	if r.Soak != nil {
		soakMarkdown(&b, r.Soak)
	}
	if len(r.Goals) > 0 {
		b.WriteString("## Goals\n\n| goal | target | measured | |\n|---|---|---|---|\n")
		for _, g := range r.Goals {
			mark := "met"
			if !g.Pass {
				mark = "**missed**"
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", g.Name, g.Target, g.Measured, mark)
		}
		b.WriteString("\n")
	}
	return b.String()
}

func firstWords(s string, n int) string {
	f := strings.Fields(s)
	if len(f) > n {
		f = f[:n]
	}
	return strings.Join(f, " ")
}

// ratesMarkdown writes the latency-versus-rate table and its attribution.
// warmupLine says what the percentiles leave out: each run's warmup, and
// the warmup's own end-to-end p50 and max per run ("" without a warmup).
func warmupLine(runs []LatencyResult, withRate bool) string {
	var parts []string
	warmup := ""
	for _, l := range runs {
		if l.WarmupEvents == 0 || l.WarmupEndToEnd == nil {
			continue
		}
		warmup = l.Warmup
		label := l.Mode
		if withRate {
			label = fmt.Sprintf("%s at %d ev/s", l.Mode, l.Rate)
		}
		parts = append(parts, fmt.Sprintf("%s: %d events, p50 %.2f, max %.2f", label, l.WarmupEvents, l.WarmupEndToEnd.P50, l.WarmupEndToEnd.Max))
	}
	if len(parts) == 0 {
		return ""
	}
	return fmt.Sprintf("Percentiles leave out each run's first %s (warmup: new sessions, first plans, cold caches; the events are handed off and worked like the others). The warmup's end to end, ms: %s.", warmup, strings.Join(parts, "; "))
}

func ratesMarkdown(b *strings.Builder, r *RateResults) {
	fmt.Fprintf(b, "## Latency versus offered rate, %s per rate and mode (ms)\n\n", r.Duration)
	fmt.Fprintf(b, "Kept up: %s. Latencies count from the producer's commit; a producer that lags its schedule is shown by its lag p99. CPU: milliseconds of CPU per measured event, of the bench process (producers, dispatcher, River workers, the sampling) + the Postgres server's processes, from the warmup's end to the last job's start.\n\n", r.KeepUpRule)
	b.WriteString("| rate (ev/s) | mode | achieved ev/s | producer lag p99 | drain s | kept up | handoff p50 / p99 / p99.9 | end to end p50 / p99 / p99.9 | CPU ms/event bench + server |\n|--:|---|--:|--:|--:|---|--:|--:|--:|\n")
	trio := func(s *Summary) string {
		if s == nil {
			return "–"
		}
		return fmt.Sprintf("%.2f / %.2f / %.2f", s.P50, s.P99, s.P999)
	}
	for _, run := range r.Runs {
		if run.Skipped != "" {
			fmt.Fprintf(b, "| %d | %s | | | | not run: %s | | | |\n", run.Rate, run.Mode, run.Skipped)
			continue
		}
		lag := "–"
		if run.ProducerLag != nil {
			lag = fmt.Sprintf("%.2f", run.ProducerLag.P99)
		}
		drain := "did not drain"
		if run.DrainSeconds >= 0 {
			drain = fmt.Sprintf("%.2f", run.DrainSeconds)
		}
		kept := "yes"
		if !run.KeptUp {
			kept = "**no**"
		}
		achieved := fmt.Sprintf("%.0f", run.Achieved)
		if run.NotSent > 0 {
			achieved += fmt.Sprintf(" (%d not sent)", run.NotSent)
		}
		fmt.Fprintf(b, "| %d | %s | %s | %s | %s | %s | %s | %s | %s |\n", run.Rate, run.Mode, achieved, lag, drain, kept, trio(run.Handoff), trio(run.EndToEnd), run.CPU)
	}
	b.WriteString("\n")
	var runs []LatencyResult
	for _, run := range r.Runs {
		if run.Skipped == "" {
			runs = append(runs, run.LatencyResult)
		}
	}
	if s := warmupLine(runs, true); s != "" {
		b.WriteString(s + "\n\n")
	}
	for _, n := range r.Notes {
		fmt.Fprintf(b, "- %s\n", n)
	}
	peers := map[string]bool{}
	for _, run := range r.Runs {
		if run.Peer != "" && !peers[run.Peer] {
			peers[run.Peer] = true
			fmt.Fprintf(b, "- peer: %s\n", run.Peer)
		}
	}
	if len(r.Notes) > 0 || len(peers) > 0 {
		b.WriteString("\n")
	}
	b.WriteString("### Where the end-to-end time goes (p50 / p99, ms)\n\n")
	b.WriteString("commit→claim: producer commit to the River job's created_at (the dispatcher's claim transaction began); claim→handoff: to the dispatcher's commit; handoff→fetch: to the job's attempted_at (River's fetch; river-direct and Graphile Worker: from the producer's commit); fetch→work: to the worker's start. Segments that mix the database's clock with the process's are taken on the wall clock.\n\n")
	names := []string{segClaim, segHandoff, segFetch, segWork}
	b.WriteString("| rate (ev/s) | mode | " + strings.Join(names, " | ") + " |\n|--:|---|--:|--:|--:|--:|\n")
	for _, run := range r.Runs {
		if run.Skipped != "" || len(run.Segments) == 0 {
			continue
		}
		cells := make([]string, len(names))
		for i, n := range names {
			cells[i] = "–"
			for _, s := range run.Segments {
				if s.Name == n {
					cells[i] = fmt.Sprintf("%.2f / %.2f", s.P50, s.P99)
				}
			}
		}
		fmt.Fprintf(b, "| %d | %s | %s |\n", run.Rate, run.Mode, strings.Join(cells, " | "))
	}
	b.WriteString("\n")
	waits := false
	for _, run := range r.Runs {
		if len(run.Waits) == 0 {
			continue
		}
		if !waits {
			b.WriteString("What the backends were doing while the events flowed (pg_stat_activity samples every 20 ms, active backends by role):\n\n")
			waits = true
		}
		var roles []string
		for _, role := range []string{"producers", "dispatcher", "workers", "graphile"} {
			if w := run.Waits[role]; len(w) > 0 {
				roles = append(roles, role+": "+strings.Join(w, ", "))
			}
		}
		fmt.Fprintf(b, "- %d ev/s, %s: %s\n", run.Rate, run.Mode, strings.Join(roles, "; "))
	}
	if waits {
		b.WriteString("\n")
	}
}

// floorLine compares what the outbox (notify) and the floor relay add to
// River-direct's end-to-end latency in this run ("" without the three).
func floorLine(r *Results) string {
	notify, direct, floor := r.latency(modeNotify), r.latency(modeRiverDirect), r.latency(modeFloor)
	if notify == nil || direct == nil || floor == nil || notify.EndToEnd == nil || direct.EndToEnd == nil || floor.EndToEnd == nil {
		return ""
	}
	d := direct.EndToEnd
	return fmt.Sprintf("Over River-direct's end to end (p50 %.2f ms, p99 %.2f ms), the outbox adds %+.2f ms at p50 (p99 %.1f×) and %s, "+
		"the least any relay adds (one statement, one round trip per wake; docs/benchmarks-record.md, \"The floor\"), %+.2f ms at p50 (p99 %.1f×).",
		d.P50, d.P99, notify.EndToEnd.P50-d.P50, notify.EndToEnd.P99/d.P99, modeFloor, floor.EndToEnd.P50-d.P50, floor.EndToEnd.P99/d.P99)
}
