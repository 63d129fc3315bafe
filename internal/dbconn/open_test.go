package dbconn_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/dbconn"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// withUserDB returns the test database's URL with its user and/or
// database replaced (empty keeps them).
func withUserDB(t *testing.T, user, db string) string {
	t.Helper()
	u, err := url.Parse(pgtest.URL())
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Skipf("test database URL is not a postgres:// URL: %v", err)
	}
	if user != "" {
		if p, ok := u.User.Password(); ok {
			u.User = url.UserPassword(user, p)
		} else {
			u.User = url.User(user)
		}
	}
	if db != "" {
		u.Path = "/" + db
	}
	return u.String()
}

// A wrong database or role is permanent: Open must fail at once with the
// reason, not retry for its whole Wait (two minutes in outboxd).
func TestOpenPermanentErrorsFailAtOnce(t *testing.T) {
	t.Parallel()
	pgtest.Admin(t) // skip early with a clear message when there is no database
	for _, tc := range []struct {
		name, user, db, code, want string
	}{
		{"unknown database", "", "outbox_no_such_db_" + fmt.Sprint(time.Now().UnixNano()), "3D000", "does not exist"},
		{"unknown role", "outbox_no_such_role", "", "28000", `role "outbox_no_such_role" does not exist`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			start := time.Now()
			pool, err := dbconn.Open(ctx, withUserDB(t, tc.user, tc.db), dbconn.Options{Wait: 2 * time.Minute})
			elapsed := time.Since(start)
			if err == nil {
				pool.Close()
				t.Fatal("Open succeeded")
			}
			if !errors.Is(err, dbconn.ErrPermanent) {
				t.Errorf("error does not wrap ErrPermanent: %v", err)
			}
			for _, w := range []string{tc.code, tc.want, "retrying cannot help"} {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not say %q: %v", w, err)
				}
			}
			// The retry window is two minutes; a permanent error takes one
			// round trip. 30 s leaves room for a loaded machine.
			if elapsed > 30*time.Second {
				t.Errorf("Open took %s: it retried a permanent error", elapsed)
			}
		})
	}
}

// Transient errors are still retried: nothing listens on the port.
func TestOpenRetriesConnectionRefused(t *testing.T) {
	t.Parallel()
	port := deadPort(t)
	u := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=2", port)
	_, err := dbconn.Open(context.Background(), u, dbconn.Options{Wait: 1500 * time.Millisecond})
	if err == nil {
		t.Fatal("Open succeeded with nothing listening")
	}
	if errors.Is(err, dbconn.ErrPermanent) || dbconn.IsPermanent(err) {
		t.Errorf("connection refused reported as permanent: %v", err)
	}
	if strings.Contains(err.Error(), "after 1 attempt(s)") {
		t.Errorf("connection refused was not retried: %v", err)
	}
}

// hostOf returns the host:port part of a postgres:// URL.
func hostOf(t *testing.T, u string) string {
	t.Helper()
	p, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	if p.Port() == "" {
		t.Skipf("test database URL %s has no port", pgtest.Redact(u))
	}
	return p.Host
}

// deadPort returns a local port nothing listens on.
func deadPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
