package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/propagation"

	"github.com/outboxhq/outbox/internal/jsonlimit"
)

// Limits enforced by Publish, PublishMany, outbox_publish and the table's
// CHECK constraints.
const (
	// MaxTypeBytes is the longest event type.
	MaxTypeBytes = 255
	// MaxPayloadBytes is the largest payload, counted as the JSON text the
	// producer passes (Go) or as Postgres prints the jsonb (SQL).
	MaxPayloadBytes = 1 << 20
	// MaxTenantIDBytes is the longest tenant id.
	MaxTenantIDBytes = 128
	// MaxDispatchKeyBytes is the longest dispatch key.
	MaxDispatchKeyBytes = 256
	// MaxOrderingKeyBytes is the longest ordering key.
	MaxOrderingKeyBytes = 256
	// MaxPublishMany is the most events one PublishMany call takes.
	MaxPublishMany = 10000
	// MaxPayloadDepth is the deepest nesting of objects and arrays a payload
	// may have ({} and [] are depth 1). encoding/json refuses documents
	// nested deeper than 10,000 levels and the River job args that carry a
	// payload add one level, so this bound keeps every handed-off payload
	// decodable by any worker. The table's trigger and outbox_publish
	// enforce the same number.
	MaxPayloadDepth = jsonlimit.MaxDepth
	// MaxDelay is the furthest ahead an event's NotBefore may be: 365 days
	// (8760 hours). Publish checks it against this host's clock before the
	// round trip; outbox_publish and outbox_publish_many check it against
	// the database's now(), and theirs is the check that counts.
	MaxDelay = 8760 * time.Hour
)

// Trace context (migration 010). The column trace_context holds the W3C
// traceparent header value, alone or followed by one space and the
// tracestate header value. The rule is written in SQL too
// (outbox_trace_context_problem); rules_test.go checks that they agree.
const (
	// maxTraceStateBytes is the longest tracestate stored: W3C asks every
	// system to pass on at least 512 bytes and allows dropping the rest.
	maxTraceStateBytes = 512
	// maxTraceContextBytes is a 55-byte traceparent, a space and the
	// longest tracestate.
	maxTraceContextBytes = 55 + 1 + maxTraceStateBytes
)

// traceContextPattern is the shape of a stored trace context: a version 00
// traceparent (lowercase hex), then optionally a space and a tracestate of
// printable ASCII that neither starts nor ends with a space. The all-zero
// trace and parent ids are refused apart (traceContextProblem).
var traceContextPattern = regexp.MustCompile(`^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}( [!-~]([ -~]*[!-~])?)?$`)

// batchIndex finds the 1-based position that outbox_publish_many names in
// its errors (event_types[3]).
var batchIndex = regexp.MustCompile(`^outbox_publish_many: [a-z_]+\[(\d+)\]`)

// typePattern is the event type rule: at least three dot-separated segments
// of lowercase [a-z0-9] with inner single dashes. The same expression is in
// the table's CHECK constraint and in outbox_publish.
var typePattern = regexp.MustCompile(`^[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*){2,}$`)

// Event is one outbox event as a producer publishes it.
type Event struct {
	// Type is <domain>.<entity>.<verb>, e.g. "billing.invoice.paid": at least
	// three dot-separated segments of lowercase letters and digits with inner
	// dashes ("plugin.capability-use.granted"), at most 255 bytes. Routes
	// match it by prefix.
	Type string
	// Payload is the event body: valid JSON, at most MaxPayloadBytes, nested
	// at most MaxPayloadDepth levels, with no \u0000 escapes (Postgres' jsonb
	// cannot store them). Nil means {}.
	Payload json.RawMessage
	// TenantID optionally names the tenant; empty means none. At most 128 bytes.
	TenantID string
	// DispatchKey is an optional idempotency key of the producer (for example
	// "stripe:evt_123"), unique per tenant: a second event of the same
	// tenant (or, without a tenant, of the events without one) with a key
	// already stored is not written: Publish returns the first event's id
	// and Duplicate = true. Another tenant's key never suppresses an event.
	// Empty means none. At most 256 bytes. Deleting a done row (retention)
	// releases its key.
	DispatchKey string
	// NotBefore delays the event: it is not handed off before this time.
	// The zero value means now. The database stamps the event's
	// scheduled_at as the later of its own now() and NotBefore, so a time
	// in the past also means now, and the database's clock, not this
	// host's, decides when the event is due. At most MaxDelay ahead. A
	// duplicate DispatchKey returns the stored event unchanged, due time
	// included.
	NotBefore time.Time
	// OrderingKey puts the event in order with the other events of the
	// same tenant and key (for example "order:42"): for each River queue
	// they are routed to, their jobs are worked one at a time, in the order
	// the events were published (publish order within a transaction,
	// commit order across transactions), each job starting only after the
	// one before it is finalized. Transactions that publish to the same key
	// run their publishes one after another: the second waits for the
	// first to commit or roll back. Empty means none (the event is not
	// ordered). At most 256 bytes. See docs/ordering.md. Needs migration 011.
	OrderingKey string
}

