package dbconn

import (
	"strings"
	"testing"
)

// TestRedact: every form of password is hidden, whether or not pgx parses
// the connection string, and the rest of the message survives.
func TestRedact(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, url, msg string
		secrets        []string // must not appear in the result
		keep           []string // must still appear
	}{
		{"plain URL", "postgres://app:hunter22@db.internal:5432/shop",
			"connect postgres://app:hunter22@db.internal:5432/shop: refused",
			[]string{"hunter22"}, []string{"postgres://app:xxxxx@db.internal:5432/shop", "refused"}},
		{"@ in the password, unencoded", "postgres://u:p@ss@host/db",
			"cannot parse `postgres://u:p@ss@host/db`: failed to parse as URL",
			[]string{"p@ss", "p@"}, []string{"postgres://u:xxxxx@host/db"}},
		{"@ and : in the password", "postgres://u:a:b@c@host/db",
			"bad url postgres://u:a:b@c@host/db", []string{"a:b@c", "b@c"}, []string{"u:xxxxx@host/db"}},
		{"URL-encoded password", "postgres://u:p%40ss%20w@host/db",
			"url postgres://u:p%40ss%20w@host/db; password p@ss w rejected",
			[]string{"p%40ss%20w", "p@ss w"}, []string{"u:xxxxx@host"}},
		{"keyword/value, quoted with a space", "host=db user=app password='a b c' dbname=shop",
			"cannot parse `host=db user=app password='a b c' dbname=shop`",
			[]string{"a b c", "b c"}, []string{"password=xxxxx", "dbname=shop"}},
		{"keyword/value, escaped quote", `host=db password='it\'s secret' dbname=shop`,
			`parse host=db password='it\'s secret' dbname=shop`,
			[]string{"secret", `it\'s`}, []string{"dbname=shop"}},
		{"keyword/value, unterminated quote", "host=db password='never ends",
			"cannot parse host=db password='never ends", []string{"never", "ends"}, []string{"host=db"}},
		{"keyword/value, plain", "host=db password=x dbname=shop",
			"failed: host=db password=x dbname=shop", []string{"password=x "}, []string{"password=xxxxx dbname=shop"}},
		{"keyword/value, spaces and case", "host=db PASSWORD = s3cr3t",
			"conninfo host=db PASSWORD = s3cr3t", []string{"s3cr3t"}, []string{"host=db"}},
		{"query parameter", "postgres://app@host/db?sslmode=disable&password=qwerty12",
			"connect postgres://app@host/db?sslmode=disable&password=qwerty12", []string{"qwerty12"}, []string{"sslmode=disable"}},
		{"password elsewhere in the message", "postgres://app:Tr0ub4dor@host/db",
			`server said: password "Tr0ub4dor" is expired`, []string{"Tr0ub4dor"}, []string{"is expired"}},
		{"not parsable, password elsewhere", "postgres://app:Tr0ub4dor@host:port/db",
			`dial host:port: the password Tr0ub4dor did not work`, []string{"Tr0ub4dor"}, []string{"did not work"}},
		{"short password kept in free text, hidden in place", "postgres://u:x@host/db",
			"postgres://u:x@host/db: box exploded", []string{"u:x@"}, []string{"u:xxxxx@host/db: box exploded"}},
		{"no password", "postgres://app@host/db", "postgres://app@host/db: refused", nil, []string{"postgres://app@host/db: refused"}},
		{"host:port without user", "postgres://host:5432/db", "postgres://host:5432/db down", nil, []string{"postgres://host:5432/db down"}},
		{"empty url", "", "password=abc def", []string{"abc"}, []string{"def"}},
	}
	for _, c := range cases {
		got := Redact(c.msg, c.url)
		for _, sec := range c.secrets {
			if strings.Contains(got, sec) {
				t.Errorf("%s: %q still holds %q", c.name, got, sec)
			}
		}
		for _, k := range c.keep {
			if !strings.Contains(got, k) {
				t.Errorf("%s: %q lost %q", c.name, got, k)
			}
		}
		// The connection string itself, redacted (what pgtest prints).
		if own := Redact(c.url, c.url); c.url != "" {
			for _, sec := range c.secrets {
				if strings.Contains(own, sec) {
					t.Errorf("%s: redacted url %q still holds %q", c.name, own, sec)
				}
			}
		}
	}
}
