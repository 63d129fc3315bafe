package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/internal/proctest"
	"github.com/outboxhq/outbox/retention"
	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// loginRole creates a LOGIN role with a unique name, member of group (one
// of the shipped outbox_* roles), and returns the schema's URL for it. The
// role is dropped when the test ends (roles are cluster-wide); register
// the role's pools after calling this so that they close first.
func loginRole(t *testing.T, s *pgtest.Schema, group string) (name, dbURL string) {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	name = "t_" + strings.TrimPrefix(group, "outbox_") + "_" + hex.EncodeToString(b[:])
	admin := pgtest.Admin(t)
	ctx := context.Background()
	if _, err := admin.Exec(ctx, fmt.Sprintf(`CREATE ROLE %s LOGIN IN ROLE %s`, name, group)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// Sessions of a finished test may linger (an outboxctl pool closes
		// asynchronously); end them so that the role can go.
		_, _ = admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, name)
		if _, err := admin.Exec(ctx, `DROP ROLE `+name); err != nil {
			t.Errorf("drop role %s: %v", name, err)
		}
	})
	u, err := url.Parse(s.URL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		// keyword=value form: a later keyword wins.
		return name, s.URL + " user=" + name + " password=''"
	}
	u.User = url.User(name)
	return name, u.String()
}

func rolePoolOf(t *testing.T, dbURL, want string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var cur, sess string
	if err := pool.QueryRow(context.Background(), `SELECT current_user, session_user`).Scan(&cur, &sess); err != nil || cur != want || sess != want {
		t.Fatalf("connected as %q/%q (%v), want %q", cur, sess, err, want)
	}
	return pool
}

func denied(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42501"
}

// mergedPublish reports whether the schema has the SECURITY DEFINER publish
// functions (migrations 005/006 of the payload-guard work): without them,
// 007 leaves producers and operators unable to publish through Go's
// Publish and the SQL outbox_publish.
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

