package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// The validation rules of an event are written in Go (event.go: the type
// regexp, MaxTypeBytes, MaxTenantIDBytes, MaxDispatchKeyBytes,
// MaxPayloadBytes, MaxPayloadDepth) and again in the database: the CHECK
// constraints of outbox_event, the payload rule (outbox_payload_problem) and
// the plpgsql of outbox_publish and outbox_publish_many; the fuzz target
// keeps a reference of its own (referenceType). The Go constants and
// regexp are the source. These tests read the copies from a migrated schema
// (whatever migration last redefined them) and run every producer path on
// cases built from the Go constants, so that a copy cannot drift silently.

// sqlTypeRegexp matches a regexp applied to an event type in SQL text:
// `event_type ~ '...'`, `t.event_type !~ '...'`.
var sqlTypeRegexp = regexp.MustCompile(`event_type\s*!?~\s*'((?:[^']|'')*)'`)

// sqlLength matches a byte-length bound on a column in SQL text:
// `octet_length(tenant_id) <= 128`, `octet_length(t.event_type) > 255`,
// `octet_length(bad.dispatch_key) NOT BETWEEN 1 AND 256`,
// `octet_length(payload::text) > 1048576`.
var sqlLength = regexp.MustCompile(`octet_length\((?:\w+\.)?(event_type|tenant_id|dispatch_key|payload::text)\)\s*(?:<=|>|(?:NOT\s+)?BETWEEN\s+1\s+AND)\s*(\d+)`)

// sqlDepth matches the depth test of the payload rule: `$.**{1000}`.
var sqlDepth = regexp.MustCompile(`\$\.\*\*\{(\d+)\}`)

func TestValidationRuleCopiesMatchGo(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)

	want := map[string]int{
		"event_type":    outbox.MaxTypeBytes,
		"tenant_id":     outbox.MaxTenantIDBytes,
		"dispatch_key":  outbox.MaxDispatchKeyBytes,
		"payload::text": outbox.MaxPayloadBytes,
	}
	goPattern := outbox.TypePattern.String()

	// check compares the copies of the rules in one definition with Go's and
	// returns how many it found.
	check := func(what, def string) (patterns, lengths, depths int) {
		for _, m := range sqlTypeRegexp.FindAllStringSubmatch(def, -1) {
			patterns++
			if got := strings.ReplaceAll(m[1], "''", "'"); got != goPattern {
				t.Errorf("%s: event type regexp %q, Go's is %q", what, got, goPattern)
			}
		}
		for _, m := range sqlLength.FindAllStringSubmatch(def, -1) {
			n, _ := strconv.Atoi(m[2])
			if m[1] == "payload::text" && strings.HasPrefix(what, "CHECK") {
				// Migration 001's backstop, kept at twice the rule (the
				// trigger enforces the rule: see migration 005).
				if n != 2*outbox.MaxPayloadBytes {
					t.Errorf("%s: payload backstop %d bytes, want 2 x MaxPayloadBytes = %d", what, n, 2*outbox.MaxPayloadBytes)
				}
				continue
			}
			lengths++
			if n != want[m[1]] {
				t.Errorf("%s: %s limited to %d bytes, Go's limit is %d", what, m[1], n, want[m[1]])
			}
		}
		for _, m := range sqlDepth.FindAllStringSubmatch(def, -1) {
			depths++
			// The path asks for a container at level N below the root
			// (level 0, depth 1): there is one when the depth exceeds N.
			if n, _ := strconv.Atoi(m[1]); n != outbox.MaxPayloadDepth {
				t.Errorf("%s: payload depth limit %d, Go's MaxPayloadDepth is %d", what, n, outbox.MaxPayloadDepth)
			}
		}
		return patterns, lengths, depths
	}

	// The CHECK constraints of outbox_event.
	rows, err := s.Pool.Query(ctx, `
SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint
WHERE conrelid = 'outbox_event'::regclass AND contype = 'c' ORDER BY conname`)
	if err != nil {
		t.Fatal(err)
	}
	checks, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Name, Def string }])
	if err != nil {
		t.Fatal(err)
	}
	var cp, cl int
	for _, c := range checks {
		p, l, _ := check("CHECK "+c.Name, c.Def)
		cp, cl = cp+p, cl+l
	}
	if cp != 1 || cl != 3 {
		t.Errorf("found %d type regexps and %d length limits in the CHECK constraints of outbox_event, want 1 and 3 (type, tenant, key): %+v", cp, cl, checks)
	}

	// The functions that restate the rules.
	for _, fn := range []struct {
		name                      string
		patterns, lengths, depths int // at least
	}{
		{"outbox_publish", 1, 3, 0},
		{"outbox_publish_many", 1, 3, 0},
		{"outbox_payload_problem", 0, 1, 1},
	} {
		rows, err := s.Pool.Query(ctx, `
SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p
WHERE p.proname = $1 AND p.pronamespace = current_schema()::regnamespace`, fn.name)
		if err != nil {
			t.Fatal(err)
		}
		defs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Sig, Def string }])
		if err != nil {
			t.Fatal(err)
		}
		var p, l, d int
		for _, def := range defs {
			dp, dl, dd := check(def.Sig, def.Def)
			p, l, d = p+dp, l+dl, d+dd
		}
		if len(defs) == 0 || p < fn.patterns || l < fn.lengths || d < fn.depths {
			t.Errorf("%s: found %d definitions with %d type regexps, %d length limits and %d depth limits; want at least %d, %d and %d (did its text change shape? update this test)",
				fn.name, len(defs), p, l, d, fn.patterns, fn.lengths, fn.depths)
		}
	}
}

// ruleCase is one event on or next to a boundary of the rules.
type ruleCase struct {
	name             string
	typ, tenant, key string // "" is NULL for tenant and key
	payload          string // "" is {}
}