// Published is the outcome of publishing one event.
type Published struct {
	// ID is the event id (also the receivers' idempotency key).
	ID int64
	// Duplicate is true when DispatchKey was already stored: nothing was
	// written and ID is the existing event's id.
	Duplicate bool
}

// ErrInvalidEvent is matched (errors.Is) by every validation error.
var ErrInvalidEvent = errors.New("invalid outbox event")

// ValidationError says which field of which event broke which rule.
type ValidationError struct {
	// Index is the event's position in a PublishMany call (0 for Publish).
	Index int
	// Field is the Event field: "Type", "Payload", "TenantID",
	// "DispatchKey", "NotBefore" or "OrderingKey".
	Field string
	// Rule says what the field must be.
	Rule string
	// cause is the database's error when the database refused the event
	// (strict routing, or NotBefore past MaxDelay by the database's clock).
	cause error
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("outbox: event %d: %s %s", e.Index, e.Field, e.Rule)
}

// Is makes errors.Is(err, ErrInvalidEvent) true.
func (e *ValidationError) Is(target error) bool { return target == ErrInvalidEvent }

// Unwrap returns the database's error (wrapping ErrNoRoute for strict
// routing), or nil when Go refused the event before the round trip.
func (e *ValidationError) Unwrap() error { return e.cause }

// ErrNoRoute is matched (errors.Is) by the error of Publish and PublishMany
// when strict routing is on (`outboxctl routes sync --strict on`) and no
// synced route prefix matches an event's type. The error is a
// *ValidationError for the field "Type", and it also wraps the database's
// *pgconn.PgError (22023, constraint outbox_route_strict).
var ErrNoRoute = errors.New("no synced route matches the event type")

// ValidateType checks an event type against the pattern and length rule and
// returns a description of the rule it breaks, or nil.
func ValidateType(t string) error {
	switch {
	case t == "":
		return errors.New("is required: use <domain>.<entity>.<verb>, e.g. billing.invoice.paid")
	case len(t) > MaxTypeBytes:
		return fmt.Errorf("is %d bytes, the limit is %d", len(t), MaxTypeBytes)
	case !utf8.ValidString(t) || !typePattern.MatchString(t):
		return fmt.Errorf("%s must be at least three dot-separated segments of lowercase [a-z0-9] with inner dashes, e.g. billing.invoice.paid", quoteShort(t, 80))
	}
	return nil
}

// ValidatePayload checks a payload: valid JSON in valid UTF-8, within
// MaxPayloadBytes both as given and as Postgres prints the jsonb (numbers in
// plain decimal, a space after every ':' and ','), nested at most
// MaxPayloadDepth levels, and storable as jsonb: no
// \u0000, no unpaired surrogate escape, no number outside numeric's range
// (at most 131072 digits before the decimal point and 16383 after).
// Whatever it accepts, the table stores, so a valid event never aborts the
// producer's transaction.
func ValidatePayload(p json.RawMessage) error {
	if len(p) > MaxPayloadBytes {
		return fmt.Errorf("is %d bytes, the limit is %d", len(p), MaxPayloadBytes)
	}
	if !utf8.Valid(p) {
		return errors.New("is not valid UTF-8")
	}
	// Before json.Valid, which refuses nesting past 10,000 levels as "not
	// valid JSON" without naming the rule.
	if jsonlimit.Exceeds(p, MaxPayloadDepth) {
		return fmt.Errorf("is nested %d levels deep, the limit is %d", jsonlimit.Depth(p), MaxPayloadDepth)
	}
	if !json.Valid(p) {
		return errors.New("is not valid JSON")
	}
	return jsonbProblem(p)
}

