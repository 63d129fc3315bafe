package dispatcher

import "testing"

// TestWalkSizes: a walk's batches are five times the drain's, at most
// 1,000 events unless the drain's are larger, and its bounds (the batches
// between a lone walker's batches in claim order, the batches of one walk)
// cover the same events as 8 and 100 of the drain's batches.
func TestWalkSizes(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ batch, walk, probe, most int }{
		{1, 5, 2, 20},
		{7, 35, 2, 20},
		{100, 500, 2, 20},
		{200, 1000, 2, 20},
		{300, 1000, 3, 30},
		{500, 1000, 4, 50},
		{1000, 1000, 8, 100},
		{5000, 5000, 8, 100},
		{10000, 10000, 8, 100},
	} {
		if got := walkBatch(c.batch); got != c.walk {
			t.Errorf("walkBatch(%d) = %d, want %d", c.batch, got, c.walk)
		}
		if got := walkProbeMax(c.batch); got != c.probe {
			t.Errorf("walkProbeMax(%d) = %d, want %d", c.batch, got, c.probe)
		}
		if got := walkMax(c.batch); got != c.most {
			t.Errorf("walkMax(%d) = %d, want %d", c.batch, got, c.most)
		}
		// The bounds never cover fewer events than the drain's batches did.
		if w := walkBatch(c.batch); walkProbeMax(c.batch)*w < walkProbeBatches*c.batch || walkMax(c.batch)*w < walkBatches*c.batch {
			t.Errorf("batch %d: the walk's bounds cover fewer events than %d and %d of the drain's batches", c.batch, walkProbeBatches, walkBatches)
		}
	}
}
