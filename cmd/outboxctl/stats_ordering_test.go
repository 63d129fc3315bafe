package main

import (
	"strings"
	"testing"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestStatsCheckFailsOnParkedKey: with ordering unused, stats says so in
// one line and --check passes; once a real key is parked (its head job
// discarded), the table and --json show it, --check exits 1 naming
// keys_parked with a line that counts the parked keys and points to
// outboxctl keys, and --max-parked -1 turns the check off.
func TestStatsCheckFailsOnParkedKey(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 4})

	code, out, errOut := octl(t, s, "stats", "--check")
	if code != 0 || !strings.Contains(out, "ordering keys: none in flight") {
		t.Fatalf("stats --check without ordering: exit %d\n%s%s", code, out, errOut)
	}

	pgtest.Publish(t, s.Pool,
		outbox.Event{Type: "order.step.done", TenantID: "acme", OrderingKey: "order-42"},
		outbox.Event{Type: "order.step.done", TenantID: "acme", OrderingKey: "order-42"})
	if res := ordertest.HandOff(t, s.Pool, nil); res.Jobs != 2 {
		t.Fatalf("handoff %+v; want 2 jobs", res)
	}
	ordertest.FinalizeHead(t, s.Pool, "acme", "order-42", "discarded")

	code, out, errOut = octl(t, s, "stats", "--check")
	if code != 1 || !strings.Contains(errOut, "keys_parked") {
		t.Fatalf("stats --check with a parked key: exit %d, stderr %q", code, errOut)
	}
	for _, want := range []string{
		"ordering keys: 1 in flight, 1 parked (1 discarded, 0 cancelled, 0 deleted); 1 job waiting (1 behind parked keys)",
		"ALERT keys_parked: 1 ordering key is parked",
		"`outboxctl keys`",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stats --check output lacks %q:\n%s", want, out)
		}
	}

	st := ctlJSON[struct {
		Ordering struct {
			Keys          int64            `json:"keys"`
			Parked        int64            `json:"parked_keys"`
			ParkedByState map[string]int64 `json:"parked_keys_by_state"`
			Waiting       int64            `json:"waiting_jobs"`
		} `json:"ordering"`
		Alerts []struct {
			Name string `json:"name"`
		} `json:"alerts"`
	}](t, s, "stats")
	if st.Ordering.Keys != 1 || st.Ordering.Parked != 1 || st.Ordering.ParkedByState["discarded"] != 1 || st.Ordering.Waiting != 1 ||
		len(st.Alerts) != 1 || st.Alerts[0].Name != "keys_parked" {
		t.Fatalf("stats --json: %+v", st)
	}

	if code, out, errOut := octl(t, s, "stats", "--check", "--max-parked", "-1"); code != 0 {
		t.Fatalf("stats --check --max-parked -1: exit %d\n%s%s", code, out, errOut)
	}
}
