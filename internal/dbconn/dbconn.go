// Package dbconn opens the pgx pool of outboxd and outboxctl: it parses
// DATABASE_URL, retries while the database is down with a growing delay and
// a log line per attempt (but not when the credentials, role or database are
// wrong), and keeps the password out of every message.
package dbconn

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	neturl "net/url"
	"regexp"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Options tune Open.
type Options struct {
	// MaxConns of the pool; 0 keeps pgxpool's default (or the URL's
	// pool_max_conns).
	MaxConns int32
	// Wait is how long to keep retrying while the database is unreachable.
	// 0 means try once. Permanent refusals (IsPermanent) are never retried.
	Wait time.Duration
	// Logger for the retry messages; nil discards.
	Logger *slog.Logger
}

// Open parses url and connects (defaulting a multi-host url to
// target_session_attrs=read-write, and evicting connections that answer
// read-only: see failover.go), retrying with backoff for up to opts.Wait
// while the database is unreachable or not ready. A refusal that retrying
// cannot fix (wrong password, unknown role or database, no CONNECT
// privilege) fails at once with an error wrapping ErrPermanent.
func Open(ctx context.Context, url string, opts Options) (*pgxpool.Pool, error) {
	if url == "" {
		return nil, errors.New("DATABASE_URL is not set: give a Postgres connection string, e.g. postgres://user@127.0.0.1:5432/app")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL is not a valid connection string: %s", Redact(err.Error(), url))
	}
	if opts.MaxConns > 0 {
		cfg.MaxConns = opts.MaxConns
	}
	logger := opts.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	configureFailover(cfg, url, logger)
	deadline := time.Now().Add(opts.Wait)
	delay := 250 * time.Millisecond
	for attempt := 1; ; attempt++ {
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err == nil {
			pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err = pool.Ping(pctx)
			cancel()
			if err == nil {
				return pool, nil
			}
			pool.Close()
		}
		msg := Redact(err.Error(), url)
		if pe := permanentError(err); pe != nil {
			return nil, fmt.Errorf("%w: the database at %s refused the connection with SQLSTATE %s (%s): %s; fix DATABASE_URL (user, password, database name) or the role's grants: retrying cannot help",
				ErrPermanent, Describe(cfg.ConnConfig), pe.Code, permanentCodes[pe.Code], Redact(pe.Message, url))
		}
		if ctx.Err() != nil || time.Now().Add(delay).After(deadline) {
			return nil, fmt.Errorf("cannot reach the database at %s after %d attempt(s): %s", Describe(cfg.ConnConfig), attempt, msg)
		}
		logger.Warn("database unreachable; retrying",
			slog.String("database", Describe(cfg.ConnConfig)),
			slog.Int("attempt", attempt),
			slog.Duration("retry_in", delay),
			slog.String("error", msg))
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		delay = min(delay*2, 5*time.Second)
	}
}

// Describe names a database without its password: user@host:port/db.
func Describe(c *pgx.ConnConfig) string {
	return fmt.Sprintf("%s@%s:%d/%s", c.User, c.Host, c.Port, c.Database)
}

// mask replaces a password.
const mask = "xxxxx"

// kvPassword matches a keyword/value or query-string password: password=,
// sslpassword=, any case, with optional spaces around '='. Its value is a
// single-quoted string (backslash escapes; unterminated runs to the end) or
// everything up to the next space (in a URL that includes the rest of the
// query, in a quoted message the closing quote: hiding too much is the safe
// side).
var kvPassword = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*(?:'|$)|\S+)`)

// Redact removes passwords from s, which may quote the connection string
// url (an error message, a log line), whether or not pgx can parse url:
//
//   - the password of every URL in s (postgres://user:PASSWORD@host), up to
//     the last '@' of the URL, so "postgres://u:p@ss@host" hides "p@ss";
//   - every keyword/value or query password (password=x, password='a b',
//     ?password=x);
//   - every other occurrence in s of url's password, raw, URL-decoded and
//     URL-encoded, when it is at least 4 bytes long (a shorter one is hidden
//     only where it stands as a password: replacing every "x" would garble
//     the message and hide nothing an attacker could not guess).
//
// outboxd, outboxctl and internal/pgtest all use it.
func Redact(s, url string) string {
	pws := passwords(url)
	s = redactURLs(s)
	s = kvPassword.ReplaceAllString(s, "${1}"+mask)
	for _, pw := range pws {
		if len(pw) >= 4 && pw != mask {
			s = strings.ReplaceAll(s, pw, mask)
		}
	}
	return s
}

// passwords lists the forms of url's password: the one pgx parses (when it
// does), the ones found in url's text, and their URL-encoded and -decoded
// forms, longest first.
func passwords(url string) []string {
	var raw []string
	if cfg, err := pgx.ParseConfig(url); err == nil && cfg.Password != "" {
		raw = append(raw, cfg.Password)
	}
	if pw, ok := urlPassword(url); ok {
		raw = append(raw, pw)
	}
	for _, m := range kvPassword.FindAllStringSubmatch(url, -1) {
		v := m[2]
		if strings.HasPrefix(v, "'") {
			v = strings.TrimSuffix(strings.TrimPrefix(v, "'"), "'")
			raw = append(raw, v, strings.NewReplacer(`\'`, `'`, `\\`, `\`).Replace(v))
		} else {
			v, _, _ = strings.Cut(v, "&")
			raw = append(raw, v)
		}
	}
	var out []string
	add := func(p string) {
		if p != "" && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	for _, p := range raw {
		add(p)
		if d, err := neturl.PathUnescape(p); err == nil {
			add(d)
		}
		if d, err := neturl.QueryUnescape(p); err == nil {
			add(d)
		}
		add(neturl.PathEscape(p))
		add(neturl.QueryEscape(p))
		add(neturl.UserPassword("u", p).String()[2:])
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out
}

// urlRests returns the bounds of the text after each "scheme://" in s,
// up to the next space or quote.
func urlRests(s string) [][2]int {
	var out [][2]int
	for off := 0; ; {
		i := strings.Index(s[off:], "://")
		if i < 0 {
			return out
		}
		start := off + i + 3
		end := start + strings.IndexFunc(s[start:], func(r rune) bool {
			return unicode.IsSpace(r) || r == '"' || r == '\'' || r == '`'
		})
		if end < start {
			end = len(s)
		}
		out = append(out, [2]int{start, end})
		off = end
	}
}

// urlPassword is the password of the first URL in s: the text between the
// first ':' and the last '@' after "://".
func urlPassword(s string) (string, bool) {
	for _, r := range urlRests(s) {
		if a, b, ok := userinfoPassword(s[r[0]:r[1]]); ok {
			return s[r[0]+a : r[0]+b], true
		}
	}
	return "", false
}

// userinfoPassword finds the password in the text after "://": it ends at
// the last '@' (a password may hold '@', a host never does) and starts
// after the first ':' before it.
func userinfoPassword(rest string) (start, end int, ok bool) {
	at := strings.LastIndexByte(rest, '@')
	if at < 0 {
		return 0, 0, false
	}
	colon := strings.IndexByte(rest[:at], ':')
	if colon < 0 {
		return 0, 0, false
	}
	return colon + 1, at, true
}

// redactURLs masks the password of every URL in s.
func redactURLs(s string) string {
	var b strings.Builder
	last := 0
	for _, r := range urlRests(s) {
		a, e, ok := userinfoPassword(s[r[0]:r[1]])
		if !ok || a == e {
			continue
		}
		b.WriteString(s[last : r[0]+a])
		b.WriteString(mask)
		last = r[0] + e
	}
	b.WriteString(s[last:])
	return b.String()
}
