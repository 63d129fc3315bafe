package main

import (
	"fmt"
	"image/color"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

func writePlots(r *Results, dir string) error {
	if len(r.Latency) > 0 {
		if err := latencyPlot(r, filepath.Join(dir, "latency_cdf.png")); err != nil {
			return err
		}
	}
	if r.Drain != nil {
		if err := drainPlot(r, filepath.Join(dir, "drain.png")); err != nil {
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
