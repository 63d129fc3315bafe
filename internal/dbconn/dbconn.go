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
	"regexp"
	"strings"
	"time"

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

var (
	urlPassword = regexp.MustCompile(`(://[^:/@\s]*:)[^@\s]*@`)
	kvPassword  = regexp.MustCompile(`(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)
)

// Redact removes the password of url (if any) from s, and any password that
// looks like part of a connection string.
func Redact(s, url string) string {
	cfg, err := pgx.ParseConfig(url)
	if err == nil && cfg.Password != "" {
		s = strings.ReplaceAll(s, cfg.Password, "xxxxx")
	}
	s = urlPassword.ReplaceAllString(s, "${1}xxxxx@")
	return kvPassword.ReplaceAllString(s, "${1}xxxxx")
}
