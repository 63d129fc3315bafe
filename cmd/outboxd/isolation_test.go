package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestIsolationWarning: outboxd warns at start when its sessions begin
// their transactions above READ COMMITTED, which per-key ordering's
// release cannot work with, and says nothing at Postgres' default.
func TestIsolationWarning(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)

	if w, err := isolationWarning(ctx, s.Pool); err != nil || w != "" {
		t.Fatalf("at read committed: warning %q, error %v; want none", w, err)
	}

	cfg, err := pgx.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	w, err := isolationWarning(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(w, `"repeatable read"`) || !strings.Contains(w, "read committed") {
		t.Fatalf("at repeatable read: warning %q, want one naming the level and what ordering needs", w)
	}
}
