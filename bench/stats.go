package main

import (
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
)

// newHist records microseconds from 1 µs to 10 min with 3 significant
// digits.
func newHist() *hdrhistogram.Histogram {
	return hdrhistogram.New(1, int64(10*time.Minute/time.Microsecond), 3)
}

// record adds d, clamped to the histogram's range (a value below 1 µs is
// recorded as 1 µs).
func record(h *hdrhistogram.Histogram, d time.Duration) {
	us := d.Microseconds()
	if us < 1 {
		us = 1
	}
	_ = h.RecordValue(min(us, h.HighestTrackableValue()))
}

// Summary is a latency distribution in milliseconds.
type Summary struct {
	Count int64   `json:"count"`
	Mean  float64 `json:"mean_ms"`
	P50   float64 `json:"p50_ms"`
	P90   float64 `json:"p90_ms"`
	P99   float64 `json:"p99_ms"`
	P999  float64 `json:"p999_ms"`
	Max   float64 `json:"max_ms"`
	// CDF is (latency ms, fraction ≤) pairs for the plots.
	CDF [][2]float64 `json:"cdf,omitempty"`
}

func summarize(h *hdrhistogram.Histogram) *Summary {
	if h.TotalCount() == 0 {
		return nil
	}
	ms := func(us int64) float64 { return float64(us) / 1000 }
	s := &Summary{
		Count: h.TotalCount(),
		Mean:  h.Mean() / 1000,
		P50:   ms(h.ValueAtQuantile(50)),
		P90:   ms(h.ValueAtQuantile(90)),
		P99:   ms(h.ValueAtQuantile(99)),
		P999:  ms(h.ValueAtQuantile(99.9)),
		Max:   ms(h.Max()),
	}
	// Every recorded value bucket, so that the plotted CDF is exact at
	// the histogram's resolution.
	var cum int64
	for _, b := range h.Distribution() {
		if b.Count == 0 {
			continue
		}
		cum += b.Count
		s.CDF = append(s.CDF, [2]float64{ms(b.To), float64(cum) / float64(s.Count)})
	}
	return s
}
