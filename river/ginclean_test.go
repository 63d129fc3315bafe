package outboxriver_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/internal/proctest"
	outboxriver "github.com/outboxhq/outbox/river"
)

// wideArgs are job args with many keys: each version of a job's row adds
// an entry per key and value to River's args GIN index.
type wideArgs struct {
	Fields map[string]string `json:"fields"`
}

func (wideArgs) Kind() string { return "gin_clean_test" }

// fillPendingLists inserts n River jobs in one transaction. River's GIN
// indexes keep their entries in their pending lists (autovacuum, which
// would merge them too, is off for river_job).
func fillPendingLists(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `ALTER TABLE river_job SET (autovacuum_enabled = false)`); err != nil {
		t.Fatal(err)
	}
	rc, err := river.NewClient(riverpgxv5.New(pool), &river.Config{})
	if err != nil {
		t.Fatal(err)
	}
	params := make([]river.InsertManyParams, n)
	for i := range params {
		f := map[string]string{}
		for k := range 20 {
			f[fmt.Sprintf("k%d", k)] = fmt.Sprintf("v%d-%d", i, k)
		}
		params[i] = river.InsertManyParams{Args: wideArgs{Fields: f}, InsertOpts: &river.InsertOpts{Queue: "gin_clean_test"}}
	}
	if _, err := rc.InsertMany(ctx, params); err != nil {
		t.Fatal(err)
	}
}

// TestGINCleanerMergesPendingLists: as outbox_dispatcher, which owns
// nothing, a call merges the pending lists that River's inserts filled and
// a second call finds them empty; the running cleaner merges what later
// inserts add.
func TestGINCleanerMergesPendingLists(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.NewSchema(t, nil)
	fillPendingLists(t, s.Pool, 2000)

	var calls, sumPages int64
	var mu sync.Mutex
	c, err := outboxriver.NewGINCleaner(pgtest.RolePool(t, s, "outbox_dispatcher"), outboxriver.GINCleanerConfig{
		Interval: 20 * time.Millisecond,
		OnClean: func(pages int64, _ time.Duration) {
			mu.Lock()
			calls++
			sumPages += pages
			mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	pages, err := c.Clean(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if pages == 0 {
		t.Fatal("2,000 inserted jobs left no pending-list page to merge")
	}
	if again, err := c.Clean(ctx); err != nil || again != 0 {
		t.Fatalf("second call merged %d pages (%v), want 0", again, err)
	}
	if calls != 2 || sumPages != pages {
		t.Fatalf("OnClean saw %d calls and %d pages, want 2 and %d", calls, sumPages, pages)
	}

	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Stop(ctx) }()
	_, before := c.Stats()
	fillPendingLists(t, s.Pool, 2000)
	pgtest.WaitFor(t, 30*time.Second, "the running cleaner to merge the pages of 2,000 more jobs", func() bool {
		_, after := c.Stats()
		return after > before
	})
	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if c.Disabled() {
		t.Fatal("cleaner disabled itself")
	}
}

// TestGINCleanerStopsWhenItCannotClean: a function whose owner does not own
// River's indexes (42501), or no function at all (42883, migration 015 not
// applied), stops the cleaner with one warning instead of failing every
// interval; other errors are not that.
func TestGINCleanerStopsWhenItCannotClean(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, sql, want string
	}{
		{"not the owner", `ALTER FUNCTION outbox_river_gin_clean() OWNER TO outbox_operator`, "must be owner"},
		{"no migration 015", `DROP FUNCTION outbox_river_gin_clean()`, "does not exist"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			s := pgtest.NewSchema(t, nil)
			if _, err := s.Pool.Exec(ctx, tc.sql); err != nil {
				t.Fatal(err)
			}
			var logs proctest.SyncBuffer
			c, err := outboxriver.NewGINCleaner(s.Pool, outboxriver.GINCleanerConfig{
				Interval: 10 * time.Millisecond,
				Logger:   slog.New(slog.NewTextHandler(&logs, nil)),
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := c.Start(ctx); err != nil {
				t.Fatal(err)
			}
			defer func() { _ = c.Stop(ctx) }()
			select {
			case <-c.Stopped():
			case <-time.After(30 * time.Second):
				t.Fatalf("cleaner still running after 30 s; log: %s", logs.String())
			}
			if !c.Disabled() {
				t.Fatal("the cleaner stopped without saying it disabled itself")
			}
			// Its goroutine is gone: the log holds every warning it gave.
			out := logs.String()
			if strings.Count(out, "level=WARN") != 1 || !strings.Contains(out, "outbox stops cleaning River's GIN pending lists") || !strings.Contains(out, tc.want) {
				t.Fatalf("want one warning naming %q, got: %s", tc.want, out)
			}
		})
	}
}

// TestNewGINCleanerRefusesBadConfig names the field and the rule.
func TestNewGINCleanerRefusesBadConfig(t *testing.T) {
	t.Parallel()
	if _, err := outboxriver.NewGINCleaner(nil, outboxriver.GINCleanerConfig{}); err == nil || !strings.Contains(err.Error(), "pool") {
		t.Fatalf("nil pool: %v", err)
	}
	// The pool is not used before Start.
	if _, err := outboxriver.NewGINCleaner(new(pgxpool.Pool), outboxriver.GINCleanerConfig{Interval: -time.Second}); err == nil || !strings.Contains(err.Error(), "Interval must not be negative") {
		t.Fatalf("negative interval: %v", err)
	}
}
