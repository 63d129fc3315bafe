package filter

import (
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// FuzzParseRoundTrip checks the flag parsers one by one: accepted ids are
// positive and print back to a list that parses to the same ids; accepted
// statuses are known, distinct and lowercase; an accepted time is never
// after now when given as an age; CheckText refuses exactly NUL, invalid
// UTF-8 and oversize text. (FuzzParse in filter_test.go covers Check.)
func FuzzParseRoundTrip(f *testing.F) {
	// Edge cases of the parsers themselves (the values never reach SQL
	// text: Predicate is constant). More in testdata/fuzz.
	f.Add("1,2,3", "failed,DONE", "2h", "mail.")
	f.Add(" 7 ", "pending", "2024-05-01T10:00:00Z", "%_\\")
	f.Add("9223372036854775807", "cancelled,cancelled", "-1h", "a\x00b")
	f.Add("9223372036854775808", "done,", "36501d", strings.Repeat("é", maxText/2)+"a")
	f.Add("1,,2", "ＤＯＮＥ", "2562047h47m16.854775807s", strings.Repeat("a", maxText))
	now := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, ids, statuses, when, text string) {
		if got, err := ParseIDs(ids); err == nil {
			parts := make([]string, len(got))
			for i, id := range got {
				if id < 1 {
					t.Fatalf("ParseIDs(%q) accepted id %d", ids, id)
				}
				parts[i] = strconv.FormatInt(id, 10)
			}
			again, err := ParseIDs(strings.Join(parts, ","))
			if err != nil || !slices.Equal(again, got) {
				t.Fatalf("ParseIDs round trip: %v -> %v (%v)", got, again, err)
			}
		}
		if got, err := ParseStatuses(statuses); err == nil {
			seen := map[string]bool{}
			for _, st := range got {
				if !slices.Contains(Statuses, st) || seen[st] {
					t.Fatalf("ParseStatuses(%q) = %v", statuses, got)
				}
				seen[st] = true
			}
		}
		if tm, err := ParseTime("since", when, now); err == nil {
			s := strings.TrimSpace(when)
			if _, perr := time.Parse(time.RFC3339Nano, s); perr != nil {
				if _, derr := time.Parse(time.DateOnly, s); derr != nil && tm.After(now) {
					t.Fatalf("age %q parsed to %s, after now", when, tm)
				}
			}
		}
		err := CheckText("tenant", text)
		bad := strings.ContainsRune(text, 0) || len(text) > maxText || !utf8.ValidString(text)
		if (err != nil) != bad {
			t.Fatalf("CheckText(%q) = %v, want refused=%v", text, err, bad)
		}
	})
}
