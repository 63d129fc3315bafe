package outboxsql_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// wantInvalid checks that err is the 22023 refusal whose message holds want
// and, when column is set, that it names the column.
func wantInvalid(t *testing.T, what string, err error, want, column string) {
	t.Helper()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, want) || (column != "" && pgErr.ColumnName != column) {
		t.Errorf("%s: err = %v, want 22023 %q naming column %q", what, err, want, column)
	}
}

// TestPublishFunctionsCheckOrderingKeys: outbox_publish (both overloads)
// refuses an empty or 257-byte ordering_key with 22023 naming ordering_key
// and its rule, and outbox_publish_many refuses ordering_keys of another
// length than the batch and names the bad element's index; nothing is
// written. A key of 256 bytes is stored with a position.
func TestPublishFunctionsCheckOrderingKeys(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	long := strings.Repeat("k", 257)
	for _, payload := range []string{"'{}'::jsonb", "'{}'::text"} {
		for _, key := range []string{"", long} {
			_, err := s.Pool.Exec(ctx, `SELECT outbox_publish('order.item.added', `+payload+`, ordering_key => $1)`, key)
			wantInvalid(t, payload+" key of "+itoa(int64(len(key)))+" bytes", err, "ordering_key must be 1 to 256 bytes", "ordering_key")
		}
	}
	cases := []struct {
		keys []*string
		want string
	}{
		{sp("a"), "ordering_keys must have one element per event"},
		{sp("a", "b", "c"), "ordering_keys must have one element per event"},
		{sp("a", ""), "ordering_keys[2] must be 1 to 256 bytes"},
		{[]*string{nil, &long}, "ordering_keys[2] must be 1 to 256 bytes"},
	}
	for _, c := range cases {
		_, err := s.Pool.Exec(ctx, `SELECT * FROM outbox_publish_many('{order.item.added,order.item.added}', '{"{}","{}"}', ordering_keys => $1)`, c.keys)
		wantInvalid(t, "outbox_publish_many", err, c.want, "")
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event`); n != 0 {
		t.Fatalf("%d events written by refused calls", n)
	}
	var id int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('order.item.added', '{}'::jsonb, ordering_key => $1)`, long[:256]).Scan(&id); err != nil {
		t.Fatalf("a 256-byte key: %v", err)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE id = $1 AND ordering_position IS NOT NULL`, id); n != 1 {
		t.Fatalf("the event with a 256-byte key has no position")
	}
}

// TestPublishFunctionsKeepTheirPositionalCalls: the calls producers wrote
// before migration 011 (positional arguments, with and without the
// optional ones) still resolve and publish, and the ordering key can also
// be passed as the last positional argument.
func TestPublishFunctionsKeepTheirPositionalCalls(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	calls := map[string]int{
		`SELECT outbox_publish('order.item.added', '{}')`:                                                      1,
		`SELECT outbox_publish('order.item.added', '{"n": 1}'::jsonb, 'acme')`:                                 1,
		`SELECT outbox_publish('order.item.added', '{}'::text, 'acme', 'key-1')`:                               1,
		`SELECT outbox_publish('order.item.added', '{}'::jsonb, 'acme', 'key-2', NULL)`:                        1,
		`SELECT outbox_publish('order.item.added', '{}'::jsonb, NULL, NULL, now(), NULL)`:                      1,
		`SELECT outbox_publish('order.item.added', '{}'::jsonb, 'acme', NULL, NULL, NULL, 'k')`:                1,
		`SELECT * FROM outbox_publish_many('{order.item.added}', '{"{}"}')`:                                    1,
		`SELECT * FROM outbox_publish_many('{order.item.added,a.b.c}', '{"{}","{}"}', NULL, NULL)`:             2,
		`SELECT * FROM outbox_publish_many('{order.item.added}', '{"{}"}', '{acme}', '{key-3}', NULL, NULL)`:   1,
		`SELECT * FROM outbox_publish_many('{order.item.added}', '{"{}"}', '{acme}', NULL, NULL, NULL, '{k}')`: 1,
	}
	want := 0
	for q, n := range calls {
		rows, err := s.Pool.Query(ctx, q)
		if err != nil {
			t.Errorf("%s: %v", q, err)
			continue
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			t.Errorf("%s: %v", q, err)
			continue
		}
		want += n
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event`); n != want {
		t.Errorf("%d events stored, want %d", n, want)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE ordering_key = 'k' AND ordering_position IS NOT NULL`); n != 2 {
		t.Errorf("%d events with the positional key k and a position, want 2", n)
	}
}

// TestPlainInsertWithOrderingKey: a plain INSERT that sets ordering_key
// gets a position from the trigger (one it supplies itself is replaced),
// one without a key gets none, and the table's CHECKs refuse a position
// without a key and an empty key. The producer role may INSERT
// ordering_key (and gets its position through the definer trigger) but not
// ordering_position.
func TestPlainInsertWithOrderingKey(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	var keyed, plain int64
	var pos *int64
	if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, ordering_key, ordering_position) VALUES ('order.item.added', '{}', 'k', -7) RETURNING id, ordering_position`).Scan(&keyed, &pos); err != nil {
		t.Fatal(err)
	}
	if pos == nil || *pos <= 0 {
		t.Errorf("plain INSERT with a key: position %v, want one drawn by the trigger", pos)
	}
	if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload) VALUES ('order.item.added', '{}') RETURNING id, ordering_position`).Scan(&plain, &pos); err != nil || pos != nil {
		t.Errorf("plain INSERT without a key: position %v, err %v; want none", pos, err)
	}
	for q, constraint := range map[string]string{
		`INSERT INTO outbox_event (event_type, payload, ordering_position) VALUES ('order.item.added', '{}', 5)`: "outbox_event_ordering_position_set",
		`INSERT INTO outbox_event (event_type, payload, ordering_key) VALUES ('order.item.added', '{}', '')`:     "outbox_event_ordering_key_length",
		`UPDATE outbox_event SET ordering_position = 9 WHERE ordering_key IS NULL`:                               "outbox_event_ordering_position_set",
	} {
		_, err := s.Pool.Exec(ctx, q)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != constraint {
			t.Errorf("%s: err = %v, want a check violation of %s", q, err, constraint)
		}
	}

	p := pgtest.RolePool(t, s, "outbox_producer")
	var byProducer int64
	if err := p.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, tenant_id, ordering_key) VALUES ('order.item.added', '{}', 'acme', 'order-42') RETURNING id`).Scan(&byProducer); err != nil {
		t.Fatalf("plain INSERT of ordering_key as producer: %v", err)
	}
	if err := s.Pool.QueryRow(ctx, `SELECT ordering_position FROM outbox_event WHERE id = $1`, byProducer).Scan(&pos); err != nil || pos == nil {
		t.Errorf("the producer's keyed INSERT: position %v, err %v", pos, err)
	}
	var viaFunction int64
	if err := p.QueryRow(ctx, `SELECT outbox_publish('order.item.added', '{}'::jsonb, 'acme', ordering_key => 'order-42')`).Scan(&viaFunction); err != nil {
		t.Fatalf("outbox_publish with ordering_key as producer: %v", err)
	}
	for _, q := range []string{
		`INSERT INTO outbox_event (event_type, payload, ordering_key, ordering_position) VALUES ('order.item.added', '{}', 'k', 1)`,
		`SELECT ordering_position FROM outbox_event`,
		`SELECT ordering_key FROM outbox_event`,
		`SELECT nextval('outbox_ordering_position_seq')`,
		`SELECT * FROM outbox_ordering_key`,
		`SELECT * FROM outbox_unpark('producer', true, 'order-42', 'skip')`,
	} {
		if _, err := p.Exec(ctx, q); !isInsufficientPrivilege(err) {
			t.Errorf("%s as producer: err = %v, want permission denied", q, err)
		}
	}
	var p1, p2 int64
	if err := s.Pool.QueryRow(ctx, `SELECT (SELECT ordering_position FROM outbox_event WHERE id = $1), (SELECT ordering_position FROM outbox_event WHERE id = $2)`, byProducer, viaFunction).Scan(&p1, &p2); err != nil || p1 >= p2 {
		t.Errorf("positions of the producer's two events %d, %d (%v), want increasing", p1, p2, err)
	}
}
