package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestExplainDeepPayload: explain works on a row whose payload is nested
// 10,001 levels deep (deeper than encoding/json accepts), in text and JSON.
func TestExplainDeepPayload(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	pgtest.AllowAnyPayload(t, s.Pool)
	const depth = 10001
	var id int64
	if err := s.Pool.QueryRow(context.Background(), `INSERT INTO outbox_event (event_type, payload, tenant_id)
		VALUES ('mail.user.welcome', (repeat('[', $1) || repeat(']', $1))::jsonb, 'acme') RETURNING id`, depth).Scan(&id); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := ctl(t, s.URL, "explain", fmt.Sprint(id))
	if code != 0 {
		t.Fatalf("explain: exit %d: %s", code, stderr)
	}
	if !strings.Contains(stdout, "payload       [[[[") || !strings.Contains(stdout, fmt.Sprintf("(%d bytes; --json shows all)", 2*depth)) {
		t.Errorf("explain output:\n%s", stdout)
	}

	code, stdout, stderr = ctl(t, s.URL, "explain", "--json", fmt.Sprint(id))
	if code != 0 {
		t.Fatalf("explain --json: exit %d: %s", code, stderr)
	}
	var res struct {
		Event struct {
			ID          int64           `json:"id"`
			Payload     json.RawMessage `json:"payload"`
			PayloadText *string         `json:"payload_text"`
		} `json:"event"`
	}
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatalf("--json output is not JSON: %v", err)
	}
	if res.Event.ID != id || string(res.Event.Payload) != "null" || res.Event.PayloadText == nil ||
		*res.Event.PayloadText != strings.Repeat("[", depth)+strings.Repeat("]", depth) {
		t.Fatalf("--json event: id %d payload %.40q text set %v", res.Event.ID, res.Event.Payload, res.Event.PayloadText != nil)
	}
}
