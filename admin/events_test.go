package admin_test

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestListEventsFiltersAndPages: the list is newest first, every filter
// narrows it, and the cursor walks the pages without gaps or repeats.
func TestListEventsFiltersAndPages(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	cl := admin.New(s.Pool)
	var all []int64
	for i := range 7 {
		all = append(all, insert(t, s, "mail.user.welcome", "pending", "acme"))
		if i%2 == 0 {
			all = append(all, insert(t, s, "billing.invoice.paid", "failed", "globex"))
		}
	}

	var seen []int64
	opts := admin.EventListOpts{Limit: 3}
	for pages := 0; ; pages++ {
		if pages > 10 {
			t.Fatal("the cursor does not end")
		}
		page, err := cl.ListEvents(ctx, opts)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range page.Events {
			seen = append(seen, e.ID)
		}
		if page.Next == 0 {
			break
		}
		opts.Before = page.Next
	}
	if len(seen) != len(all) {
		t.Fatalf("paged %v, want %d events", seen, len(all))
	}
	for i := range seen {
		if seen[i] != all[len(all)-1-i] {
			t.Fatalf("paged %v, want newest first of %v", seen, all)
		}
	}

	check := func(name string, opts admin.EventListOpts, want int, ok func(admin.EventSummary) bool) {
		t.Helper()
		page, err := cl.ListEvents(ctx, opts)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if len(page.Events) != want {
			t.Errorf("%s: %d events, want %d", name, len(page.Events), want)
		}
		for _, e := range page.Events {
			if !ok(e) {
				t.Errorf("%s: %+v", name, e)
			}
		}
	}
	check("status", admin.EventListOpts{Statuses: []string{"failed"}}, 4, func(e admin.EventSummary) bool { return e.Status == "failed" })
	check("type prefix", admin.EventListOpts{TypePrefix: "mail."}, 7, func(e admin.EventSummary) bool { return e.Type == "mail.user.welcome" })
	check("tenant", admin.EventListOpts{Tenant: "globex"}, 4, func(e admin.EventSummary) bool { return *e.TenantID == "globex" })
	future := time.Now().Add(time.Hour)
	check("since", admin.EventListOpts{Since: &future}, 0, nil)
	check("until", admin.EventListOpts{Until: &future, TypePrefix: "billing."}, 4, func(e admin.EventSummary) bool { return e.Type == "billing.invoice.paid" })

	var se *admin.SelectionError
	if _, err := cl.ListEvents(ctx, admin.EventListOpts{Statuses: []string{"lost"}}); !errors.As(err, &se) || se.Flag != "status" {
		t.Errorf("bad status: %v", err)
	}
	if _, err := cl.ListEvents(ctx, admin.EventListOpts{Limit: admin.MaxEventListLimit + 1}); !errors.As(err, &se) || se.Flag != "limit" {
		t.Errorf("bad limit: %v", err)
	}
}

// TestListEventsPlanAt200k: at 200,000 rows a page reads about one page of
// rows, on the first page, deep in the table (cursor), and for the rare
// failed status: EXPLAIN ANALYZE of the list's query, run as ListEvents
// runs it, shows no sequential scan and a small count of rows read. (A
// time range far in the past is not covered: no index has created_at
// first, so such a page walks the newer rows.)
func TestListEventsPlanAt200k(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 3*time.Minute)
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO outbox_event (event_type, payload, status, processed_at, last_error)
		SELECT CASE WHEN g % 2000 = 0 THEN 'billing.invoice.paid' ELSE 'mail.user.welcome' END, '{}',
		       CASE WHEN g % 2000 = 0 THEN 'failed' ELSE 'done' END::outbox_status,
		       CASE WHEN g % 2000 = 0 THEN NULL ELSE now() END,
		       CASE WHEN g % 2000 = 0 THEN 'boom' END
		FROM generate_series(1, 200000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `ANALYZE outbox_event`); err != nil {
		t.Fatal(err)
	}
	for name, args := range map[string][]any{
		"first page":  {nil, nil, nil, nil, nil, nil, nil, nil, 51},
		"deep cursor": {int64(20000), nil, nil, nil, nil, nil, nil, nil, 51},
		"failed":      {nil, []string{"failed"}, nil, nil, nil, nil, nil, nil, 51},
	} {
		var plan string
		if err := s.Pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+admin.EventListSQL, append([]any{pgx.QueryExecModeExec}, args...)...).Scan(&plan); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var nodes []struct{ Plan json.RawMessage }
		if err := json.Unmarshal([]byte(plan), &nodes); err != nil {
			t.Fatal(err)
		}
		read, seq := rowsRead(nodes[0].Plan)
		if seq || read > 5000 {
			t.Errorf("%s: %d rows read (sequential scan: %v); plan:\n%s", name, read, seq, plan)
		}
	}
}

// rowsRead sums the rows the scans of a JSON plan returned or filtered out,
// and reports a sequential scan.
func rowsRead(raw json.RawMessage) (int64, bool) {
	var n struct {
		NodeType string            `json:"Node Type"`
		Actual   float64           `json:"Actual Rows"`
		Removed  float64           `json:"Rows Removed by Filter"`
		Plans    []json.RawMessage `json:"Plans"`
	}
	_ = json.Unmarshal(raw, &n)
	var read int64
	seq := n.NodeType == "Seq Scan"
	if len(n.Plans) == 0 {
		read = int64(n.Actual + n.Removed)
	}
	for _, p := range n.Plans {
		r, s := rowsRead(p)
		read += r
		seq = seq || s
	}
	return read, seq
}
