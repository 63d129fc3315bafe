package outbox_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/jsonlimit"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// referenceType is an independent statement of the event-type rule: at
// least three dot-separated segments of lowercase [a-z0-9] with inner single
// dashes, at most 255 bytes.
func referenceType(t string) bool {
	if len(t) == 0 || len(t) > outbox.MaxTypeBytes {
		return false
	}
	segs := strings.Split(t, ".")
	if len(segs) < 3 {
		return false
	}
	for _, s := range segs {
		if s == "" || s[0] == '-' || s[len(s)-1] == '-' || strings.Contains(s, "--") {
			return false
		}
		for i := 0; i < len(s); i++ {
			c := s[i]
			if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
				return false
			}
		}
	}
	return true
}

// FuzzValidateType checks ValidateType against the reference rule: it
// never panics, accepts exactly what the rule accepts, and its message
// stays short however long the input.
func FuzzValidateType(f *testing.F) {
	for _, s := range []string{"billing.invoice.paid", "plugin.capability-use.granted", "a.b", "A.b.c", "a..c", "a.b.c.", "-a.b.c", "a.b-.c", "ä.b.c", "a.b.c\x00", strings.Repeat("a.", 128) + "a",
		// The length limit, in bytes, at and past the boundary.
		strings.Repeat("a", outbox.MaxTypeBytes-4) + ".b.c", strings.Repeat("a", outbox.MaxTypeBytes-3) + ".b.c", strings.Repeat("a", outbox.MaxTypeBytes-5) + ".b.é"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, typ string) {
		err := outbox.ValidateType(typ)
		if want := referenceType(typ); (err == nil) != want {
			t.Fatalf("ValidateType(%q) = %v, the rule says valid=%v", typ, err, want)
		}
		if err != nil && len(err.Error()) > 400 {
			t.Fatalf("message of %d bytes for a %d-byte type", len(err.Error()), len(typ))
		}
	})
}

// hasNUL reports whether a decoded JSON value holds a NUL character in any
// string or key.
func hasNUL(v any) bool {
	switch x := v.(type) {
	case string:
		return strings.ContainsRune(x, 0)
	case []any:
		for _, e := range x {
			if hasNUL(e) {
				return true
			}
		}
	case map[string]any:
		for k, e := range x {
			if strings.ContainsRune(k, 0) || hasNUL(e) {
				return true
			}
		}
	}
	return false
}

// surrogateEscape over-approximates a \uD800-\uDFFF escape (it also hits an
// escaped backslash followed by "ud800"), which Postgres refuses unpaired.
var surrogateEscape = regexp.MustCompile(`(?i)\\ud[89a-f]`)

// decode decodes one JSON value, keeping numbers as text.
func decode(p []byte) (any, bool) {
	d := json.NewDecoder(bytes.NewReader(p))
	d.UseNumber()
	var v any
	return v, d.Decode(&v) == nil
}

// plainNumbers reports whether every number is short and without exponent
// (Postgres' numeric refuses 1e999999, which Go accepts).
func plainNumbers(v any) bool {
	switch x := v.(type) {
	case json.Number:
		return len(x) <= 100 && !strings.ContainsAny(string(x), "eE")
	case []any:
		for _, e := range x {
			if !plainNumbers(e) {
				return false
			}
		}
	case map[string]any:
		for _, e := range x {
			if !plainNumbers(e) {
				return false
			}
		}
	}
	return true
}

