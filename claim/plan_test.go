package claim_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestBatchStatementsUseGenericPlans: the statements of a batch
// transaction are planned once per connection, not at every batch. With
// Postgres' default plan_cache_mode the first five executions of a
// prepared statement are planned anew, and the statement that marks the
// events done kept being replanned on about half of its executions (0.2 ms
// each, in the handoff's path); the batch transaction sets
// plan_cache_mode = force_generic_plan.
func TestBatchStatementsUseGenericPlans(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, time.Minute)
	// A pool of one connection for the batches: the prepared statements
	// counted below are theirs.
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	one, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	h := newHandoff(t, one, 6, nil)
	const batches = 8
	for range batches {
		publish(t, s.Pool, "mail.user.welcomed")
		if res, err := h.Batch(ctx, 10); err != nil || res.Done != 1 {
			t.Fatalf("batch: %+v, %v", res, err)
		}
	}
	for _, st := range []struct{ name, like string }{
		{"the claim", `%WITH kept AS%`},
		{"marking the events done", `%river_job_ids = j.ids%`},
	} {
		var generic, custom int64
		err := one.QueryRow(ctx, `
			SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0)
			FROM pg_prepared_statements WHERE statement LIKE $1`, st.like).Scan(&generic, &custom)
		if err != nil {
			t.Fatal(err)
		}
		if custom != 0 || generic < batches {
			t.Errorf("%s: %d custom and %d generic plans in %d batches, want 0 custom and at least %d generic", st.name, custom, generic, batches, batches)
		}
	}
}
