package outboxsql_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

const syncSQL = `SELECT added, removed, changed, unchanged, strict_before, strict_after, audit_id
FROM outbox_routes_sync(actor => $1, dry_run => $2, routes => $3::jsonb, strict => $4, source => 'routes.yaml')`

type syncResult struct {
	added, removed, changed []string
	unchanged               int
	before, after           bool
	auditID                 *int64
}

// TestRoutesSyncAsOperator: the operator replaces the synced routes through
// outbox_routes_sync: a dry run reports the change and writes nothing (no
// audit row); a real run replaces the set, sets the mode and writes one
// audit row (action routes-sync, the actor, the login role); strict
// routing with no routes is refused. The operator and the dispatcher read
// the tables; neither can write them directly.
func TestRoutesSyncAsOperator(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	op := pgtest.RolePool(t, s, "outbox_operator")
	sync := func(dry bool, routes string, strict *bool) (syncResult, error) {
		var r syncResult
		err := op.QueryRow(ctx, syncSQL, "alice", dry, routes, strict).Scan(&r.added, &r.removed, &r.changed, &r.unchanged, &r.before, &r.after, &r.auditID)
		return r, err
	}
	on, off := true, false
	first := `[{"prefix": "mail.", "queues": ["outbox_mail"]}, {"prefix": "audit.", "queues": ["outbox_audit"]}]`
	r, err := sync(true, first, &on)
	if err != nil || strings.Join(r.added, ",") != "audit.,mail." || r.before || !r.after || r.auditID != nil {
		t.Fatalf("dry run: %+v %v", r, err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT (SELECT count(*) FROM outbox_route) + (SELECT count(*) FROM outbox_audit) + (SELECT count(*) FROM outbox_route_setting WHERE strict)`); n != 0 {
		t.Fatalf("a dry run wrote %d rows", n)
	}
	trigger := func() string {
		var state string
		if err := s.Pool.QueryRow(ctx, `SELECT tgenabled::text FROM pg_trigger WHERE tgrelid = 'outbox_event'::regclass AND tgname = 'outbox_event_strict_route'`).Scan(&state); err != nil {
			t.Fatal(err)
		}
		return state
	}
	if st := trigger(); st != "D" {
		t.Fatalf("strict route trigger %q before strict routing is on, want disabled", st)
	}
	if r, err = sync(false, first, &on); err != nil || len(r.added) != 2 || r.auditID == nil || !r.after {
		t.Fatalf("sync: %+v %v", r, err)
	}
	if st := trigger(); st != "O" {
		t.Fatalf("strict route trigger %q with strict routing on, want enabled", st)
	}
	second := `[{"prefix": "mail.", "queues": ["outbox_mail", "outbox_audit"]}, {"prefix": "billing.invoice.paid", "queues": ["outbox_billing"]}]`
	if r, err = sync(false, second, nil); err != nil || strings.Join(r.added, ",") != "billing.invoice.paid" ||
		strings.Join(r.removed, ",") != "audit." || strings.Join(r.changed, ",") != "mail." || r.unchanged != 0 || !r.before || !r.after {
		t.Fatalf("second sync: %+v %v", r, err)
	}
	if r, err = sync(false, second, &off); err != nil || r.unchanged != 2 || r.after {
		t.Fatalf("third sync: %+v %v", r, err)
	}
	if st := trigger(); st != "D" {
		t.Fatalf("strict route trigger %q after strict routing is off again, want disabled", st)
	}
	var prefixes []string
	if err := op.QueryRow(ctx, `SELECT array_agg(prefix ORDER BY prefix) FROM outbox_route`).Scan(&prefixes); err != nil || strings.Join(prefixes, ",") != "billing.invoice.paid,mail." {
		t.Fatalf("synced prefixes %v %v", prefixes, err)
	}
	var actor, dbUser, action string
	var detail map[string]any
	if err := s.Pool.QueryRow(ctx, `SELECT actor, db_user, action, detail FROM outbox_audit ORDER BY id LIMIT 1 OFFSET 1`).Scan(&actor, &dbUser, &action, &detail); err != nil {
		t.Fatal(err)
	}
	if actor != "alice" || action != "routes-sync" || dbUser == "" || detail["strict_after"] != true {
		t.Fatalf("audit row: %s %s %s %v", actor, dbUser, action, detail)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit WHERE action = 'routes-sync'`); n != 3 {
		t.Fatalf("%d audit rows, want 3", n)
	}

	for _, c := range []struct {
		routes string
		strict *bool
		want   string
	}{
		{`[]`, &on, "strict routing with no routes"},
		{`[{"prefix": "mail"}]`, nil, `"queues" array`},
		{`[{"prefix": "mail.", "queues": ["a"]}, {"prefix": "mail.", "queues": ["b"]}]`, nil, "more than once"},
	} {
		_, err := sync(false, c.routes, c.strict)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, c.want) {
			t.Errorf("sync %s: err = %v, want 22023 %q", c.routes, err, c.want)
		}
	}
	if _, err := sync(false, `[{"prefix": "Mail", "queues": ["a"]}]`, nil); err == nil {
		t.Error("a prefix the routes file refuses was synced")
	}

	d := pgtest.RolePool(t, s, "outbox_dispatcher")
	if n := pgtest.Count(t, d, `SELECT count(*) FROM outbox_route`); n != 2 {
		t.Fatalf("dispatcher reads %d routes", n)
	}
	for _, p := range []*struct {
		name string
		q    string
	}{
		{"operator", `DELETE FROM outbox_route`},
		{"operator", `UPDATE outbox_route_setting SET strict = true`},
		{"dispatcher", `SELECT * FROM outbox_routes_sync('x', false, '[]')`},
		{"dispatcher", `INSERT INTO outbox_route VALUES ('x.', '{q}')`},
	} {
		pool := op
		if p.name == "dispatcher" {
			pool = d
		}
		if _, err := pool.Exec(ctx, p.q); !isInsufficientPrivilege(err) {
			t.Errorf("%s: %s: err = %v, want permission denied", p.name, p.q, err)
		}
	}
}

