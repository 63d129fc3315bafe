package filter

import (
	"errors"
	"strings"
	"testing"
	"time"
)

var requeueRules = Rules{
	Action:   "requeue",
	Eligible: []string{"failed", "cancelled", "done"},
	Refused:  map[string]string{"pending": "the dispatcher owns them", "processing": "the dispatcher owns them"},
	Default:  []string{"failed"},
}

func TestCheckRefusals(t *testing.T) {
	t.Parallel()
	now := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	early, late := now.Add(-time.Hour), now
	cases := []struct {
		name string
		f    Filter
		want string // substring of the error; "" = accepted
	}{
		{"bulk without filter", Filter{}, "pass --all"},
		{"status alone is bulk", Filter{Statuses: []string{"failed"}}, "pass --all"},
		{"all accepted", Filter{All: true}, ""},
		{"prefix narrows", Filter{TypePrefix: "mail."}, ""},
		{"pending refused", Filter{All: true, Statuses: []string{"pending"}}, "--status: requeue never touches pending"},
		{"unknown eligible", Filter{All: true, Statuses: []string{"failed"}, Limit: MaxLimit + 1}, "--limit"},
		{"negative limit", Filter{All: true, Limit: -1}, "--limit: -1 is out of range"},
		{"since after until", Filter{Since: &late, Until: &early}, "--since"},
		{"nul", Filter{Tenant: "a\x00b"}, "--tenant: contains a NUL"},
	}
	for _, c := range cases {
		f := c.f
		err := f.Check(requeueRules)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: refused: %v", c.name, err)
		case c.want != "" && err == nil:
			t.Errorf("%s: accepted, want error containing %q", c.name, c.want)
		case c.want != "" && !strings.Contains(err.Error(), c.want):
			t.Errorf("%s: error %q does not contain %q", c.name, err, c.want)
		case err != nil && !errors.As(err, new(*Error)):
			t.Errorf("%s: error %v is not a *filter.Error", c.name, err)
		}
		if err == nil && f.Limit != DefaultLimit {
			t.Errorf("%s: limit %d, want default %d", c.name, f.Limit, DefaultLimit)
		}
	}
}

func TestParseTime(t *testing.T) {
	t.Parallel()
	now := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Time{
		"2024-04-30T10:00:00Z": time.Date(2024, 4, 30, 10, 0, 0, 0, time.UTC),
		"2024-04-30":           time.Date(2024, 4, 30, 0, 0, 0, 0, time.UTC),
		"90m":                  now.Add(-90 * time.Minute),
		"3d":                   now.Add(-72 * time.Hour),
	} {
		got, err := ParseTime("since", in, now)
		if err != nil || !got.Equal(want) {
			t.Errorf("ParseTime(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "yesterday", "-5m", "3x", "2024-13-01"} {
		if _, err := ParseTime("since", bad, now); err == nil || !strings.HasPrefix(err.Error(), "--since: ") {
			t.Errorf("ParseTime(%q) = %v, want an error naming --since", bad, err)
		}
	}
}

func TestParseStatusesAndIDs(t *testing.T) {
	t.Parallel()
	st, err := ParseStatuses("failed, CANCELLED,failed")
	if err != nil || strings.Join(st, ",") != "failed,cancelled" {
		t.Fatalf("ParseStatuses = %v, %v", st, err)
	}
	if _, err := ParseStatuses("failed,dead"); err == nil || !strings.Contains(err.Error(), `"dead" is not a status`) {
		t.Fatalf("ParseStatuses(dead) = %v", err)
	}
	ids, err := ParseIDs("3, 4")
	if err != nil || len(ids) != 2 || ids[1] != 4 {
		t.Fatalf("ParseIDs = %v, %v", ids, err)
	}
	for _, bad := range []string{"0", "-1", "x", "1,,2"} {
		if _, err := ParseIDs(bad); err == nil {
			t.Errorf("ParseIDs(%q) accepted", bad)
		}
	}
}

// FuzzParse feeds arbitrary flag values through the parsers and Check:
// nothing may panic, and an accepted filter must respect the limits.
func FuzzParse(f *testing.F) {
	f.Add("1,2", "failed", "mail.", "t1", "2h", "2024-05-01", "timeout", 10, false)
	f.Add("", "pending", "", "", "", "", "", 0, true)
	now := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, ids, statuses, prefix, tenant, since, until, errText string, limit int, all bool) {
		var flt Filter
		if ids != "" {
			v, err := ParseIDs(ids)
			if err != nil {
				return
			}
			flt.IDs = v
		}
		if statuses != "" {
			v, err := ParseStatuses(statuses)
			if err != nil {
				return
			}
			flt.Statuses = v
		}
		if since != "" {
			v, err := ParseTime("since", since, now)
			if err != nil {
				return
			}
			flt.Since = &v
		}
		if until != "" {
			v, err := ParseTime("until", until, now)
			if err != nil {
				return
			}
			flt.Until = &v
		}
		flt.TypePrefix, flt.Tenant, flt.ErrorContains, flt.Limit, flt.All = prefix, tenant, errText, limit, all
		if err := flt.Check(requeueRules); err != nil {
			return
		}
		if flt.Limit < 1 || flt.Limit > MaxLimit {
			t.Fatalf("accepted limit %d", flt.Limit)
		}
		if !flt.All && !flt.Narrowed() {
			t.Fatal("accepted an unfiltered bulk selection without --all")
		}
		for _, st := range flt.Statuses {
			if st == "pending" || st == "processing" {
				t.Fatalf("accepted status %s", st)
			}
		}
		if len(flt.Args()) != 6 {
			t.Fatal("Args must fill $1..$6")
		}
	})
}
