package claim

import (
	"testing"
	"time"
)

// TestMarkHeld: an event waits for a batch in flight (held) only when its
// blocker lies inside the range the claim scanned, which SKIP LOCKED
// passed over; a blocker later in claim order, or before the position a
// continued claim started after, is not held.
func TestMarkHeld(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	pos := func(sec, id int64) Position {
		return Position{ScheduledAt: t0.Add(time.Duration(sec) * time.Second), ID: id}
	}
	after := pos(0, 10)
	last := pos(0, 200)
	for _, tc := range []struct {
		name    string
		after   *Position
		soon    bool
		blocker Position
		want    bool
	}{
		{"in range, whole claim order", nil, true, pos(0, 5), true},
		{"in range, after the start", &after, true, pos(0, 50), true},
		{"same time, id before last", &after, true, pos(0, 199), true},
		{"later in claim order (backing off)", &after, true, pos(60, 3), false},
		{"same time, id after last", &after, true, pos(0, 201), false},
		{"before the start of a continued claim", &after, true, pos(0, 9), false},
		{"the start itself", &after, true, pos(0, 10), false},
		{"not soon", nil, false, pos(0, 5), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			events := []Event{{soon: tc.soon, blocked: true, blocker: tc.blocker}}
			markHeld(events, tc.after, last)
			if events[0].held != tc.want {
				t.Fatalf("held = %v, want %v", events[0].held, tc.want)
			}
		})
	}
}