// Postgres numeric limits (digits before and after the decimal point).
const (
	numericMaxWeightDigits = 131072
	numericMaxScale        = 16383
)

// jsonbProblem scans valid JSON for what jsonb refuses, and bounds the size
// of the jsonb's text form (which is what the table's CHECK and
// outbox_publish measure). Structural bytes ('"', '\\', digits, ':', ',')
// never occur inside multi-byte UTF-8 sequences, so a byte scan is exact.
// Strings never grow in the text form, numbers may (1e999 prints 1000
// digits), and separators gain one space each: the estimate is an upper
// bound.
func jsonbProblem(p []byte) error {
	textLen := len(p)
	for i := 0; i < len(p); i++ {
		switch c := p[i]; {
		case c == ':' || c == ',':
			textLen++
		case c == '"':
			for i++; i < len(p) && p[i] != '"'; i++ {
				if p[i] != '\\' {
					continue
				}
				i++
				if p[i] != 'u' {
					continue
				}
				r := hex4(p[i+1 : i+5])
				at := i - 1
				i += 4
				switch {
				case r == 0:
					return fmt.Errorf(`contains \u0000 at byte %d, which Postgres' jsonb cannot store`, at)
				case r >= 0xD800 && r < 0xDC00:
					if i+6 < len(p) && p[i+1] == '\\' && p[i+2] == 'u' {
						if r2 := hex4(p[i+3 : i+7]); r2 >= 0xDC00 && r2 <= 0xDFFF {
							i += 6
							continue
						}
					}
					return fmt.Errorf(`has an unpaired surrogate escape \u%04x at byte %d, which Postgres' jsonb cannot store`, r, at)
				case r >= 0xDC00 && r <= 0xDFFF:
					return fmt.Errorf(`has an unpaired surrogate escape \u%04x at byte %d, which Postgres' jsonb cannot store`, r, at)
				}
			}
		case c == '-' || (c >= '0' && c <= '9'):
			j := i
			for j < len(p) && strings.IndexByte("+-.eE0123456789", p[j]) >= 0 {
				j++
			}
			plain, err := checkNumber(string(p[i:j]))
			if err != nil {
				return fmt.Errorf("number %s at byte %d %w", truncate(string(p[i:j]), 40), i, err)
			}
			textLen += plain - (j - i)
			if textLen > MaxPayloadBytes {
				return fmt.Errorf("grows past %d bytes as Postgres prints it (number %s at byte %d is %d digits in plain decimal), the limit is %d", MaxPayloadBytes, truncate(string(p[i:j]), 40), i, plain, MaxPayloadBytes)
			}
			i = j - 1
		}
	}
	if textLen > MaxPayloadBytes {
		return fmt.Errorf("is %d bytes as Postgres prints it (a space after every ':' and ','), the limit is %d", textLen, MaxPayloadBytes)
	}
	return nil
}

// checkNumber checks a JSON number literal against numeric's range and
// returns its length in plain decimal, as Postgres prints it.
func checkNumber(n string) (int, error) {
	sign := 0
	if strings.HasPrefix(n, "-") {
		sign = 1
		n = n[1:]
	}
	mant, exp, hasExp := strings.Cut(strings.ToLower(n), "e")
	intPart, frac, _ := strings.Cut(mant, ".")
	e := 0
	if hasExp {
		sign := 1
		if exp != "" && (exp[0] == '+' || exp[0] == '-') {
			if exp[0] == '-' {
				sign = -1
			}
			exp = exp[1:]
		}
		exp = strings.TrimLeft(exp, "0")
		if len(exp) > 9 {
			exp = "999999999"
		}
		for _, d := range exp {
			e = e*10 + int(d-'0')
		}
		e *= sign
	}
	errRange := fmt.Errorf("is outside the range of Postgres' numeric (at most %d digits before the decimal point and %d after)", numericMaxWeightDigits, numericMaxScale)
	scale := max(0, len(frac)-e)
	if scale > numericMaxScale {
		return 0, errRange
	}
	weight := 0 // digits before the decimal point; 0 for zero
	if strings.Trim(intPart+frac, "0") != "" {
		if t := strings.TrimLeft(intPart, "0"); t != "" {
			weight = len(t) + e
		} else {
			weight = e - (len(frac) - len(strings.TrimLeft(frac, "0")))
		}
	}
	if weight > numericMaxWeightDigits {
		return 0, errRange
	}
	plain := sign + max(weight, 1)
	if scale > 0 {
		plain += 1 + scale
	}
	return plain, nil
}

