package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestSQLPublishTextOverloadNamesThePayload: with the payload as text (an
// untyped literal or a driver's parameter), what the cast to jsonb refuses
// comes back as one 22023 error naming the payload and the rule.
func TestSQLPublishTextOverloadNamesThePayload(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	cases := []struct{ payload, rule string }{
		{`{"a":`, "payload is not valid JSON"},
		{`{} {}`, "payload is not valid JSON"},
		{`{"a": "x\u0000y"}`, `payload contains \u0000`},
		{`{"\u0000": 1}`, `payload contains \u0000`},
		{`["\ud800"]`, "payload has an unpaired surrogate escape"},
		{`["\udc00x"]`, "payload has an unpaired surrogate escape"},
		{`1e999999`, "payload has a number outside the range"},
		{strings.Repeat("[", 200000), "payload is nested too deep to parse, the limit is 1000"},
		{nestedArrays(1001), "payload is nested more than 1000 levels deep, the limit is 1000"},
	}
	for _, c := range cases {
		for _, form := range []string{
			`SELECT outbox_publish('a.b.c', $1)`,
			`SELECT outbox_publish('a.b.c', $1::text)`,
			`SELECT outbox_publish(event_type => 'a.b.c', payload => $1, dispatch_key => 'k')`,
		} {
			tx, err := s.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			_, err = tx.Exec(ctx, form, c.payload)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, c.rule) {
				t.Errorf("%s with %.40q: err = %v, want 22023 %q", form, c.payload, err, c.rule)
			}
			_ = tx.Rollback(ctx)
		}
	}
	// The same in an untyped literal, as psql users write it.
	_, err := s.Pool.Exec(ctx, `SELECT outbox_publish('a.b.c', '{"a": "\u0000"}')`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, `payload contains \u0000`) {
		t.Errorf("untyped literal with \\u0000: err = %v", err)
	}
	if n := countEvents(t, s.Pool); n != 0 {
		t.Fatalf("%d events stored", n)
	}
}