// FuzzValidatePayload checks ValidatePayload against a decode. It must
// refuse whatever is not valid JSON, is too large, is nested deeper than
// MaxPayloadDepth or holds a NUL in a string or key (Postgres' jsonb cannot
// store \u0000), and it must accept plain
// JSON: valid UTF-8, no surrogate escapes, numbers without exponents. (In
// between, refusing more is allowed: see TestPayloadSeedsAcceptedAreStorable.)
func FuzzValidatePayload(f *testing.F) {
	for _, s := range []string{`{}`, `{"a":1}`, `[1,"x",null,true]`, `"x"`, `{"a":"\u0000"}`, `{"a":"\\u0000"}`, `{"\u0000":1}`, `{"a":"\\\u0000"}`, `{`, `{} {}`, ``, `{"a":"\ud800"}`, `1e999999`, strings.Repeat("[", 1000) + strings.Repeat("]", 1000), strings.Repeat("[", 1001) + strings.Repeat("]", 1001),
		// The size limit at and past the boundary: a string prints as given,
		// a separator gains a space in Postgres' text form.
		`"` + strings.Repeat("a", outbox.MaxPayloadBytes-2) + `"`, `"` + strings.Repeat("a", outbox.MaxPayloadBytes-1) + `"`,
		`["` + strings.Repeat("a", outbox.MaxPayloadBytes/2-4) + `","` + strings.Repeat("a", outbox.MaxPayloadBytes/2-4) + `"]`,
		// Exactly the limit as sent, one byte over it as Postgres prints it
		// (found by the fuzzer on 2026-12-03).
		`["` + strings.Repeat("a", outbox.MaxPayloadBytes/2-4) + `","` + strings.Repeat("a", outbox.MaxPayloadBytes/2-3) + `"]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		err := outbox.ValidatePayload(p)
		v, decodes := decode(p)
		valid := len(p) <= outbox.MaxPayloadBytes && json.Valid(p) && decodes && !hasNUL(v) && jsonlimit.Depth(p) <= outbox.MaxPayloadDepth
		if err == nil && !valid {
			t.Fatalf("ValidatePayload accepted %q", p)
		}
		// Postgres prints a space after every ',' and ':' (and never prints
		// a string or number longer than it was sent), so JSON that must
		// be accepted is within the limit with a byte more for each. A ','
		// or ':' inside a string counts too: the oracle demands acceptance
		// of a little less than it could, never of more.
		printsWithin := len(p)+bytes.Count(p, []byte(","))+bytes.Count(p, []byte(":")) <= outbox.MaxPayloadBytes
		if err != nil && valid && printsWithin && utf8.Valid(p) && !surrogateEscape.Match(p) && plainNumbers(v) {
			t.Fatalf("ValidatePayload refused plain JSON %q: %v", p, err)
		}
		if err == nil {
			if _, err := outbox.ValidateEvent(outbox.Event{Type: "a.b.c", Payload: p}); err != nil {
				t.Fatalf("ValidatePayload accepted %q but ValidateEvent refused it: %v", p, err)
			}
		}
	})
}

// TestPayloadSeedsAcceptedAreStorable runs every checked-in seed of
// FuzzValidatePayload through Publish against Postgres: each must be either
// refused by validation (a ValidationError, the transaction still usable)
// or stored. A payload that validation accepts but jsonb refuses aborts
// the producer's transaction, which the contract forbids.
func TestPayloadSeedsAcceptedAreStorable(t *testing.T) {
	t.Parallel()
	seeds, err := filepath.Glob("testdata/fuzz/FuzzValidatePayload/*")
	if err != nil || len(seeds) == 0 {
		t.Fatalf("no seeds in testdata/fuzz/FuzzValidatePayload (%v)", err)
	}
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	for _, path := range seeds {
		p, err := readSeed(path)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		tx, err := s.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", Payload: p})
		if err != nil && !errors.Is(err, outbox.ErrInvalidEvent) {
			t.Errorf("%s: payload %.80q passed validation but the database refused it: %v", filepath.Base(path), p, err)
		}
		var one int
		if qerr := tx.QueryRow(ctx, `SELECT 1`).Scan(&one); qerr != nil {
			t.Errorf("%s: the producer's transaction is unusable after publishing %.80q: %v", filepath.Base(path), p, qerr)
		}
		_ = tx.Rollback(ctx)
	}
}

// readSeed reads a one-value "go test fuzz v1" corpus file holding []byte.
func readSeed(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	lines := strings.SplitN(strings.TrimSpace(string(b)), "\n", 2)
	if len(lines) != 2 || lines[0] != "go test fuzz v1" {
		return nil, errors.New("not a go test fuzz v1 file")
	}
	v := strings.TrimSpace(lines[1])
	inner, ok := strings.CutPrefix(v, "[]byte(")
	if !ok || !strings.HasSuffix(inner, ")") {
		return nil, errors.New("not a []byte value")
	}
	s, err := strconv.Unquote(strings.TrimSuffix(inner, ")"))
	return []byte(s), err
}
