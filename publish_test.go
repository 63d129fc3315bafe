package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

func countEvents(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_event`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestPublishRoundTrip(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)

	var res outbox.Published
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		var err error
		res, err = outbox.Publish(ctx, tx, outbox.Event{
			Type:        "plugin.capability-use.granted",
			Payload:     json.RawMessage(`{"plugin": "x", "n": 1}`),
			TenantID:    "tenant-1",
			DispatchKey: "stripe:evt_1",
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.ID == 0 || res.Duplicate {
		t.Fatalf("got %+v, want a new id", res)
	}
	var (
		typ, tenant, key, status string
		payload                  map[string]any
		retries                  int
	)
	err = s.Pool.QueryRow(ctx, `SELECT event_type, tenant_id, dispatch_key, status::text, payload, retries FROM outbox_event WHERE id = $1`, res.ID).
		Scan(&typ, &tenant, &key, &status, &payload, &retries)
	if err != nil {
		t.Fatal(err)
	}
	if typ != "plugin.capability-use.granted" || tenant != "tenant-1" || key != "stripe:evt_1" || status != "pending" || retries != 0 {
		t.Fatalf("stored row = %q %q %q %q %d", typ, tenant, key, status, retries)
	}
	if payload["plugin"] != "x" || payload["n"] != float64(1) {
		t.Fatalf("payload = %v", payload)
	}
}

func TestPublishNilPayloadIsEmptyObject(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	var res outbox.Published
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) (err error) {
		res, err = outbox.Publish(ctx, tx, outbox.Event{Type: "audit.user.login"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var p string
	if err := s.Pool.QueryRow(ctx, `SELECT payload::text FROM outbox_event WHERE id = $1`, res.ID).Scan(&p); err != nil {
		t.Fatal(err)
	}
	if p != "{}" {
		t.Fatalf("payload = %s, want {}", p)
	}
}

// invalidEvents are the bad inputs every producer path must refuse.
var invalidEvents = []struct {
	name  string
	event outbox.Event
	field string
	rule  string
}{
	{"empty type", outbox.Event{Type: ""}, "Type", "is required"},
	{"uppercase", outbox.Event{Type: "Billing.invoice.paid"}, "Type", "lowercase"},
	{"two segments", outbox.Event{Type: "billing.paid"}, "Type", "three"},
	{"empty segment", outbox.Event{Type: "billing..paid"}, "Type", "three"},
	{"leading dash", outbox.Event{Type: "billing.-invoice.paid"}, "Type", "dashes"},
	{"double dash", outbox.Event{Type: "billing.in--voice.paid"}, "Type", "dashes"},
	{"trailing dot", outbox.Event{Type: "billing.invoice.paid."}, "Type", "segments"},
	{"unicode", outbox.Event{Type: "billing.rechnung.bezahlt-ü"}, "Type", "lowercase"},
	{"space", outbox.Event{Type: "billing.invoice.paid now"}, "Type", "lowercase"},
	{"underscore", outbox.Event{Type: "billing.invoice_x.paid"}, "Type", "lowercase"},
	{"very long", outbox.Event{Type: "a." + strings.Repeat("b", 300) + ".c"}, "Type", "limit is 255"},
	{"payload not JSON", outbox.Event{Type: "a.b.c", Payload: json.RawMessage(`{"a":`)}, "Payload", "not valid JSON"},
	{"payload two values", outbox.Event{Type: "a.b.c", Payload: json.RawMessage(`{} {}`)}, "Payload", "not valid JSON"},
	{"payload NUL escape", outbox.Event{Type: "a.b.c", Payload: json.RawMessage(`{"a":"x\u0000y"}`)}, "Payload", `\u0000`},
	{"payload NUL escape in key", outbox.Event{Type: "a.b.c", Payload: json.RawMessage(`{"\u0000":1}`)}, "Payload", `\u0000`},
	{"payload too large", outbox.Event{Type: "a.b.c", Payload: json.RawMessage(`"` + strings.Repeat("x", outbox.MaxPayloadBytes) + `"`)}, "Payload", "limit is 1048576"},
	{"payload invalid UTF-8", outbox.Event{Type: "a.b.c", Payload: json.RawMessage("{\"a\":\"\xff\"}")}, "Payload", "UTF-8"},
	{"payload lone high surrogate", outbox.Event{Type: "a.b.c", Payload: json.RawMessage(`{"a":"\ud800x"}`)}, "Payload", "unpaired surrogate"},
	{"payload lone low surrogate", outbox.Event{Type: "a.b.c", Payload: json.RawMessage(`["\udc00"]`)}, "Payload", "unpaired surrogate"},
	{"payload number too large", outbox.Event{Type: "a.b.c", Payload: json.RawMessage(`{"n":1e131072}`)}, "Payload", "range of Postgres' numeric"},
	{"payload number too small", outbox.Event{Type: "a.b.c", Payload: json.RawMessage(`[1e-16384]`)}, "Payload", "range of Postgres' numeric"},
	{"tenant too long", outbox.Event{Type: "a.b.c", TenantID: strings.Repeat("t", 129)}, "TenantID", "limit is 128"},
	{"tenant NUL", outbox.Event{Type: "a.b.c", TenantID: "a\x00b"}, "TenantID", "NUL"},
	{"key too long", outbox.Event{Type: "a.b.c", DispatchKey: strings.Repeat("k", 257)}, "DispatchKey", "limit is 256"},
	{"key invalid UTF-8", outbox.Event{Type: "a.b.c", DispatchKey: "k\xff"}, "DispatchKey", "UTF-8"},
}

func TestPublishRejectsInvalidInputAndWritesNothing(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	for _, tc := range invalidEvents {
		t.Run(tc.name, func(t *testing.T) {
			tx, err := s.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, `CREATE TEMP TABLE IF NOT EXISTS marker (x int)`); err != nil {
				t.Fatal(err)
			}
			_, err = outbox.Publish(ctx, tx, tc.event)
			var verr *outbox.ValidationError
			if !errors.As(err, &verr) || !errors.Is(err, outbox.ErrInvalidEvent) {
				t.Fatalf("err = %v, want a ValidationError", err)
			}
			if verr.Field != tc.field || !strings.Contains(err.Error(), tc.rule) {
				t.Fatalf("err = %v (field %s), want field %s and %q", err, verr.Field, tc.field, tc.rule)
			}
			// The caller's transaction is still usable.
			if _, err := tx.Exec(ctx, `INSERT INTO marker VALUES (1)`); err != nil {
				t.Fatalf("transaction unusable after a validation error: %v", err)
			}
		})
	}
	if n := countEvents(t, s.Pool); n != 0 {
		t.Fatalf("%d events written, want 0", n)
	}
}

func TestPublishManyAllOrNothingOnInvalid(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "a.b.c"}, {Type: "a.b.c"}, {Type: "bad"},
		})
		return err
	})
	var verr *outbox.ValidationError
	if !errors.As(err, &verr) || verr.Index != 2 || verr.Field != "Type" {
		t.Fatalf("err = %v, want event 2's Type", err)
	}
	if n := countEvents(t, s.Pool); n != 0 {
		t.Fatalf("%d events written, want 0", n)
	}
}

func TestPublishDuplicateKeyKeepsTransaction(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	if _, err := s.Pool.Exec(ctx, `CREATE TABLE orders (id int primary key)`); err != nil {
		t.Fatal(err)
	}
	publish := func(orderID int) outbox.Published {
		var res outbox.Published
		err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES ($1)`, orderID); err != nil {
				return err
			}
			var err error
			res, err = outbox.Publish(ctx, tx, outbox.Event{Type: "billing.order.placed", DispatchKey: "order-key", Payload: json.RawMessage(fmt.Sprintf(`{"order": %d}`, orderID))})
			if err != nil {
				return err
			}
			// The transaction must still accept statements.
			_, err = tx.Exec(ctx, `SELECT 1`)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	first := publish(1)
	second := publish(2)
	if first.Duplicate || !second.Duplicate || second.ID != first.ID {
		t.Fatalf("first %+v second %+v: want the second to be a duplicate of the first", first, second)
	}
	var orders, events int
	if err := s.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM outbox_event)`).Scan(&orders, &events); err != nil {
		t.Fatal(err)
	}
	if orders != 2 || events != 1 {
		t.Fatalf("orders=%d events=%d, want 2 and 1: the duplicate's transaction must commit its other writes", orders, events)
	}
}

func TestPublishManyDuplicatesInsideBatchAndStored(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	var stored outbox.Published
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) (err error) {
		stored, err = outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", DispatchKey: "old"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var res []outbox.Published
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) (err error) {
		res, err = outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "a.b.c", DispatchKey: "new"},
			{Type: "a.b.c"},
			{Type: "a.b.c", DispatchKey: "old"},
			{Type: "a.b.c", DispatchKey: "new"},
			{Type: "a.b.c"},
		})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if res[0].Duplicate || res[1].Duplicate || res[4].Duplicate {
		t.Fatalf("unexpected duplicates: %+v", res)
	}
	if !res[2].Duplicate || res[2].ID != stored.ID {
		t.Fatalf("res[2] = %+v, want duplicate of %d", res[2], stored.ID)
	}
	if !res[3].Duplicate || res[3].ID != res[0].ID {
		t.Fatalf("res[3] = %+v, want duplicate of %d", res[3], res[0].ID)
	}
	if res[1].ID == res[4].ID || res[0].ID == res[1].ID {
		t.Fatalf("ids not distinct: %+v", res)
	}
	if n := countEvents(t, s.Pool); n != 4 {
		t.Fatalf("%d events, want 4", n)
	}
}

func TestPublishConcurrentSameKey(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	const n = 8
	ids := make([]int64, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
				res, err := outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", DispatchKey: "same"})
				ids[i] = res.ID
				return err
			})
			if err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for _, id := range ids {
		if id != ids[0] || id == 0 {
			t.Fatalf("ids = %v, want all equal", ids)
		}
	}
	if c := countEvents(t, s.Pool); c != 1 {
		t.Fatalf("%d events, want 1", c)
	}
}

func TestPublishMany1000(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	events := make([]outbox.Event, 1000)
	for i := range events {
		events[i] = outbox.Event{Type: "search.index.updated", Payload: json.RawMessage(fmt.Sprintf(`{"i": %d}`, i)), DispatchKey: fmt.Sprintf("k%d", i)}
	}
	var res []outbox.Published
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) (err error) {
		res, err = outbox.PublishMany(ctx, tx, events)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if len(res) != 1000 {
		t.Fatalf("%d results", len(res))
	}
	// Each result belongs to its own input position.
	rows, err := s.Pool.Query(ctx, `SELECT id, payload->>'i', dispatch_key FROM outbox_event`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[int64]string{}
	for rows.Next() {
		var id int64
		var i, key string
		if err := rows.Scan(&id, &i, &key); err != nil {
			t.Fatal(err)
		}
		if key != "k"+i {
			t.Fatalf("row %d: payload i=%s key=%s", id, i, key)
		}
		got[id] = i
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	for i, r := range res {
		if got[r.ID] != fmt.Sprint(i) {
			t.Fatalf("result %d has id %d whose payload is %q", i, r.ID, got[r.ID])
		}
	}
}

// TestSQLPublish covers outbox_publish, the producers' path from any language.
func TestSQLPublish(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)

	var id1, id2 int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('mail.user.welcome', '{"to": "a@b.c"}', 't1', 'welcome:1')`).Scan(&id1); err != nil {
		t.Fatal(err)
	}
	// A duplicate inside a larger transaction returns the id and does not abort it.
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, `SELECT outbox_publish('mail.user.welcome', '{}', 't1', 'welcome:1')`).Scan(&id2); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT outbox_publish('mail.user.other', '{}')`); err != nil {
		t.Fatalf("transaction aborted after a duplicate: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if id1 != id2 {
		t.Fatalf("duplicate returned %d, want %d", id2, id1)
	}

	bad := []struct{ args, want string }{
		{`'Mail.user.welcome', '{}'`, "event_type"},
		{`'mail.welcome', '{}'`, "three dot-separated"},
		{`NULL, '{}'`, "event_type is required"},
		{`'mail.user.welcome', NULL`, "payload is required"},
		{`'mail.user.welcome', '{}', repeat('t', 129)`, "tenant_id must be 1 to 128 bytes"},
		{`'mail.user.welcome', '{}', NULL, repeat('k', 257)`, "dispatch_key must be 1 to 256 bytes"},
		{`'mail.user.welcome', jsonb_build_object('x', repeat('y', 1048576))`, "limit is 1048576"},
		{`'mail.user.welcome', '{"a": "\u0000"}'`, `payload contains \u0000`},
		{`'mail.user.welcome', '{"a":'`, "payload is not valid JSON"},
	}
	for _, b := range bad {
		_, err := s.Pool.Exec(ctx, `SELECT outbox_publish(`+b.args+`)`)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || !strings.Contains(pgErr.Message, b.want) {
			t.Errorf("outbox_publish(%s): err = %v, want %q", b.args, err, b.want)
		}
	}
	// Plain INSERTs are held to the same rules by CHECK constraints.
	_, err = s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload) VALUES ('Bad.Type', '{}')`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.ConstraintName != "outbox_event_type_format" {
		t.Errorf("plain INSERT of a bad type: err = %v, want outbox_event_type_format", err)
	}
	var n int
	if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Fatalf("%d events, want 2", n)
	}
}