// TestSQLPublishOverloadResolution: existing calls keep working: untyped
// literals, ::jsonb, jsonb expressions, named parameters of either type, and
// driver parameters as Go strings or bytes.
func TestSQLPublishOverloadResolution(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	calls := []struct {
		sql  string
		args []any
	}{
		{`SELECT outbox_publish('a.b.c', '{"n": 1}')`, nil},
		{`SELECT outbox_publish('a.b.c', '{"n": 1}'::jsonb)`, nil},
		{`SELECT outbox_publish('a.b.c', jsonb_build_object('n', 1), 't1')`, nil},
		{`SELECT outbox_publish('a.b.c', '{"n": 1}', NULL, 'k-text')`, nil},
		{`SELECT outbox_publish(event_type => 'a.b.c', payload => '{"n": 1}', dispatch_key => 'k-named')`, nil},
		{`SELECT outbox_publish(event_type => 'a.b.c', payload => '{"n": 1}'::jsonb, tenant_id => 't2')`, nil},
		{`SELECT outbox_publish(dispatch_key => 'k-named2', payload => '{"n": 1}'::jsonb, event_type => 'a.b.c')`, nil},
		{`SELECT outbox_publish($1, $2)`, []any{"a.b.c", `{"n": 1}`}},
		{`SELECT outbox_publish($1, $2)`, []any{"a.b.c", []byte(`{"n": 1}`)}},
		{`SELECT outbox_publish($1, $2::jsonb, $3, $4)`, []any{"a.b.c", `{"n": 1}`, "t3", "k-param"}},
	}
	for _, c := range calls {
		var id int64
		if err := s.Pool.QueryRow(ctx, c.sql, c.args...).Scan(&id); err != nil || id == 0 {
			t.Errorf("%s: id %d, err %v", c.sql, id, err)
		}
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE payload = '{"n": 1}'`); n != len(calls) {
		t.Fatalf("%d events stored, want %d", n, len(calls))
	}
	// A payload typed jsonb never reaches the text version: the cast fails
	// in the caller's statement, before any function runs.
	_, err := s.Pool.Exec(ctx, `SELECT outbox_publish('a.b.c', '{"a":'::jsonb)`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "22P02" {
		t.Fatalf("::jsonb of malformed JSON: err = %v, want the cast's 22P02", err)
	}
}

// TestSQLPublishRawNULNeverReachesTheServer documents what a producer sees
// for a raw NUL byte: text cannot hold it, so the server refuses the
// parameter itself (22021) before outbox_publish runs, without naming the
// field. Publish refuses the same payload as invalid JSON (a raw control
// character in a string), and a NUL in a tenant or key as a NUL byte.
func TestSQLPublishRawNULNeverReachesTheServer(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	for _, args := range [][]any{
		{"{\"a\": \"x\x00y\"}", nil},
		{`{}`, "tenant\x00"},
	} {
		_, err := s.Pool.Exec(ctx, `SELECT outbox_publish('a.b.c', $1, $2)`, args...)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22021" || !strings.Contains(pgErr.Message, "0x00") {
			t.Errorf("raw NUL in %q: err = %v, want 22021 invalid byte sequence 0x00", args, err)
		}
	}
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", Payload: []byte("{\"a\": \"x\x00y\"}")})
		return err
	})
	var verr *outbox.ValidationError
	if !errors.As(err, &verr) || verr.Field != "Payload" {
		t.Errorf("Publish with a raw NUL: err = %v, want a Payload ValidationError", err)
	}
	if n := countEvents(t, s.Pool); n != 0 {
		t.Fatalf("%d events stored", n)
	}
}

// publisher publishes one keyed event in tx, through Go or through SQL.
type publisher struct {
	name    string
	publish func(ctx context.Context, tx pgx.Tx, key string) (int64, error)
}

var publishers = []publisher{
	{"Publish", func(ctx context.Context, tx pgx.Tx, key string) (int64, error) {
		res, err := outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", TenantID: "t", DispatchKey: key})
		return res.ID, err
	}},
	{"PublishMany", func(ctx context.Context, tx pgx.Tx, key string) (int64, error) {
		res, err := outbox.PublishMany(ctx, tx, []outbox.Event{{Type: "a.b.c"}, {Type: "a.b.c", TenantID: "t", DispatchKey: key}})
		if err != nil {
			return 0, err
		}
		return res[1].ID, nil
	}},
	{"outbox_publish", func(ctx context.Context, tx pgx.Tx, key string) (int64, error) {
		var id int64
		err := tx.QueryRow(ctx, `SELECT outbox_publish('a.b.c', '{}', 't', $1)`, key).Scan(&id)
		return id, err
	}},
}

var isoLevels = []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable}

// TestDuplicateKeyUnderIsolationLevels pins down what a duplicate dispatch
// key does at each isolation level, for Go and SQL:
//
//   - the first event committed before the caller's snapshot: the duplicate
//     gets the first id at every level;
//   - committed after the snapshot, or in flight and committed while the
//     caller's insert waits: READ COMMITTED gets the first id; REPEATABLE
//     READ and SERIALIZABLE get 40001 (the row is invisible to the
//     snapshot), and a retry of the transaction gets the first id.
func TestDuplicateKeyUnderIsolationLevels(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 6})
	ctx := pgtest.Context(t, 120*time.Second)
	n := 0
	firstEvent := func(key string) int64 {
		var id int64
		if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('a.b.c', '{}', 't', $1)`, key).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	for _, p := range publishers {
		for _, iso := range isoLevels {
			strict := iso != pgx.ReadCommitted
			check := func(what string, id, want int64, err error, mayFail bool) {
				t.Helper()
				var pgErr *pgconn.PgError
				switch {
				case mayFail:
					if !errors.As(err, &pgErr) || pgErr.Code != "40001" {
						t.Errorf("%s %s %s: id %d err %v, want 40001", p.name, iso, what, id, err)
					} else if p.name != "outbox_publish" && !strings.Contains(err.Error(), "retry the whole transaction") {
						t.Errorf("%s %s %s: %v, want a hint to retry", p.name, iso, what, err)
					}
				case err != nil || id != want:
					t.Errorf("%s %s %s: id %d err %v, want the first id %d", p.name, iso, what, id, err, want)
				}
			}
			begin := func() pgx.Tx {
				tx, err := s.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
				if err != nil {
					t.Fatal(err)
				}
				// The first statement takes the snapshot (and the pid).
				var pid int
				if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
					t.Fatal(err)
				}
				return tx
			}

			// Committed before the snapshot.
			n++
			key := "visible-" + strings.Repeat("x", n)
			want := firstEvent(key)
			tx := begin()
			id, err := p.publish(ctx, tx, key)
			check("visible", id, want, err, false)
			_ = tx.Rollback(ctx)

			// Committed after the snapshot.
			n++
			key = "after-" + strings.Repeat("x", n)
			tx = begin()
			want = firstEvent(key)
			id, err = p.publish(ctx, tx, key)
			check("committed after the snapshot", id, want, err, strict)
			_ = tx.Rollback(ctx)
			tx = begin()
			id, err = p.publish(ctx, tx, key)
			check("retried", id, want, err, false)
			_ = tx.Rollback(ctx)

			// In flight: the caller's insert waits for the first, which commits.
			n++
			key = "inflight-" + strings.Repeat("x", n)
			first, err := s.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := first.QueryRow(ctx, `SELECT outbox_publish('a.b.c', '{}', 't', $1)`, key).Scan(&want); err != nil {
				t.Fatal(err)
			}
			tx = begin()
			var pid int
			if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				t.Fatal(err)
			}
			type result struct {
				id  int64
				err error
			}
			done := make(chan result, 1)
			go func() {
				id, err := p.publish(ctx, tx, key)
				done <- result{id, err}
			}()
			pgtest.WaitFor(t, 30*time.Second, "the duplicate's insert to wait for the first", func() bool {
				return pgtest.Count(t, s.Pool, `SELECT cardinality(pg_blocking_pids($1))`, pid) > 0
			})
			if err := first.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			r := <-done
			check("in flight", r.id, want, r.err, strict)
			_ = tx.Rollback(ctx)
		}
	}
}

// TestPublishManyBatchDuplicatesUnderIsolationLevels: duplicates inside one
// batch map to the first id at every isolation level.
func TestPublishManyBatchDuplicatesUnderIsolationLevels(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	for _, iso := range isoLevels {
		var res []outbox.Published
		err := pgx.BeginTxFunc(ctx, s.Pool, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) (err error) {
			res, err = outbox.PublishMany(ctx, tx, []outbox.Event{
				{Type: "a.b.c", DispatchKey: "b-" + string(iso)},
				{Type: "a.b.c", DispatchKey: "b-" + string(iso)},
			})
			return err
		})
		if err != nil || res[0].Duplicate || !res[1].Duplicate || res[1].ID != res[0].ID {
			t.Errorf("%s: %+v %v", iso, res, err)
		}
	}
}
