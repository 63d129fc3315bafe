package main

import (
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
)

// Segment is one part of the end-to-end time, over every event that has
// both of its ends.
type Segment struct {
	Name  string  `json:"name"`
	From  string  `json:"from"`
	To    string  `json:"to"`
	Count int64   `json:"count"`
	P50   float64 `json:"p50_ms"`
	P99   float64 `json:"p99_ms"`
	// Clamped counts events whose end came before their start (clock
	// granularity, or the two clocks of a wall-clock segment disagreeing):
	// they are recorded as 1 µs.
	Clamped int `json:"clamped_negative"`
	// Wall: the segment mixes the database's clock with this process's
	// and is taken on the wall clock.
	Wall bool `json:"wall_clock"`
}

// Segment names, in the order an event meets them.
const (
	segClaim   = "commit→claim"
	segHandoff = "claim→handoff"
	segFetch   = "handoff→fetch"
	segWork    = "fetch→work"
)

// attribute splits the end-to-end time into segments from the per-event
// reads in c, taken without changing the product:
//
//	commit   this process, right after the producer's Commit returned
//	claim    the River job's created_at: the database's now() in the
//	         transaction that inserted the job (the dispatcher's claim
//	         transaction; river-direct: the producer's own)
//	handoff  this process, right after the dispatcher's batch committed
//	         (OnBatch); river-direct: the producer's commit
//	fetch    the River job's attempted_at: the database's now() in the
//	         fetch that locked the job for a worker
//	work     this process, when the worker's Work began
//
// For the outbox (outbox true) the segments are commit→claim,
// claim→handoff, handoff→fetch and fetch→work; commit→handoff is the
// handoff latency reported beside. For river-direct they are
// handoff→fetch (the producer's commit to the fetch) and fetch→work.
//
// The caller holds c.mu.
func attribute(c *clocks, outbox bool) []Segment {
	type acc struct {
		seg Segment
		h   *hdrhistogram.Histogram
	}
	// Every segment is a wall-clock difference.
	mk := func(name, from, to string) *acc {
		return &acc{seg: Segment{Name: name, From: from, To: to, Wall: true}, h: newHist()}
	}
	add := func(a *acc, from, to time.Time) {
		d := to.Sub(from)
		if d < 0 {
			a.seg.Clamped++
		}
		record(a.h, d)
	}
	claim := mk(segClaim, "producer commit", "job created_at (claim transaction start)")
	handoff := mk(segHandoff, "job created_at", "dispatcher batch committed")
	fetch := mk(segFetch, "dispatcher batch committed", "job attempted_at (River fetch)")
	work := mk(segWork, "job attempted_at", "worker start")
	if !outbox {
		fetch.seg.From = "producer commit"
	}
	for id, tc := range c.commit {
		created, okc := c.created[id]
		attempted, oka := c.attempted[id]
		tw, okw := c.work[id]
		th, okh := c.handoff[id]
		if !outbox {
			th, okh = tc, true
		}
		if outbox && okc {
			add(claim, tc, created)
			if okh {
				add(handoff, created, th)
			}
		}
		if okh && oka {
			add(fetch, th, attempted)
		}
		if oka && okw {
			add(work, attempted, tw)
		}
	}
	var out []Segment
	accs := []*acc{fetch, work}
	if outbox {
		accs = []*acc{claim, handoff, fetch, work}
	}
	for _, a := range accs {
		s := summarize(a.h)
		if s == nil {
			continue
		}
		a.seg.Count, a.seg.P50, a.seg.P99 = s.Count, s.P50, s.P99
		out = append(out, a.seg)
	}
	return out
}