// TestStrictRoutingAsProducer: a producer role with no privilege on the
// route tables publishes routed types through every path (the strict check
// runs inside the SECURITY DEFINER publish functions and trigger) and gets
// 22023, not a permission error, for an unrouted type, also on a plain
// INSERT. It cannot read or change the synced routes.
func TestStrictRoutingAsProducer(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	if _, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_routes_sync('test', false, '[{"prefix": "mail.", "queues": ["outbox_mail"]}]', true)`); err != nil {
		t.Fatal(err)
	}
	p := pgtest.RolePool(t, s, "outbox_producer")
	err := pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
		_, err := outbox.PublishMany(ctx, tx, []outbox.Event{{Type: "mail.a.b"}, {Type: "mail.a.c", NotBefore: time.Now().Add(time.Minute)}})
		return err
	})
	if err != nil {
		t.Fatalf("PublishMany of routed types as producer: %v", err)
	}
	for _, q := range []string{
		`SELECT outbox_publish('mail.a.b', '{}')`,
		`INSERT INTO outbox_event (event_type, payload) VALUES ('mail.a.b', '{}')`,
	} {
		if _, err := p.Exec(ctx, q); err != nil {
			t.Fatalf("%s as producer: %v", q, err)
		}
	}
	for _, q := range []string{
		`SELECT outbox_publish('audit.a.b', '{}')`,
		`INSERT INTO outbox_event (event_type, payload) VALUES ('audit.a.b', '{}')`,
	} {
		_, err := p.Exec(ctx, q)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, "matches no synced route") {
			t.Errorf("%s as producer: err = %v, want 22023", q, err)
		}
	}
	for _, q := range []string{
		`SELECT * FROM outbox_route`,
		`SELECT * FROM outbox_route_setting`,
		`SELECT * FROM outbox_routes_sync('x', false, '[]', false)`,
		`UPDATE outbox_route_setting SET strict = false`,
	} {
		if _, err := p.Exec(ctx, q); !isInsufficientPrivilege(err) {
			t.Errorf("%s as producer: err = %v, want permission denied", q, err)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event`); n != 4 {
		t.Fatalf("%d events, want 4", n)
	}
}

