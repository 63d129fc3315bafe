package main

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

func writePlots(r *Results, dir string) error {
	if len(r.Latency) > 0 {
		if err := latencyPlot(r, filepath.Join(dir, "latency_cdf.png")); err != nil {
			return err
		}
	}
	if r.Rates != nil && len(r.Rates.Runs) > 0 {
		if err := ratesPlot(r.Rates, filepath.Join(dir, "latency_vs_rate.png")); err != nil {
			return err
		}
	}
	if r.Drain != nil {
		if err := drainPlot(r, filepath.Join(dir, "drain.png")); err != nil {
			return err
		}
	}
	if r.Ordering != nil {
		if err := orderingPlot(r.Ordering, filepath.Join(dir, "ordering.png")); err != nil {
			return err
		}
	}
	if r.Soak != nil && len(r.Soak.Samples) > 0 {
		if err := soakPlot(r.Soak, filepath.Join(dir, "soak.png")); err != nil {
			return err
		}
	}
	if len(r.Producer) > 0 {
		if err := producerPlot(r, filepath.Join(dir, "producer.png")); err != nil {
			return err
		}
	}
	return nil
}

// latencyPlot draws the CDF of every mode's handoff and end-to-end latency
// on a log x axis.
func latencyPlot(r *Results, path string) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("Latency from producer commit, %d events/s", r.Meta.Rate)
	p.X.Label.Text = "latency (ms, log scale)"
	p.Y.Label.Text = "fraction of events"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Y.Min, p.Y.Max = 0, 1
	p.Legend.Top = false
	p.Legend.Left = false
	p.Legend.XOffs = -vg.Millimeter
	p.Add(plotter.NewGrid())
	i := 0
	addLine := func(name string, s *Summary, dashed bool) error {
		if s == nil || len(s.CDF) == 0 {
			return nil
		}
		pts := make(plotter.XYs, 0, len(s.CDF))
		for _, c := range s.CDF {
			pts = append(pts, plotter.XY{X: max(c[0], 0.01), Y: c[1]})
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			return err
		}
		l.Color = plotutil.Color(i / 2)
		l.Width = vg.Points(1.5)
		if dashed {
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		}
		p.Add(l)
		p.Legend.Add(name, l)
		return nil
	}
	for _, l := range r.Latency {
		if l.Mode == modeRiverDirect {
			i = 4
		}
		if err := addLine(l.Mode+" handoff", l.Handoff, true); err != nil {
			return err
		}
		i++
		if err := addLine(l.Mode+" end to end", l.EndToEnd, false); err != nil {
			return err
		}
		i++
	}
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}

func drainPlot(r *Results, path string) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("Drain of %d events (events/s)", r.Drain.N)
	p.Y.Label.Text = "events/s"
	var (
		vals   plotter.Values
		labels []string
	)
	for _, raw := range r.Drain.Raw {
		vals = append(vals, raw.PerSecond)
		labels = append(labels, fmt.Sprintf("River raw\nbatch %d", raw.Batch))
	}
	nRaw := len(vals)
	for _, d := range r.Drain.Runs {
		vals = append(vals, d.PerSecond)
		label := fmt.Sprintf("%d outboxd\nbatch %d", d.Dispatchers, d.Batch)
		if d.Concurrency > 0 {
			label += fmt.Sprintf("\nconc. %d", d.Concurrency)
		}
		labels = append(labels, label)
	}
	w := vg.Points(22)
	rawBars, err := plotter.NewBarChart(padValues(vals[:nRaw], 0, len(vals)), w)
	if err != nil {
		return err
	}
	rawBars.Color = color.RGBA{R: 150, G: 150, B: 150, A: 255}
	rawBars.LineStyle.Width = 0
	outBars, err := plotter.NewBarChart(padValues(vals[nRaw:], nRaw, len(vals)), w)
	if err != nil {
		return err
	}
	outBars.Color = plotutil.Color(0)
	outBars.LineStyle.Width = 0
	p.Add(plotter.NewGrid(), rawBars, outBars)
	top := 0.0
	for _, v := range vals {
		top = max(top, v)
	}
	p.Y.Max = top * 1.2
	p.Legend.Add("River InsertManyTx alone", rawBars)
	p.Legend.Add("outbox drain", outBars)
	p.Legend.Top = true
	p.NominalX(labels...)
	p.Y.Min = 0
	return p.Save(vg.Length(max(6, len(vals)))*vg.Inch, 4.5*vg.Inch, path)
}

