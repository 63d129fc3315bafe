package main

import (
	"bytes"
	"fmt"
	"strings"
	"unicode/utf8"
)

// clean makes s safe to print on an operator's terminal: C0 controls
// (ESC, CR, backspace, tab, newline, …), DEL, C1 controls, the bidi
// controls and line separators are shown as Go-style escapes (\x1b, \r,
// \u202e), and so is every byte that is not UTF-8. Everything else,
// backslashes included, is printed as it is, so JSON text stays readable.
// Text output passes every value that comes from the database or a user
// through clean; --json output needs nothing (encoding/json escapes).
func clean(s string) string {
	if !needsClean(s) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, `\x%02x`, r)
		case unsafeRune(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

// unsafeRune reports the non-ASCII runes that clean escapes: C1 controls,
// bidi embeddings, overrides, isolates and marks, and the line and
// paragraph separators.
func unsafeRune(r rune) bool {
	switch {
	case r >= 0x80 && r <= 0x9f:
		return true
	case r == 0x061c, r == 0x200e, r == 0x200f:
		return true
	case r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069:
		return true
	case r == 0x2028, r == 0x2029:
		return true
	}
	return false
}

func needsClean(s string) bool {
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && size <= 1) || r < 0x20 || r == 0x7f || unsafeRune(r) {
			return true
		}
		i += size
	}
	return false
}

// jsonEscapeUnsafe rewrites the runes unsafeRune reports in a JSON document
// as \uXXXX escapes. Outside strings a JSON document is ASCII, so every
// such rune is inside a string, where the escape means the same rune.
func jsonEscapeUnsafe(doc []byte) []byte {
	if !bytes.ContainsFunc(doc, unsafeRune) {
		return doc
	}
	var b bytes.Buffer
	for i := 0; i < len(doc); {
		r, size := utf8.DecodeRune(doc[i:])
		if unsafeRune(r) {
			fmt.Fprintf(&b, `\u%04x`, r)
		} else {
			b.Write(doc[i : i+size])
		}
		i += size
	}
	return b.Bytes()
}
