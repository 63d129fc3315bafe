package main

// Flags and helpers that the operator commands share.

import (
	"context"
	"flag"
	"os"
	"os/user"
	"strconv"
	"strings"

	"github.com/outboxhq/outbox/admin"
)

// opsFlags is c.flags plus --database-url (default $DATABASE_URL).
func (c *cli) opsFlags(name string) *flag.FlagSet {
	fs := c.flags(name)
	// A Func flag shows no default in --help: the URL may hold a password.
	fs.Func("database-url", "Postgres connection string (default $DATABASE_URL)", func(v string) error {
		c.dbURL = v
		return nil
	})
	return fs
}

// admin opens the pool on first use and returns an admin client on it.
func (c *cli) admin(ctx context.Context) (*admin.Client, error) {
	pool, err := c.db(ctx)
	if err != nil {
		return nil, err
	}
	return admin.New(pool), nil
}

// defaultActor is the OS user running outboxctl.
func defaultActor() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	for _, k := range []string{"USER", "LOGNAME"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return "unknown"
}

// listFlag collects a repeatable flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

func envInt(name string, def int) (int, error) {
	v := os.Getenv(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, usagef("%s=%q is not an integer", name, v)
	}
	return n, nil
}