func hex4(b []byte) rune {
	var r rune
	for _, c := range b {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c-'a') + 10
		case c >= 'A' && c <= 'F':
			r |= rune(c-'A') + 10
		}
	}
	return r
}

func validateEvent(i int, e *Event) error {
	if err := ValidateType(e.Type); err != nil {
		return &ValidationError{Index: i, Field: "Type", Rule: err.Error()}
	}
	if e.Payload != nil {
		if err := ValidatePayload(e.Payload); err != nil {
			return &ValidationError{Index: i, Field: "Payload", Rule: err.Error()}
		}
	}
	if err := validateText(e.TenantID, MaxTenantIDBytes); err != nil {
		return &ValidationError{Index: i, Field: "TenantID", Rule: err.Error()}
	}
	if err := validateText(e.DispatchKey, MaxDispatchKeyBytes); err != nil {
		return &ValidationError{Index: i, Field: "DispatchKey", Rule: err.Error()}
	}
	if err := validateText(e.OrderingKey, MaxOrderingKeyBytes); err != nil {
		return &ValidationError{Index: i, Field: "OrderingKey", Rule: err.Error()}
	}
	// A coarse check with this host's clock; the database checks again
	// with its own.
	if !e.NotBefore.IsZero() {
		if ahead := time.Until(e.NotBefore); ahead > MaxDelay {
			return &ValidationError{Index: i, Field: "NotBefore", Rule: fmt.Sprintf("is %s ahead, the limit is %s (365 days, outbox.MaxDelay): keep far-future due times in your own table and publish within a year of them", ahead.Round(time.Hour), MaxDelay)}
		}
	}
	return nil
}

func validateText(s string, limit int) error {
	switch {
	case len(s) > limit:
		return fmt.Errorf("is %d bytes, the limit is %d", len(s), limit)
	case strings.IndexByte(s, 0) >= 0:
		return errors.New("contains a NUL byte")
	case !utf8.ValidString(s):
		return errors.New("is not valid UTF-8")
	}
	return nil
}

// quoteShort quotes s in ASCII (invalid bytes and control characters
// escaped) and cuts the quoted form at n bytes, so that a message stays
// short and printable whatever the input.
func quoteShort(s string, n int) string {
	q := strconv.QuoteToASCII(s)
	if len(q) <= n {
		return q
	}
	return q[:n] + "…"
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// Publish writes one event in the caller's transaction and returns its id.
// Nothing is written when the event is invalid (the error wraps
// ErrInvalidEvent and names the field). A duplicate DispatchKey is not an
// error: Published.Duplicate is true and the transaction stays usable.
// Publish never commits or rolls back tx.
//
// When ctx carries an OpenTelemetry span context, Publish stores its W3C
// trace context (traceparent and tracestate) with the event; the handoff
// copies it into the River job's metadata, and the receiver's span
// continues the trace (see package outboxriver). This needs migration 010.
func Publish(ctx context.Context, tx pgx.Tx, event Event) (Published, error) {
	res, err := PublishMany(ctx, tx, []Event{event})
	if err != nil {
		return Published{}, err
	}
	return res[0], nil
}

// traceContextProblem says what is wrong with a stored trace context, or ""
// when it is acceptable, by the rule of outbox_trace_context_problem.
func traceContextProblem(tc string) string {
	switch {
	case len(tc) > maxTraceContextBytes:
		return fmt.Sprintf("is %d bytes, the limit is %d", len(tc), maxTraceContextBytes)
	case !traceContextPattern.MatchString(tc):
		return "must be a W3C traceparent of version 00, optionally followed by one space and a tracestate of printable ASCII"
	case tc[3:35] == strings.Repeat("0", 32) || tc[36:52] == strings.Repeat("0", 16):
		return "has an all-zero trace id or parent id, which W3C Trace Context forbids"
	}
	return ""
}

// traceContext returns the W3C trace context of the span in ctx in the
// form of the column trace_context, or "" when ctx carries no valid span
// context. It always uses the W3C propagator, whatever the global one
// (otel.SetTextMapPropagator) is, because the column and the River job
// metadata hold W3C headers. The span context comes from any OpenTelemetry
// tracer (or trace.ContextWithRemoteSpanContext); a tracestate past 512
// bytes is dropped, as W3C allows, and the trace goes on without it.
func traceContext(ctx context.Context) string {
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, carrier)
	tp := carrier.Get("traceparent")
	if tp == "" {
		return ""
	}
	tc := tp
	if ts := carrier.Get("tracestate"); ts != "" && len(ts) <= maxTraceStateBytes {
		tc += " " + ts
	}
	if traceContextProblem(tc) != "" {
		tc = tp // the tracestate broke the rule: drop it
	}
	if traceContextProblem(tc) != "" {
		return "" // not a version 00 traceparent: never fail a publish for tracing
	}
	return tc
}