// padValues places vs at offset in a slice of n zeros.
func padValues(vs plotter.Values, offset, n int) plotter.Values {
	out := make(plotter.Values, n)
	copy(out[offset:], vs)
	return out
}

func producerPlot(r *Results, path string) error {
	p := plot.New()
	p.Title.Text = "Producer transactions/s, one event per transaction"
	p.Y.Label.Text = "tps"
	type key struct {
		state   string
		clients int
	}
	var order []key
	seen := map[key]bool{}
	byVariant := map[string]map[key]float64{}
	for _, c := range r.Producer {
		k := key{c.State, c.Clients}
		if !seen[k] {
			seen[k] = true
			order = append(order, k)
		}
		if byVariant[c.Variant] == nil {
			byVariant[c.Variant] = map[key]float64{}
		}
		byVariant[c.Variant][k] = c.TPS
	}
	labels := make([]string, len(order))
	for i, k := range order {
		labels[i] = fmt.Sprintf("%s\n%d clients", k.state, k.clients)
	}
	w := vg.Points(16)
	names := map[string]string{variantShipped: "(a) shipped wake", variantNone: "(b) no trigger", variantNaive: "(c) naive NOTIFY"}
	for i, v := range []string{variantShipped, variantNone, variantNaive} {
		vals := make(plotter.Values, len(order))
		for j, k := range order {
			vals[j] = byVariant[v][k]
		}
		bars, err := plotter.NewBarChart(vals, w)
		if err != nil {
			return err
		}
		bars.Color = plotutil.Color(i)
		bars.LineStyle.Width = 0
		bars.Offset = vg.Length(i-1) * w
		p.Add(bars)
		p.Legend.Add(names[v], bars)
	}
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	p.Legend.Left = true
	p.NominalX(labels...)
	p.Y.Min = 0
	top := 0.0
	for _, c := range r.Producer {
		top = max(top, c.TPS)
	}
	p.Y.Max = top * 1.3
	return p.Save(8*vg.Inch, 4.5*vg.Inch, path)
}

// ratesPlot draws end-to-end p50 (dashed) and p99 (solid) against the
// offered rate, one colour per mode, both axes on a log scale; a cross
// marks the first rate at which a mode did not keep up.
func ratesPlot(r *RateResults, path string) error {
	p := plot.New()
	p.Title.Text = "End-to-end latency versus offered rate (p50 dashed, p99 solid)"
	p.X.Label.Text = "offered rate (events/s, log scale)"
	p.Y.Label.Text = "latency from producer commit (ms, log scale)"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = rateTicks(r.Rates)
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Legend.Top = true
	p.Legend.Left = true
	p.Add(plotter.NewGrid())
	// Room above the curves for the legend (log scale: a factor).
	lo, hi := 0.0, 0.0
	for _, run := range r.Runs {
		if run.EndToEnd != nil && run.Skipped == "" {
			if lo == 0 || run.EndToEnd.P50 < lo {
				lo = run.EndToEnd.P50
			}
			hi = max(hi, run.EndToEnd.P99)
		}
	}
	if hi > 0 {
		// The legend's rows take about 3% of the height each: leave that
		// fraction f of the log range free above hi.
		lo = max(lo/2, 0.01)
		f := min(0.5, 0.035*float64(3*len(r.modes())+1))
		p.Y.Min, p.Y.Max = lo, hi*math.Pow(hi/lo, f/(1-f))
	}
	for i, mode := range r.modes() {
		var p50, p99 plotter.XYs
		for _, run := range r.Runs {
			if run.Mode != mode || run.Skipped != "" || run.EndToEnd == nil {
				continue
			}
			x := float64(run.Rate)
			p50 = append(p50, plotter.XY{X: x, Y: max(run.EndToEnd.P50, 0.01)})
			p99 = append(p99, plotter.XY{X: x, Y: max(run.EndToEnd.P99, 0.01)})
		}
		if len(p99) == 0 {
			continue
		}
		for _, s := range []struct {
			pts    plotter.XYs
			name   string
			dashed bool
		}{{p99, mode + " p99", false}, {p50, mode + " p50", true}} {
			l, pts, err := plotter.NewLinePoints(s.pts)
			if err != nil {
				return err
			}
			l.Color = plotutil.Color(i)
			l.Width = vg.Points(1.5)
			pts.Color = plotutil.Color(i)
			pts.Shape = draw.CircleGlyph{}
			pts.Radius = vg.Points(2)
			if s.dashed {
				l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
			}
			p.Add(l, pts)
			p.Legend.Add(s.name, l)
		}
		if at := r.firstFailure(mode); at > 0 {
			for _, pt := range p99 {
				if pt.X != float64(at) {
					continue
				}
				sc, err := plotter.NewScatter(plotter.XYs{pt})
				if err != nil {
					return err
				}
				sc.Color = plotutil.Color(i)
				sc.Shape = draw.CrossGlyph{}
				sc.Radius = vg.Points(7)
				p.Add(sc)
				p.Legend.Add(fmt.Sprintf("%s stops keeping up (%d ev/s)", mode, at), sc)
			}
		}
	}
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}

