package outboxriver

import (
	"testing"
	"time"
)

// TestNextGINWait: the wait aims at ginTargetPages per call at the rate
// the lists just filled, between the interval and eight times it.
func TestNextGINWait(t *testing.T) {
	t.Parallel()
	iv := 200 * time.Millisecond
	for _, c := range []struct {
		last  time.Duration
		pages int64
		want  time.Duration
	}{
		{iv, 0, 8 * iv}, // nothing pending: the longest wait
		{iv, 4, 4 * iv}, // a quarter of the target: four times longer
		{400 * time.Millisecond, 16, 400 * time.Millisecond}, // on target: the same wait
		{iv, 64, iv},        // filling fast: never below the interval
		{8 * iv, 1, 8 * iv}, // never above eight intervals
	} {
		if got := nextGINWait(iv, c.last, c.pages); got != c.want {
			t.Errorf("nextGINWait(%s, %s, %d) = %s, want %s", iv, c.last, c.pages, got, c.want)
		}
	}
}
