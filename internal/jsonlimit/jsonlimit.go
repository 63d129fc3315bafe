// Package jsonlimit measures JSON documents without decoding them, so that
// the producer's validation and the dispatcher apply one payload rule
// (outbox.MaxPayloadDepth) to the same bytes.
package jsonlimit

// MaxDepth is the deepest nesting of objects and arrays a payload may have.
// encoding/json refuses documents nested deeper than 10,000 levels, and the
// River job args that carry a payload add a level of their own, so a bound
// well below that keeps every handed-off payload decodable by any Go
// worker (and by most other languages' default parsers).
const MaxDepth = 1000

// Depth returns the deepest nesting of objects and arrays in b: 0 for a
// scalar, 1 for {} or [], 2 for {"a":[]}, and so on. Brackets inside
// strings do not count. b need not be valid JSON; for invalid input the
// result is the depth of the bracket structure as written.
func Depth(b []byte) int {
	deepest, _ := walk(b, -1)
	return deepest
}

// Exceeds reports whether b is nested deeper than limit. It stops at the
// first bracket past the limit, so it is cheap on hostile input.
func Exceeds(b []byte, limit int) bool {
	_, over := walk(b, limit)
	return over
}

// walk measures the nesting of b and stops as soon as it passes limit
// (a negative limit never stops it).
func walk(b []byte, limit int) (deepest int, over bool) {
	depth := 0
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '"':
			for i++; i < len(b) && b[i] != '"'; i++ {
				if b[i] == '\\' {
					i++
				}
			}
		case '{', '[':
			depth++
			deepest = max(deepest, depth)
			if limit >= 0 && depth > limit {
				return deepest, true
			}
		case '}', ']':
			depth--
		}
	}
	return deepest, false
}
