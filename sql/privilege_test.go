package outboxsql_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/claim"
	"github.com/outboxhq/outbox/dispatcher"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
	outboxsql "github.com/outboxhq/outbox/sql"
)

func isInsufficientPrivilege(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42501"
}

// TestProducerRoleCanOnlyPublish publishes as outbox_producer through every
// producer path (Publish, PublishMany with duplicate keys, outbox_publish,
// a plain INSERT) and shows that the role cannot read events, change their
// status, delete them or touch River's jobs.
func TestProducerRoleCanOnlyPublish(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	// Another tenant's event, written by the owner.
	var otherID int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('billing.invoice.paid', '{"secret": "other tenant"}', 'tenant-b', 'k-b')`).Scan(&otherID); err != nil {
		t.Fatal(err)
	}

	p := pgtest.RolePool(t, s, "outbox_producer")
	published := 0
	// Go's Publish/PublishMany and outbox_publish need SELECT on
	// dispatch_key (ON CONFLICT's arbiter, the duplicate lookup) and, for
	// Go, INSERT (id): 007 revokes both, and the SECURITY DEFINER publish
	// functions of 005/006 take over. These assertions expect those.
	if mergedPublish(t, s.Pool) {
		var res []outbox.Published
		err := pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
			var err error
			res, err = outbox.PublishMany(ctx, tx, []outbox.Event{
				{Type: "mail.user.welcome", TenantID: "tenant-a", DispatchKey: "k-a"},
				{Type: "mail.user.welcome", TenantID: "tenant-a", DispatchKey: "k-a"}, // duplicate in batch
			})
			return err
		})
		if err != nil {
			t.Fatalf("PublishMany as producer: %v", err)
		}
		if res[0].Duplicate || !res[1].Duplicate || res[1].ID != res[0].ID {
			t.Fatalf("PublishMany results %+v", res)
		}
		var sqlID, dupID int64
		if err := p.QueryRow(ctx, `SELECT outbox_publish('audit.user.login', '{}', 'tenant-a', 'k-sql')`).Scan(&sqlID); err != nil {
			t.Fatalf("outbox_publish as producer: %v", err)
		}
		if err := p.QueryRow(ctx, `SELECT outbox_publish('audit.user.login', '{}', 'tenant-a', 'k-sql')`).Scan(&dupID); err != nil || dupID != sqlID {
			t.Fatalf("outbox_publish duplicate as producer: id %d, err %v (want %d)", dupID, err, sqlID)
		}
		published += 2
	} else {
		t.Log("Publish, PublishMany and outbox_publish as producer not checked: they need the SECURITY DEFINER functions of 005/006")
	}
	var plainID int64
	if err := p.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, tenant_id) VALUES ('audit.user.logout', '{}', 'tenant-a') RETURNING id`).Scan(&plainID); err != nil {
		t.Fatalf("plain INSERT ... RETURNING id as producer: %v", err)
	}
	published++

	refused := map[string]string{
		"read payloads":         `SELECT payload FROM outbox_event WHERE id = ` + itoa(otherID),
		"read tenants":          `SELECT tenant_id FROM outbox_event`,
		"read everything":       `SELECT * FROM outbox_event`,
		"read dispatch keys":    `SELECT id, dispatch_key FROM outbox_event`,
		"choose the id":         `INSERT INTO outbox_event (id, event_type, payload) OVERRIDING SYSTEM VALUE VALUES (1000000, 'a.b.c', '{}')`,
		"draw ids":              `SELECT nextval('outbox_event_id_seq')`,
		"read status":           `SELECT status FROM outbox_event`,
		"filter on tenant":      `SELECT id FROM outbox_event WHERE tenant_id = 'tenant-b'`,
		"mark done":             `UPDATE outbox_event SET status = 'done'`,
		"cancel":                `UPDATE outbox_event SET status = 'cancelled' WHERE id = ` + itoa(otherID),
		"delete":                `DELETE FROM outbox_event`,
		"set status on insert":  `INSERT INTO outbox_event (event_type, payload, status) VALUES ('a.b.c', '{}', 'done')`,
		"schedule on insert":    `INSERT INTO outbox_event (event_type, payload, scheduled_at) VALUES ('a.b.c', '{}', now() + interval '1 year')`,
		"read River jobs":       `SELECT * FROM river_job`,
		"insert River jobs":     `INSERT INTO river_job (args, kind, max_attempts, queue, state) VALUES ('{}', 'outbox_event', 1, 'outbox_mail', 'available')`,
		"truncate":              `TRUNCATE outbox_event`,
		"read the audit trail":  `SELECT * FROM outbox_audit`,
		"select for update":     `SELECT id FROM outbox_event FOR UPDATE`,
		"create in the schema":  `CREATE TABLE producer_was_here (x int)`,
		"alter the outbox":      `ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_type_format`,
		"drop the wake trigger": `DROP TRIGGER outbox_event_wake ON outbox_event`,
	}
	for name, q := range refused {
		_, err := p.Exec(ctx, q)
		if !isInsufficientPrivilege(err) {
			var owner string
			_ = p.QueryRow(ctx, `SELECT current_user`).Scan(&owner)
			t.Errorf("%s: %q as %s: err = %v, want permission denied (42501)", name, q, owner, err)
		}
	}

	var pending, done int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'done') FROM outbox_event`).Scan(&pending, &done); err != nil {
		t.Fatal(err)
	}
	if pending != published+1 || done != 0 {
		t.Fatalf("pending=%d done=%d, want %d and 0", pending, done, published+1)
	}
}

// mergedPublish reports whether outbox_publish and outbox_publish_many are
// SECURITY DEFINER here (migrations 005/006, merged separately).
func mergedPublish(t *testing.T, pool *pgxpool.Pool) bool {
	t.Helper()
	var ok bool
	err := pool.QueryRow(context.Background(), `
		SELECT count(*) = 2 FROM pg_proc
		WHERE pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
		  AND prosecdef AND proname IN ('outbox_publish', 'outbox_publish_many')`).Scan(&ok)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

func itoa(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// TestDispatcherRoleDispatches runs a real dispatcher (listener, wake lock,
// River insert) as outbox_dispatcher and a producer as outbox_producer: the
// events are handed off, and the dispatcher cannot publish through the
// producer's function nor change the schema.
func TestDispatcherRoleDispatches(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 90*time.Second)
	prod := pgtest.RolePool(t, s, "outbox_producer")
	disp := pgtest.RolePool(t, s, "outbox_dispatcher")

	routes, err := route.New([]route.Rule{
		{Prefix: "mail.", Queues: []string{"outbox_mail"}},
		{Prefix: "audit.", Queues: []string{"outbox_audit", "outbox_mail"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	handed := map[int64]bool{}
	d, err := dispatcher.New(disp, dispatcher.Config{
		Routes:       routes,
		BatchSize:    7,
		Concurrency:  2,
		PollInterval: 100 * time.Millisecond,
		Logger:       slog.New(slog.NewTextHandler(io.Discard, nil)),
		OnBatch: func(r claim.Result) {
			mu.Lock()
			defer mu.Unlock()
			for _, h := range r.Handed {
				handed[h.ID] = true
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatalf("start as outbox_dispatcher: %v", err)
	}
	t.Cleanup(func() { _ = d.Stop(context.Background()) })

	// Go's Publish needs the SECURITY DEFINER functions of 005/006 as the
	// producer since 007; without them the producer inserts plainly.
	merged := mergedPublish(t, s.Pool)
	const n = 50
	for i := range n {
		typ := "mail.user.welcome"
		if i%5 == 0 {
			typ = "audit.user.login"
		}
		if !merged {
			if _, err := prod.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, tenant_id) VALUES ($1, '{}', 't')`, typ); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := pgx.BeginFunc(ctx, prod, func(tx pgx.Tx) error {
			_, err := outbox.Publish(ctx, tx, outbox.Event{Type: typ, TenantID: "t"})
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	// An unroutable event is failed by the dispatcher role.
	if _, err := prod.Exec(ctx, `INSERT INTO outbox_event (event_type, payload) VALUES ('nowhere.to.go', '{}')`); err != nil {
		t.Fatal(err)
	}

	pgtest.WaitFor(t, 60*time.Second, "no event pending as outbox_dispatcher", func() bool {
		return pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'pending'`) == 0
	})
	var done, failed, jobs, dups int
	if err := s.Pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM outbox_event WHERE status = 'done'),
		(SELECT count(*) FROM outbox_event WHERE status = 'failed'),
		(SELECT count(*) FROM river_job),
		(SELECT count(*) FROM (SELECT 1 FROM river_job GROUP BY args->>'event_id', queue HAVING count(*) > 1) x)`).Scan(&done, &failed, &jobs, &dups); err != nil {
		t.Fatal(err)
	}
	if done != n || failed != 1 || jobs != n+n/5 || dups != 0 {
		t.Fatalf("done=%d failed=%d jobs=%d dups=%d, want %d, 1, %d, 0", done, failed, jobs, dups, n, n+n/5)
	}

	mu.Lock()
	if len(handed) != n {
		t.Errorf("OnBatch saw %d handed-off events, want %d", len(handed), n)
	}
	mu.Unlock()

	for name, q := range map[string]string{
		"publish":          `SELECT outbox_publish('a.b.c', '{}')`,
		"insert events":    `INSERT INTO outbox_event (event_type, payload) VALUES ('a.b.c', '{}')`,
		"alter the outbox": `ALTER TABLE outbox_event ADD COLUMN x int`,
		"delete events":    `DELETE FROM outbox_event`,
		"write the audit":  `INSERT INTO outbox_audit (actor, action, affected) VALUES ('x', 'requeue', 0)`,
	} {
		if _, err := disp.Exec(ctx, q); !isInsufficientPrivilege(err) {
			t.Errorf("dispatcher %s: err = %v, want permission denied", name, err)
		}
	}
}

// TestOperatorRoleReadsAndRequeues exercises what outboxctl does as
// outbox_operator: read events and jobs, requeue a failed event through the
// audited function (the change and its audit row in one transaction), and
// nothing that changes events without an audit row.
func TestOperatorRoleReadsAndRequeues(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, status, last_error) VALUES ('a.b.c', '{}', 'failed', 'x')`); err != nil {
		t.Fatal(err)
	}
	op := pgtest.RolePool(t, s, "outbox_operator")
	for _, q := range []string{
		`SELECT count(*) FROM outbox_event WHERE status = 'failed'`,
		`SELECT count(*) FROM river_job`,
		`SELECT count(*) FROM outbox_receipt`,
		`SELECT * FROM outbox_requeue('test', dry_run => true, statuses => '{failed}')`,
		`SELECT * FROM outbox_requeue('test', dry_run => false, statuses => '{failed}')`,
		`INSERT INTO outbox_audit (actor, action, affected) VALUES ('test', 'retention', 1)`,
	} {
		if _, err := op.Exec(ctx, q); err != nil {
			t.Errorf("operator: %q: %v", q, err)
		}
	}
	var status string
	var audits int
	if err := s.Pool.QueryRow(ctx, `SELECT (SELECT status::text FROM outbox_event), (SELECT count(*) FROM outbox_audit WHERE action = 'requeue' AND affected = 1)`).Scan(&status, &audits); err != nil || status != "pending" || audits != 1 {
		t.Fatalf("after the operator's requeue: status %q, %d requeue audit rows (%v); want pending and 1", status, audits, err)
	}
	if mergedPublish(t, s.Pool) {
		if _, err := op.Exec(ctx, `SELECT outbox_publish('a.b.c', '{}')`); err != nil {
			t.Errorf("operator: outbox_publish: %v", err)
		}
	}
	for _, q := range []string{
		`DELETE FROM river_job`, `DROP TABLE outbox_audit`, `UPDATE outbox_audit SET affected = 0`,
		`UPDATE outbox_event SET status = 'pending', retries = 0, last_error = NULL WHERE status = 'failed'`,
		`DELETE FROM outbox_event`, `INSERT INTO outbox_event (event_type, payload) VALUES ('a.b.c', '{}')`,
		`DELETE FROM outbox_receipt`,
	} {
		if _, err := op.Exec(ctx, q); !isInsufficientPrivilege(err) {
			t.Errorf("operator: %q: err = %v, want permission denied", q, err)
		}
	}
}

// TestRolesMigrationIsConcurrentSafe migrates fresh schemas at once: the
// cluster-wide roles are created (or found) by whichever migration gets
// there first, and none fails.
func TestRolesMigrationIsConcurrentSafe(t *testing.T) {
	t.Parallel()
	const n = 4
	schemas := make([]*pgtest.Schema, n)
	for i := range schemas {
		schemas[i] = pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true, MaxConns: 2})
	}
	ctx := pgtest.Context(t, 120*time.Second)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i, s := range schemas {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = outboxsql.Migrate(ctx, s.Pool, nil)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("schema %d: %v", i, err)
		}
	}
	var roles []string
	rows, err := schemas[0].Pool.Query(ctx, `SELECT rolname || ':' || rolcanlogin FROM pg_roles WHERE rolname LIKE 'outbox\_%' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	roles, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(roles, " "); got != "outbox_dispatcher:false outbox_operator:false outbox_producer:false" {
		t.Fatalf("roles %q", got)
	}
}