// rateTicks labels the x axis at the offered rates.
func rateTicks(rates []int) plot.ConstantTicks {
	t := make(plot.ConstantTicks, len(rates))
	for i, r := range rates {
		t[i] = plot.Tick{Value: float64(r), Label: fmt.Sprint(r)}
	}
	return t
}

// soakPlot draws the soak's samples over time in four panels: latency
// (handoff p99, end-to-end p50 and p99, log scale), backlog, table sizes
// and dead tuples (with autovacuum runs of each table marked).
func soakPlot(s *SoakResults, path string) error {
	type series struct {
		name string
		y    func(SoakSample) float64
	}
	// The latency panel (logY) leaves out the final sample: its interval
	// is the short wait after the producers stopped.
	panel := func(title, ylabel string, logY bool, ss []series) (*plot.Plot, error) {
		p := plot.New()
		p.Title.Text = title
		p.Y.Label.Text = ylabel
		p.X.Label.Text = "time (s)"
		if logY {
			p.Y.Scale = plot.LogScale{}
			p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
		}
		p.Legend.Top = true
		p.Legend.Left = true
		p.Add(plotter.NewGrid())
		for i, sr := range ss {
			pts := make(plotter.XYs, 0, len(s.Samples))
			for _, x := range s.Samples {
				if logY && x.Final {
					continue
				}
				y := sr.y(x)
				if logY {
					y = max(y, 0.01)
				}
				pts = append(pts, plotter.XY{X: x.At, Y: y})
			}
			l, sc, err := plotter.NewLinePoints(pts)
			if err != nil {
				return nil, err
			}
			l.Color, sc.Color = plotutil.Color(i), plotutil.Color(i)
			l.Width = vg.Points(1.5)
			sc.Shape = draw.CircleGlyph{}
			sc.Radius = vg.Points(1.5)
			p.Add(l, sc)
			p.Legend.Add(sr.name, l)
		}
		return p, nil
	}
	tbl := func(x SoakSample, t string) SoakTable { return x.Tables[t] }
	lat, err := panel(fmt.Sprintf("Soak at %d events/s offered: latency per interval", s.Rate), "ms (log scale)", true, []series{
		{"handoff p99", func(x SoakSample) float64 { return x.HandoffP99 }},
		{"end-to-end p50", func(x SoakSample) float64 { return x.EndToEndP50 }},
		{"end-to-end p99", func(x SoakSample) float64 { return x.EndToEndP99 }},
	})
	if err != nil {
		return err
	}
	backlog, err := panel("Backlog", "rows", false, []series{
		{"pending events", func(x SoakSample) float64 { return float64(x.Pending) }},
		{"available River jobs", func(x SoakSample) float64 { return float64(x.Available) }},
	})
	if err != nil {
		return err
	}
	sizes, err := panel("Table size with indexes (pg_total_relation_size)", "MiB", false, []series{
		{"outbox_event", func(x SoakSample) float64 { return mib(tbl(x, "outbox_event").TotalBytes) }},
		{"river_job", func(x SoakSample) float64 { return mib(tbl(x, "river_job").TotalBytes) }},
	})
	if err != nil {
		return err
	}
	dead, err := panel("Dead tuples (n_dead_tup); autovacuum runs are counted in the report", "rows", false, []series{
		{"outbox_event", func(x SoakSample) float64 { return float64(tbl(x, "outbox_event").DeadTuples) }},
		{"river_job", func(x SoakSample) float64 { return float64(tbl(x, "river_job").DeadTuples) }},
	})
	if err != nil {
		return err
	}
	plots := [][]*plot.Plot{{lat}, {backlog}, {sizes}, {dead}}
	const w, h = 9 * vg.Inch, 14 * vg.Inch
	img := vgimg.New(w, h)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 4, Cols: 1, PadTop: vg.Points(6), PadBottom: vg.Points(6), PadX: vg.Points(6), PadY: vg.Points(12)}
	canvases := plot.Align(plots, tiles, dc)
	for i := range plots {
		plots[i][0].Draw(canvases[i][0])
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}
