package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

// nestedArrays is [[[...]]] nested n levels deep.
func nestedArrays(n int) string {
	return strings.Repeat("[", n) + strings.Repeat("]", n)
}

// nestedObjects is {"a":{"a":...{"a":1}}} nested n levels deep.
func nestedObjects(n int) string {
	return strings.Repeat(`{"a":`, n) + "1" + strings.Repeat("}", n)
}

// publishPaths runs a payload through the three producer paths, each in a
// transaction of its own that is rolled back, and returns each path's error.
func publishPaths(t *testing.T, ctx context.Context, pool *pgxpool.Pool, payload string) (insert, sqlFn, goPub error) {
	t.Helper()
	run := func(f func(tx pgx.Tx) error) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		return f(tx)
	}
	insert = run(func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO outbox_event (event_type, payload) VALUES ('a.b.c', $1::text::jsonb)`, payload)
		return err
	})
	sqlFn = run(func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `SELECT outbox_publish('a.b.c', $1::text::jsonb)`, payload)
		return err
	})
	goPub = run(func(tx pgx.Tx) error {
		_, err := outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", Payload: json.RawMessage(payload)})
		return err
	})
	return insert, sqlFn, goPub
}

// wantRefused checks that err is a 22023 from the database, or a Payload
// ValidationError from Go, whose message names the payload and contains rule.
func wantRefused(t *testing.T, path string, err error, rule string) {
	t.Helper()
	var verr *outbox.ValidationError
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &verr):
		if verr.Field != "Payload" || !strings.Contains(verr.Rule, rule) {
			t.Errorf("%s: %v, want field Payload and %q", path, err, rule)
		}
	case errors.As(err, &pgErr):
		if pgErr.Code != "22023" || !strings.Contains(pgErr.Message, "payload") || !strings.Contains(pgErr.Message, rule) {
			t.Errorf("%s: %s %s, want 22023 naming payload and %q", path, pgErr.Code, pgErr.Message, rule)
		}
	default:
		t.Errorf("%s: err = %v, want a refusal naming payload and %q", path, err, rule)
	}
}

// TestDeepPayloadRefusedByEveryPath: a payload nested 10,001 levels deep
// (which Postgres' jsonb accepts and encoding/json refuses) is refused by a
// plain INSERT, by outbox_publish and by Publish, each naming the payload
// and the depth rule; so is one level past the limit.
func TestDeepPayloadRefusedByEveryPath(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	for _, p := range []string{nestedArrays(10001), nestedArrays(outbox.MaxPayloadDepth + 1), nestedObjects(outbox.MaxPayloadDepth + 1)} {
		insert, sqlFn, goPub := publishPaths(t, ctx, s.Pool, p)
		wantRefused(t, "plain INSERT", insert, "the limit is 1000")
		wantRefused(t, "outbox_publish", sqlFn, "the limit is 1000")
		wantRefused(t, "Publish", goPub, "the limit is 1000")
		var pgErr *pgconn.PgError
		if errors.As(insert, &pgErr) && pgErr.ColumnName != "payload" {
			t.Errorf("plain INSERT: column %q, want payload", pgErr.ColumnName)
		}
	}
	if err := outbox.ValidatePayload(json.RawMessage(nestedArrays(10001))); err == nil || !strings.Contains(err.Error(), "is nested 10001 levels deep, the limit is 1000") {
		t.Errorf("ValidatePayload(10,001 deep) = %v", err)
	}
	if n := countEvents(t, s.Pool); n != 0 {
		t.Fatalf("%d events stored", n)
	}
}

// TestPayloadAtDepthLimitIsAcceptedAndDecodable: depth 1000 is accepted by
// every path, and the stored bytes wrapped in the River job args decode
// with encoding/json (the reason for the limit).
func TestPayloadAtDepthLimitIsAcceptedAndDecodable(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	for _, p := range []string{nestedArrays(outbox.MaxPayloadDepth), nestedObjects(outbox.MaxPayloadDepth)} {
		insert, sqlFn, goPub := publishPaths(t, ctx, s.Pool, p)
		if insert != nil || sqlFn != nil || goPub != nil {
			t.Fatalf("depth %d refused: INSERT %v, outbox_publish %v, Publish %v", outbox.MaxPayloadDepth, insert, sqlFn, goPub)
		}
		var stored []byte
		if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			res, err := outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", Payload: json.RawMessage(p)})
			if err != nil {
				return err
			}
			return tx.QueryRow(ctx, `SELECT payload::text FROM outbox_event WHERE id = $1`, res.ID).Scan(&stored)
		}); err != nil {
			t.Fatal(err)
		}
		args, err := json.Marshal(outboxriver.EventArgs{EventID: 1, EventType: "a.b.c", Payload: stored})
		if err != nil {
			t.Fatalf("marshal args: %v", err)
		}
		var back outboxriver.EventArgs
		if err := json.Unmarshal(args, &back); err != nil {
			t.Fatalf("job args carrying a payload at depth %d do not decode: %v", outbox.MaxPayloadDepth, err)
		}
		var v any
		if err := json.Unmarshal(back.Payload, &v); err != nil {
			t.Fatalf("payload at depth %d does not decode: %v", outbox.MaxPayloadDepth, err)
		}
	}
}

// payloadRuleCases are payloads on both sides of the size and depth rules,
// where the Go estimate of the printed size is exact (compact input, no
// escapes that print shorter, no duplicate keys).
var payloadRuleCases = []struct {
	name    string
	payload string
	ok      bool
}{
	{"empty object", `{}`, true},
	{"scalar", `1`, true},
	{"depth 1000 arrays", nestedArrays(1000), true},
	{"depth 1001 arrays", nestedArrays(1001), false},
	{"depth 1000 objects", nestedObjects(1000), true},
	{"depth 1001 objects", nestedObjects(1001), false},
	{"depth 1001 ending in an empty array", strings.Repeat(`{"a":`, 1000) + "[]" + strings.Repeat("}", 1000), false},
	{"depth 1000 with siblings", `[1,{"b":` + nestedArrays(998) + `},"x"]`, true},
	{"depth 1001 in the last sibling", `[1,{"b":2},` + nestedArrays(1000) + `]`, false},
	{"brackets inside strings", `["` + strings.Repeat("[", 2000) + `\"` + strings.Repeat("{", 2000) + `"]`, true},
	{"1 MiB string", `"` + strings.Repeat("x", outbox.MaxPayloadBytes-2) + `"`, true},
	{"1 MiB + 1 string", `"` + strings.Repeat("x", outbox.MaxPayloadBytes-1) + `"`, false},
	{"1 MiB printed with separators", `[` + strings.Repeat(`1,`, 349524) + `11]`, true},
	{"1 MiB + 1 printed with separators", `[` + strings.Repeat(`1,`, 349524) + `111]`, false},
}

// TestPayloadRuleGoAndSQLAgree runs each case through ValidatePayload and
// through the database's rule (outbox_payload_problem, which the trigger and
// outbox_publish use): both must accept or both refuse.
func TestPayloadRuleGoAndSQLAgree(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	for _, c := range payloadRuleCases {
		goErr := outbox.ValidatePayload(json.RawMessage(c.payload))
		var problem *string
		if err := s.Pool.QueryRow(ctx, `SELECT outbox_payload_problem($1::text::jsonb)`, c.payload).Scan(&problem); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if (goErr == nil) != c.ok || (problem == nil) != c.ok {
			p := "<nil>"
			if problem != nil {
				p = *problem
			}
			t.Errorf("%s: Go says %v, SQL says %s; want ok=%v", c.name, goErr, p, c.ok)
		}
	}
}

// TestStoredDeepRowCanStillBeUpdated: the rule is a trigger on INSERT and
// on UPDATE OF payload, not a CHECK, so a row stored before the rule (here:
// with triggers off) can still be marked failed by the dispatcher,
// while rewriting its payload is held to the rule.
func TestStoredDeepRowCanStillBeUpdated(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	var id int64
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		// Replica mode skips ordinary triggers (superuser only).
		if _, err := tx.Exec(ctx, `SET LOCAL session_replication_role = replica`); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload) VALUES ('a.b.c', $1::text::jsonb) RETURNING id`, nestedArrays(10001)).Scan(&id)
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed', last_error = 'payload too deep' WHERE id = $1`, id); err != nil {
		t.Fatalf("marking a stored deep row failed: %v", err)
	}
	_, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET payload = payload WHERE id = $1`, id)
	wantRefused(t, "UPDATE OF payload", err, "the limit is 1000")
}