// publishManySQL returns the call of outbox_publish_many for a batch: the
// function validates it again (with the table's rules), inserts it, and
// maps every input position to its own id or to the stored event with the
// same tenant and key (see migration 006). It runs as the owner of the
// migrations, so a producer needs EXECUTE on it and nothing on the table: it
// can neither choose event ids nor read other tenants' keys. The optional
// arguments are named only when used, so that producers that use none of
// them also work against a schema migrated before the one that added them:
// the due times (NULL elements are due now) and the trace context of the
// caller's ctx (migration 010; the same for every event, sent once and
// repeated by array_fill), and the ordering keys (migration 011). The first
// four arguments are $1 to $4.
func publishManySQL(delays, traced, ordered bool) string {
	var b strings.Builder
	b.WriteString(`SELECT ord, duplicate, id FROM outbox_publish_many($1::text[], $2::jsonb[], $3::text[], $4::text[]`)
	n := 4
	if delays {
		n++
		fmt.Fprintf(&b, `, not_befores => $%d::timestamptz[]`, n)
	}
	if traced {
		n++
		fmt.Fprintf(&b, `, trace_contexts => array_fill($%d::text, ARRAY[cardinality($1::text[])])`, n)
	}
	if ordered {
		n++
		fmt.Fprintf(&b, `, ordering_keys => $%d::text[]`, n)
	}
	b.WriteString(`)`)
	return b.String()
}

// PublishMany writes a batch of events in the caller's transaction in one
// round trip (a call of the SQL function outbox_publish_many) and returns
// one result per event, in order. All events are
// validated first; if any is invalid nothing is written. Duplicate dispatch
// keys (stored earlier or repeated inside the batch) yield the first event's
// id with Duplicate = true. Every event gets the trace context of ctx, as
// with Publish.
func PublishMany(ctx context.Context, tx pgx.Tx, events []Event) ([]Published, error) {
	if len(events) == 0 {
		return nil, nil
	}
	if len(events) > MaxPublishMany {
		return nil, fmt.Errorf("%w: PublishMany takes at most %d events, got %d; split the batch", ErrInvalidEvent, MaxPublishMany, len(events))
	}
	var (
		types    = make([]string, len(events))
		payloads = make([]string, len(events))
		tenants  = make([]*string, len(events))
		keys     = make([]*string, len(events))
		delays   []*time.Time
		ordering []*string
	)
	for i := range events {
		e := &events[i]
		if err := validateEvent(i, e); err != nil {
			return nil, err
		}
		types[i] = e.Type
		if e.Payload == nil {
			payloads[i] = "{}"
		} else {
			payloads[i] = string(e.Payload)
		}
		if e.TenantID != "" {
			tenants[i] = &e.TenantID
		}
		if e.DispatchKey != "" {
			keys[i] = &e.DispatchKey
		}
		if !e.NotBefore.IsZero() {
			if delays == nil {
				delays = make([]*time.Time, len(events))
			}
			delays[i] = &e.NotBefore
		}
		if e.OrderingKey != "" {
			if ordering == nil {
				ordering = make([]*string, len(events))
			}
			ordering[i] = &e.OrderingKey
		}
	}

	var (
		rows pgx.Rows
		err  error
		tc   = traceContext(ctx)
	)
	args := []any{types, payloads, tenants, keys}
	if delays != nil {
		args = append(args, delays)
	}
	if tc != "" {
		args = append(args, tc)
	}
	if ordering != nil {
		args = append(args, ordering)
	}
	rows, err = tx.Query(ctx, publishManySQL(delays != nil, tc != "", ordering != nil), args...)
	if err != nil {
		switch {
		case ordering != nil:
			err = orderingSchemaError(err)
		case tc != "":
			err = traceSchemaError(err)
		}
		return nil, publishError(err, events)
	}
	out := make([]Published, len(events))
	n := 0
	for rows.Next() {
		var (
			ord int64
			p   Published
		)
		if err := rows.Scan(&ord, &p.Duplicate, &p.ID); err != nil {
			rows.Close()
			return nil, fmt.Errorf("outbox: publish: %w", err)
		}
		if ord < 1 || int(ord) > len(events) {
			rows.Close()
			return nil, fmt.Errorf("outbox: publish: outbox_publish_many returned position %d for %d events", ord, len(events))
		}
		out[ord-1] = p
		n++
	}
	if err := rows.Err(); err != nil {
		return nil, publishError(err, events)
	}
	if n != len(events) {
		return nil, fmt.Errorf("outbox: publish: outbox_publish_many returned %d results for %d events", n, len(events))
	}
	return out, nil
}