// TestScheduledBacklogKeepsDueClaimsCheap: with 20,000 events scheduled
// for tomorrow and 50 due, the claim (DESIGN.md's query) takes exactly the
// due ones in order, and its plan is a range scan of the claim index that
// ends at the first row not yet due: it reads the 50 due entries and a
// handful of index pages, never the scheduled ones.
func TestScheduledBacklogKeepsDueClaimsCheap(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 120*time.Second)
	if _, err := s.Pool.Exec(ctx, `
		INSERT INTO outbox_event (event_type, payload, scheduled_at)
		SELECT 'mail.reminder.due', '{}', now() + interval '1 day' + g * interval '1 second' FROM generate_series(1, 20000) g`); err != nil {
		t.Fatal(err)
	}
	var due []int64
	if err := s.Pool.QueryRow(ctx, `
		WITH ins AS (INSERT INTO outbox_event (event_type, payload) SELECT 'mail.welcome.sent', '{}' FROM generate_series(1, 50) RETURNING id)
		SELECT array_agg(id ORDER BY id) FROM ins`).Scan(&due); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `VACUUM ANALYZE outbox_event`); err != nil {
		t.Fatal(err)
	}
	const claim = `
		SELECT id FROM outbox_event
		WHERE status = 'pending' AND scheduled_at <= now()
		ORDER BY scheduled_at, id
		LIMIT 100
		FOR UPDATE SKIP LOCKED`
	var got []int64
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, claim)
		if err != nil {
			return err
		}
		got, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(due) || got[0] != due[0] || got[len(got)-1] != due[len(due)-1] {
		t.Fatalf("claimed %d events (%v...), want the %d due ones", len(got), head(got), len(due))
	}

	var plan []byte
	err = pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`+claim).Scan(&plan)
	})
	if err != nil {
		t.Fatal(err)
	}
	node := findIndexScan(t, plan, "outbox_event_claim_idx")
	if node == nil {
		t.Fatalf("the claim does not scan outbox_event_claim_idx: %s", plan)
	}
	rows, _ := node["Actual Rows"].(float64)
	blocks := node["Shared Hit Blocks"].(float64) + node["Shared Read Blocks"].(float64)
	if rows != 50 || !strings.Contains(node["Index Cond"].(string), "scheduled_at <= now()") || blocks > 40 {
		t.Fatalf("claim index scan read %v rows and %v blocks (index cond %v), want the 50 due rows and a few blocks", rows, blocks, node["Index Cond"])
	}
	t.Logf("claim with 20,000 scheduled: %v rows, %v buffers, %v ms", rows, blocks, node["Actual Total Time"])
}

func head(ids []int64) []int64 {
	if len(ids) > 5 {
		return ids[:5]
	}
	return ids
}

// findIndexScan returns the plan node that scans index, or nil.
func findIndexScan(t *testing.T, plan []byte, index string) map[string]any {
	t.Helper()
	var doc []struct {
		Plan map[string]any `json:"Plan"`
	}
	if err := json.Unmarshal(plan, &doc); err != nil || len(doc) == 0 {
		t.Fatalf("plan: %v", err)
	}
	var walk func(n map[string]any) map[string]any
	walk = func(n map[string]any) map[string]any {
		if n["Index Name"] == index {
			return n
		}
		subs, _ := n["Plans"].([]any)
		for _, sub := range subs {
			if m, ok := sub.(map[string]any); ok {
				if found := walk(m); found != nil {
					return found
				}
			}
		}
		return nil
	}
	return walk(doc[0].Plan)
}