// ctlAs runs outboxctl with dbURL.
func ctlAs(dbURL string, args ...string) (int, string, string) {
	var stdout, stderr bytes.Buffer
	code := run(args, dbURL, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// TestEveryCommandUnderEveryRole runs each role's whole job as a LOGIN
// role that is a member of the shipped group role, and checks what each
// must not do: (a) outbox_operator runs every outboxctl command but
// migrate; (b) outbox_dispatcher hands off, runs retention, works River
// jobs with the receiver idempotency helpers; (c) outbox_producer
// publishes, and can neither read events nor choose ids.
func TestEveryCommandUnderEveryRole(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 3*time.Minute)
	merged := mergedPublish(t, s.Pool)

	opName, opURL := loginRole(t, s, "outbox_operator")
	dispName, dispURL := loginRole(t, s, "outbox_dispatcher")
	prodName, prodURL := loginRole(t, s, "outbox_producer")
	op := rolePoolOf(t, opURL, opName)
	disp := rolePoolOf(t, dispURL, dispName)
	prod := rolePoolOf(t, prodURL, prodName)

	exec := func(pool *pgxpool.Pool, q string, args ...any) error {
		_, err := pool.Exec(ctx, q, args...)
		return err
	}
	mustExec := func(q string, args ...any) {
		t.Helper()
		if err := exec(s.Pool, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	// Owner's fixture: failed events to requeue and cancel, old done rows
	// and an expired receipt for retention.
	mustExec(`INSERT INTO outbox_event (event_type, payload, status, last_error, tenant_id)
		SELECT 'mail.user.welcome', '{}', 'failed', 'smtp down', 't1' FROM generate_series(1, 4)`)
	mustExec(`INSERT INTO outbox_event (event_type, payload, status, processed_at)
		SELECT 'mail.user.welcome', '{}', 'done', now() - interval '40 days' FROM generate_series(1, 5)`)
	mustExec(`INSERT INTO outbox_receipt (receiver, event_id, state, expires_at) VALUES ('old', 1, 'done', now() - interval '1 day')`)
	// A parked ordering key (its head job discarded) for keys and unpark.
	parkedEvents, parkedJobs := parkKey(t, s, "t1", "order-1", 2)
	routesFile := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(routesFile, []byte("routes:\n  - prefix: \"mail.\"\n    queue: outbox_mail\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	// (a) The operator: every outboxctl command except migrate.
	t.Run("operator", func(t *testing.T) {
		okJSON := func(args ...string) map[string]any {
			t.Helper()
			code, out, errOut := ctlAs(opURL, append(args, "--json")...)
			if code != 0 {
				t.Fatalf("outboxctl %v as %s: exit %d: %s%s", args, opName, code, out, errOut)
			}
			var v map[string]any
			_ = json.Unmarshal([]byte(out), &v)
			return v
		}
		okJSON("requeue", "--type-prefix", "mail.", "--limit", "1", "--dry-run")
		if v := okJSON("requeue", "--type-prefix", "mail.", "--limit", "1", "--actor", "alice"); v["affected"] != float64(1) || v["audit_id"] != float64(1) {
			t.Errorf("requeue as operator = %v, want 1 affected, audit #1", v)
		}
		okJSON("cancel", "--type-prefix", "mail.", "--status", "failed", "--limit", "1", "--dry-run")
		if v := okJSON("cancel", "--type-prefix", "mail.", "--status", "failed", "--limit", "1", "--actor", "alice"); v["affected"] != float64(1) || v["audit_id"] != float64(2) {
			t.Errorf("cancel as operator = %v, want 1 affected, audit #2", v)
		}
		okJSON("stats", "--routes", routesFile) // reads river_queue for the worked queues
		okJSON("explain", "1", "--routes", routesFile)
		okJSON("retention", "run", "--dry-run")
		if v := okJSON("retention", "run", "--actor", "alice"); v["deleted"] != float64(5) || v["audit_id"] != float64(3) {
			t.Errorf("retention run as operator = %v, want 5 deleted, audit #3", v)
		}
		var audit []admin.AuditEntry
		code, out, errOut := ctlAs(opURL, "audit", "--json")
		if code != 0 || json.Unmarshal([]byte(out), &audit) != nil || len(audit) != 3 {
			t.Fatalf("audit as operator: exit %d, %q %q", code, out, errOut)
		}
		for _, a := range audit {
			if a.DBUser != opName || a.Actor != "alice" {
				t.Errorf("audit row %d: db_user %q actor %q, want %q and alice", a.ID, a.DBUser, a.Actor, opName)
			}
		}
		// Ordering keys: list them, unpark one (audit #4, as the operator).
		if v := okJSON("keys", "--parked"); len(v["keys"].([]any)) != 1 {
			t.Errorf("keys as operator = %v, want the parked key", v)
		}
		if v := okJSON("explain", fmt.Sprint(parkedEvents[1])); v["ordering"] == nil {
			t.Errorf("explain of a keyed event as operator = %v, want its ordering", v)
		}
		okJSON("unpark", "--key", "order-1", "--tenant", "t1", "--skip", "--dry-run")
		if v := okJSON("unpark", "--key", "order-1", "--tenant", "t1", "--skip", "--actor", "alice"); v["audit_id"] != float64(4) {
			t.Errorf("unpark as operator = %v, want audit #4", v)
		}
		if st := jobStateOf(t, s, parkedJobs[1]); st != "available" {
			t.Errorf("the job after the skipped head is %s, want available", st)
		}
		var dbUser string
		if err := s.Pool.QueryRow(ctx, `SELECT db_user FROM outbox_audit WHERE id = 4 AND action = 'unpark' AND actor = 'alice'`).Scan(&dbUser); err != nil || dbUser != opName {
			t.Errorf("unpark's audit row: db_user %q (%v), want %q", dbUser, err, opName)
		}
		// Expects the merged SECURITY DEFINER publish functions (005/006).
		if merged {
			if code, out, errOut := ctlAs(opURL, "publish", "--type", "mail.user.welcome", "--json"); code != 0 {
				t.Errorf("publish as operator: exit %d %s%s", code, out, errOut)
			}
		} else {
			t.Log("publish as operator not checked: outbox_publish/outbox_publish_many are not SECURITY DEFINER here (005/006 not merged)")
		}
		if code, _, _ := ctlAs(opURL, "migrate"); code == 0 {
			t.Error("migrate as operator succeeded; only the owner migrates")
		}

		for name, q := range map[string]string{
			"update events":          `UPDATE outbox_event SET status = 'pending'`,
			"delete events":          `DELETE FROM outbox_event`,
			"insert events":          `INSERT INTO outbox_event (event_type, payload) VALUES ('a.b.c', '{}')`,
			"truncate events":        `TRUNCATE outbox_event`,
			"delete receipts":        `DELETE FROM outbox_receipt`,
			"rewrite the audit":      `UPDATE outbox_audit SET affected = 0`,
			"delete the audit":       `DELETE FROM outbox_audit`,
			"the unaudited body":     `SELECT * FROM outbox_operator_apply('requeue', 'x', false, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 10, false, '{}')`,
			"change River jobs":      `DELETE FROM river_job`,
			"unpark by hand":         `UPDATE outbox_ordering_key SET parked_at = NULL, parked_state = NULL`,
			"draw event ids":         `SELECT nextval('outbox_event_id_seq')`,
			"purge recent done rows": `SELECT outbox_purge_done(now(), 10)`,
		} {
			if err := exec(op, q); !denied(err) && !strings.Contains(fmt.Sprint(err), "less than an hour ago") {
				t.Errorf("operator %s: %q: err = %v, want permission denied", name, q, err)
			}
		}
	})

	// (b) The dispatcher: handoff, retention, a River worker with both
	// receiver helpers.
	t.Run("dispatcher", func(t *testing.T) {
		mustExec(`INSERT INTO outbox_event (event_type, payload, status, processed_at)
			SELECT 'mail.user.welcome', '{}', 'done', now() - interval '40 days' FROM generate_series(1, 3)`)
		mustExec(`INSERT INTO outbox_receipt (receiver, event_id, state, expires_at) VALUES ('old', 2, 'done', now() - interval '1 day')`)
		mustExec(`INSERT INTO outbox_event (event_type, payload) VALUES ('mail.user.welcome', '{}'), ('mail.user.reset', '{}')`)
		// With the event the operator requeued.
		pending := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'pending'`)

		routes, err := route.New([]route.Rule{{Prefix: "mail.", Queues: []string{"outbox_mail"}}})
		if err != nil {
			t.Fatal(err)
		}
		if res := ordertest.HandOff(t, disp, routes); res.Done != pending {
			t.Fatalf("handoff as dispatcher: %+v; want %d done", res, pending)
		}

		// The Runner outboxd starts: purges done rows and expired receipts.
		runner, err := retention.NewRunner(disp, retention.RunnerConfig{Config: retention.Config{MaxAge: 720 * time.Hour, RunBy: "test"}, Interval: time.Nanosecond})
		if err != nil {
			t.Fatal(err)
		}
		rr, err := runner.RunIfDue(ctx)
		if err != nil || rr == nil || rr.Deleted != 3 || rr.ReceiptsDeleted != 1 {
			t.Fatalf("retention as dispatcher: %+v, %v; want 3 rows and 1 receipt deleted", rr, err)
		}

		// River workers: WithIdempotency for mail.user.welcome (receipt and
		// job completion in the worker's transaction), WithClaim for
		// mail.user.reset.
		done := make(chan string, pending)
		hs := outboxriver.NewHandlers()
		hs.HandleFunc("mail.user.welcome", func(ctx context.Context, ev outboxriver.Event) error {
			return pgx.BeginFunc(ctx, disp, func(tx pgx.Tx) error {
				_, err := outboxriver.WithIdempotency(ctx, tx, outboxriver.Receiver{Name: "mailer"}, ev, func(context.Context, pgx.Tx) error { return nil })
				if err == nil {
					done <- ev.Type
				}
				return err
			})
		})
		hs.HandleFunc("mail.user.reset", func(ctx context.Context, ev outboxriver.Event) error {
			_, _, err := outboxriver.WithClaim(ctx, disp, outboxriver.Receiver{Name: "resetter"}, ev, func(context.Context) (string, error) { return "sent", nil })
			if err == nil {
				done <- ev.Type
			}
			return err
		})
		workers := river.NewWorkers()
		river.AddWorker(workers, outboxriver.NewWorker(hs, outboxriver.WorkerOptions{}))
		cfg := outboxriver.WorkerConfig(workers, map[string]int{"outbox_mail": 2}, outboxriver.WorkerLatency{})
		riverLog := &proctest.SyncBuffer{}
		cfg.Logger = slog.New(slog.NewTextHandler(riverLog, nil))
		client, err := river.NewClient(riverpgxv5.New(disp), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := client.Start(ctx); err != nil {
			t.Fatalf("start River workers as dispatcher: %v", err)
		}
		t.Cleanup(func() {
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = client.Stop(sctx)
		})
		for range pending {
			select {
			case <-done:
			case <-ctx.Done():
				t.Fatal("River workers as dispatcher did not work every job")
			}
		}
		pgtest.WaitFor(t, 60*time.Second, "every job completed and every receipt written", func() bool {
			return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`) == pending &&
				pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_receipt WHERE state = 'done' AND receiver IN ('mailer', 'resetter')`) == pending
		})
		// The client elected itself leader (river_leader) and reported its
		// queue (river_queue), both as the dispatcher role.
		pgtest.WaitFor(t, 60*time.Second, "a River leader and the reported queue", func() bool {
			return pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_leader`) == 1 &&
				pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_queue WHERE name = 'outbox_mail'`) == 1
		})
		if strings.Contains(riverLog.String(), "permission denied") {
			t.Errorf("River as dispatcher logged a permission error:\n%s", riverLog.String())
		}

		for name, q := range map[string]string{
			"write the audit":  `INSERT INTO outbox_audit (actor, action, affected) VALUES ('x', 'requeue', 0)`,
			"read the audit":   `SELECT * FROM outbox_audit`,
			"delete events":    `DELETE FROM outbox_event`,
			"insert events":    `INSERT INTO outbox_event (event_type, payload) VALUES ('a.b.c', '{}')`,
			"requeue":          `SELECT * FROM outbox_requeue('x', false, ids => '{1}')`,
			"cancel":           `SELECT * FROM outbox_cancel('x', false, ids => '{1}')`,
			"alter the outbox": `ALTER TABLE outbox_event ADD COLUMN x int`,
		} {
			if err := exec(disp, q); !denied(err) {
				t.Errorf("dispatcher %s: %q: err = %v, want permission denied", name, q, err)
			}
		}
	})

	// (c) The producer.
	t.Run("producer", func(t *testing.T) {
		var id int64
		if err := prod.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, tenant_id, dispatch_key) VALUES ('mail.user.welcome', '{}', 't1', 'k1') RETURNING id`).Scan(&id); err != nil || id == 0 {
			t.Fatalf("plain INSERT ... RETURNING id as producer: %d, %v", id, err)
		}
		if err := exec(prod, `INSERT INTO outbox_event (event_type, payload, dispatch_key) VALUES ('mail.user.welcome', '{}', 'k1') ON CONFLICT DO NOTHING`); err != nil {
			t.Errorf("plain INSERT ... ON CONFLICT DO NOTHING as producer: %v", err)
		}
		// Expects the merged SECURITY DEFINER publish functions (005/006).
		if merged {
			err := pgx.BeginFunc(ctx, prod, func(tx pgx.Tx) error {
				if _, err := outbox.Publish(ctx, tx, outbox.Event{Type: "mail.user.welcome", TenantID: "t1", DispatchKey: "k2"}); err != nil {
					return err
				}
				res, err := outbox.PublishMany(ctx, tx, []outbox.Event{
					{Type: "mail.user.welcome", TenantID: "t1", DispatchKey: "k3"},
					{Type: "mail.user.welcome", TenantID: "t1", DispatchKey: "k3"},
				})
				if err == nil && (!res[1].Duplicate || res[1].ID != res[0].ID) {
					err = fmt.Errorf("PublishMany results %+v", res)
				}
				return err
			})
			if err != nil {
				t.Errorf("Publish/PublishMany as producer: %v", err)
			}
			var sqlID int64
			if err := prod.QueryRow(ctx, `SELECT outbox_publish('mail.user.welcome', '{}', 't1', 'k4')`).Scan(&sqlID); err != nil {
				t.Errorf("outbox_publish as producer: %v", err)
			}
		} else {
			t.Log("Publish, PublishMany and outbox_publish as producer not checked: they need the SECURITY DEFINER functions of 005/006")
		}

		for name, q := range map[string]string{
			"read payloads":      `SELECT payload FROM outbox_event`,
			"read dispatch keys": `SELECT id, dispatch_key FROM outbox_event`,
			"read tenants":       `SELECT tenant_id FROM outbox_event`,
			"choose the id":      `INSERT INTO outbox_event (id, event_type, payload) OVERRIDING SYSTEM VALUE VALUES (1000000, 'a.b.c', '{}')`,
			"draw ids":           `SELECT nextval('outbox_event_id_seq')`,
			"update":             `UPDATE outbox_event SET status = 'done'`,
			"delete":             `DELETE FROM outbox_event`,
			"requeue":            `SELECT * FROM outbox_requeue('x', false, ids => '{1}')`,
			"purge":              `SELECT outbox_purge_done(now() - interval '1 day', 10)`,
			"read receipts":      `SELECT * FROM outbox_receipt`,
		} {
			if err := exec(prod, q); !denied(err) {
				t.Errorf("producer %s: %q: err = %v, want permission denied", name, q, err)
			}
		}
	})
}