func TestValidateTypeMatchesDatabase(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	cases := []string{"a.b.c", "a-b.c-d.e-f", "plugin.hook.workflow.executed", "a.b", "A.b.c", "a..c", "a.b.c.", "-a.b.c", "a.b-.c", "1.2.3", "ä.b.c", "a.b.c d"}
	for _, c := range cases {
		goOK := outbox.ValidateType(c) == nil
		var dbOK bool
		if err := s.Pool.QueryRow(ctx, `SELECT $1 ~ '^[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*){2,}$'`, c).Scan(&dbOK); err != nil {
			t.Fatal(err)
		}
		if goOK != dbOK {
			t.Errorf("%q: Go says %v, the database pattern says %v", c, goOK, dbOK)
		}
	}
}

// TestPayloadEdgesThatJsonbStores: what validation accepts at the edges of
// jsonb's rules, Postgres stores.
func TestPayloadEdgesThatJsonbStores(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	for _, p := range []string{`"\ud83d\ude00"`, `"\\u0000"`, `"\\\\\ud83d\udE00"`, `1e131071`, `-1.5e131071`, `1e-16383`, `0e999999`, `0.1e131072`, `{"a":[1,2,{"b":"ü"}]}`} {
		if err := outbox.ValidatePayload(json.RawMessage(p)); err != nil {
			t.Errorf("%s: %v", p, err)
			continue
		}
		tx, err := s.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", Payload: json.RawMessage(p)}); err != nil {
			t.Errorf("%s accepted by validation but not stored: %v", p, err)
		}
		_ = tx.Rollback(ctx)
	}
}

// TestPayloadTextExpansionIsBounded: a short payload whose numbers print as
// hundreds of kilobytes of digits is refused by validation, not by the
// table's CHECK (which would abort the producer's transaction).
func TestPayloadTextExpansionIsBounded(t *testing.T) {
	t.Parallel()
	big := "[" + strings.Repeat("1e131071,", 16) + "1e131071]"
	err := outbox.ValidatePayload(json.RawMessage(big))
	if err == nil || !strings.Contains(err.Error(), "as Postgres prints it") {
		t.Fatalf("err = %v", err)
	}
	// Seven such numbers (~917 KB of digits) fit, and Postgres agrees.
	fits := "[" + strings.Repeat("1e131071,", 6) + "1e131071]"
	if err := outbox.ValidatePayload(json.RawMessage(fits)); err != nil {
		t.Fatalf("%v", err)
	}
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	var n int
	if err := s.Pool.QueryRow(ctx, `SELECT octet_length($1::jsonb::text)`, fits).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n > outbox.MaxPayloadBytes {
		t.Fatalf("accepted payload prints as %d bytes", n)
	}
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", Payload: json.RawMessage(fits)})
		return err
	}); err != nil {
		t.Fatal(err)
	}
}