func ruleCases() []ruleCase {
	long := func(total int, suffix string) string { return strings.Repeat("a", total-len(suffix)) + suffix }
	str := func(total int) string { return `"` + strings.Repeat("x", total-2) + `"` } // prints as given
	return []ruleCase{
		{name: "minimal", typ: "a.b.c"},
		{name: "type at the byte limit", typ: long(outbox.MaxTypeBytes, ".b.c")},
		{name: "type one byte past", typ: long(outbox.MaxTypeBytes+1, ".b.c")},
		{name: "type past in bytes, not in characters", typ: long(outbox.MaxTypeBytes-1, ".b.") + "é"},
		{name: "two segments", typ: "a.b"},
		{name: "inner dashes", typ: "a-b.c-d-e.f0-9"},
		{name: "leading dash", typ: "-a.b.c"},
		{name: "trailing dash", typ: "a.b.c-"},
		{name: "double dash", typ: "a.b--c.d"},
		{name: "empty segment", typ: "a..c"},
		{name: "trailing dot", typ: "a.b.c."},
		{name: "uppercase", typ: "A.b.c"},
		{name: "underscore", typ: "a.b_c.d"},
		{name: "newline at the end", typ: "a.b.c\n"},
		{name: "non-ASCII letter", typ: "ä.b.c"},
		{name: "Kelvin sign", typ: "\u212a.b.c"},
		{name: "fullwidth digit", typ: "a.b.\uff11"},
		{name: "tenant at the byte limit", typ: "a.b.c", tenant: strings.Repeat("é", outbox.MaxTenantIDBytes/2)},
		{name: "tenant one byte past", typ: "a.b.c", tenant: strings.Repeat("t", outbox.MaxTenantIDBytes+1)},
		{name: "tenant past in bytes, not in characters", typ: "a.b.c", tenant: strings.Repeat("€", outbox.MaxTenantIDBytes/3+1)},
		{name: "key at the byte limit", typ: "a.b.c", key: strings.Repeat("k", outbox.MaxDispatchKeyBytes)},
		{name: "key one byte past", typ: "a.b.c", key: strings.Repeat("k", outbox.MaxDispatchKeyBytes+1)},
		{name: "payload at the byte limit", typ: "a.b.c", payload: str(outbox.MaxPayloadBytes)},
		{name: "payload one byte past", typ: "a.b.c", payload: str(outbox.MaxPayloadBytes + 1)},
		{name: "payload at the depth limit", typ: "a.b.c", payload: nestedArrays(outbox.MaxPayloadDepth)},
		{name: "payload one level past", typ: "a.b.c", payload: nestedArrays(outbox.MaxPayloadDepth + 1)},
		{name: "objects at the depth limit", typ: "a.b.c", payload: nestedObjects(outbox.MaxPayloadDepth - 1)},
		{name: "objects one level past", typ: "a.b.c", payload: nestedObjects(outbox.MaxPayloadDepth)},
	}
}

// TestValidationRulesAgreeOnBoundaries runs every case through Go's
// ValidateEvent, the fuzz reference, and each database path (a plain
// INSERT, outbox_publish with a jsonb and with a text payload,
// outbox_publish_many): all must accept it, or all refuse it.
func TestValidationRulesAgreeOnBoundaries(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 120*time.Second)
	nullable := func(v string) *string {
		if v == "" {
			return nil
		}
		return &v
	}
	paths := []struct {
		name string
		sql  string
	}{
		{"INSERT", `INSERT INTO outbox_event (event_type, payload, tenant_id, dispatch_key) VALUES ($1, $2::text::jsonb, $3, $4)`},
		{"outbox_publish(jsonb)", `SELECT outbox_publish(event_type => $1, payload => $2::text::jsonb, tenant_id => $3, dispatch_key => $4)`},
		{"outbox_publish(text)", `SELECT outbox_publish(event_type => $1, payload => $2::text, tenant_id => $3, dispatch_key => $4)`},
		{"outbox_publish_many", `SELECT * FROM outbox_publish_many(ARRAY[$1::text], ARRAY[$2::text::jsonb], ARRAY[$3::text], ARRAY[$4::text])`},
	}
	for _, c := range ruleCases() {
		payload := c.payload
		if payload == "" {
			payload = "{}"
		}
		_, goErr := outbox.ValidateEvent(outbox.Event{Type: c.typ, TenantID: c.tenant, DispatchKey: c.key, Payload: []byte(payload)})
		if goErr != nil && !errors.Is(goErr, outbox.ErrInvalidEvent) {
			t.Fatalf("%s: ValidateEvent: %v", c.name, goErr)
		}
		valid := goErr == nil
		if c.tenant == "" && c.key == "" && c.payload == "" && referenceType(c.typ) != valid {
			t.Errorf("%s: the fuzz reference says valid=%v, ValidateEvent %v", c.name, referenceType(c.typ), goErr)
		}
		for _, p := range paths {
			err := inRolledBackTx(ctx, s.Pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, p.sql, c.typ, payload, nullable(c.tenant), nullable(c.key))
				return err
			})
			if err != nil {
				var pgErr *pgconn.PgError
				if !errors.As(err, &pgErr) || (pgErr.Code != "22023" && pgErr.Code != "23514") {
					t.Fatalf("%s via %s: %v, want success or a refusal (22023, 23514)", c.name, p.name, err)
				}
			}
			if (err == nil) != valid {
				t.Errorf("%s via %s: database error %v, Go's ValidateEvent %v: the copies of the rule disagree", c.name, p.name, err, goErr)
			}
		}
	}
}

func inRolledBackTx(ctx context.Context, pool *pgxpool.Pool, f func(pgx.Tx) error) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	return f(tx)
}