// traceSchemaError explains the error of a traced publish against a schema
// migrated before 010, whose outbox_publish_many has no trace_contexts
// parameter (42883, undefined_function).
func traceSchemaError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42883" && strings.Contains(pgErr.Message, "outbox_publish_many") {
		return fmt.Errorf("the database schema predates migration 010 (trace context), and ctx carries a trace: run `outboxctl migrate` before deploying producers of this version, or publish with a ctx without a span context (trace.ContextWithSpanContext(ctx, trace.SpanContext{})) until then: %w", err)
	}
	return err
}

// orderingSchemaError explains the error of a publish with ordering keys
// against a schema migrated before 011, whose outbox_publish_many has no
// ordering_keys parameter.
func orderingSchemaError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42883" && strings.Contains(pgErr.Message, "outbox_publish_many") {
		return fmt.Errorf("the database schema predates migration 011 (ordering keys), and an event has an OrderingKey: run `outboxctl migrate` before deploying producers that order events: %w", err)
	}
	return err
}

// publishError wraps an error of the publishing statement. A serialization
// failure gets a hint: under REPEATABLE READ or SERIALIZABLE, a dispatch key
// stored by a transaction that committed after this transaction's snapshot
// (or that was in flight and committed while the insert waited) cannot be
// returned, because its row is invisible to the snapshot, and Postgres
// raises 40001. The error still wraps the *pgconn.PgError, so retry loops
// that look for 40001 work unchanged.
//
// The database's refusals that Go cannot foresee become a *ValidationError
// naming the event and the field: strict routing (constraint
// outbox_route_strict, field Type, also matching ErrNoRoute) and a NotBefore
// past MaxDelay by the database's clock (outbox_max_delay, field
// NotBefore).
func publishError(err error, events []Event) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "22023" {
		i := 0
		if m := batchIndex.FindStringSubmatch(pgErr.Message); m != nil {
			if n, convErr := strconv.Atoi(m[1]); convErr == nil && n >= 1 && n <= len(events) {
				i = n - 1
			}
		}
		switch pgErr.ConstraintName {
		case "outbox_route_strict":
			return &ValidationError{Index: i, Field: "Type", cause: fmt.Errorf("%w: %w", ErrNoRoute, err),
				Rule: fmt.Sprintf("%s matches no synced route and strict routing is on: %s", quoteShort(events[i].Type, 80), pgErr.Hint)}
		case "outbox_max_delay":
			return &ValidationError{Index: i, Field: "NotBefore", cause: err,
				Rule: fmt.Sprintf("%s is more than %s (365 days, outbox.MaxDelay) after the database's clock: %s", events[i].NotBefore.Format(time.RFC3339), MaxDelay, pgErr.Hint)}
		}
	}
	if errors.As(err, &pgErr) && pgErr.Code == "40001" { // serialization_failure
		return fmt.Errorf("outbox: publish: a dispatch key of this batch was stored by a transaction that committed after this one's snapshot (REPEATABLE READ or SERIALIZABLE); retry the whole transaction, which then gets the stored event's id: %w", err)
	}
	return fmt.Errorf("outbox: publish: %w", err)
}

// ValidateEvent checks one event as Publish would, without writing. It
// returns the event as it would be stored (a nil payload becomes {}).
func ValidateEvent(e Event) (Event, error) {
	if err := validateEvent(0, &e); err != nil {
		return e, err
	}
	if e.Payload == nil {
		e.Payload = json.RawMessage("{}")
	}
	return e, nil
}
