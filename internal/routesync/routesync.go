// Package routesync compares a routes file with the routes that `outboxctl
// routes sync` wrote into the database (outbox_route, migration 008), for
// strict routing at publish: outboxctl writes them, outboxd warns at
// start-up when they differ from its own routes file.
package routesync

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox/route"
)

// Route is one synced rule: its prefix and its queues in file order.
type Route struct {
	Prefix string   `json:"prefix"`
	Queues []string `json:"queues"`
}

// FromTable returns the rules of t as synced routes, sorted by prefix.
func FromTable(t *route.Table) []Route {
	var out []Route
	for _, r := range t.Rules() {
		out = append(out, Route{Prefix: r.Prefix, Queues: slices.Clone(r.Queues)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Prefix < out[j].Prefix })
	return out
}

// JSON is the routes argument of outbox_routes_sync.
func JSON(routes []Route) ([]byte, error) {
	if routes == nil {
		routes = []Route{}
	}
	return json.Marshal(routes)
}

// State is what the database holds.
type State struct {
	Routes []Route
	Strict bool
}

// Querier is a pgx.Tx, *pgx.Conn or *pgxpool.Pool.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ErrNotMigrated is returned by Read when the schema predates migration
// 008 (no outbox_route table).
var ErrNotMigrated = errors.New("outbox_route does not exist: run `outboxctl migrate`")

// Read returns the synced routes (sorted by prefix) and the mode.
func Read(ctx context.Context, q Querier) (State, error) {
	var st State
	if err := q.QueryRow(ctx, `SELECT strict FROM outbox_route_setting`).Scan(&st.Strict); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
			return State{}, ErrNotMigrated
		}
		return State{}, fmt.Errorf("read outbox_route_setting: %w", err)
	}
	rows, err := q.Query(ctx, `SELECT prefix, queues FROM outbox_route ORDER BY prefix`)
	if err != nil {
		return State{}, fmt.Errorf("read outbox_route: %w", err)
	}
	st.Routes, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (Route, error) {
		var rt Route
		return rt, r.Scan(&rt.Prefix, &rt.Queues)
	})
	if err != nil {
		return State{}, fmt.Errorf("read outbox_route: %w", err)
	}
	return st, nil
}

// Drift is how a routes file differs from the synced routes.
type Drift struct {
	// Added are prefixes in the file and not synced: with strict routing
	// on, their events are refused at publish.
	Added []string `json:"added"`
	// Removed are prefixes synced and no longer in the file.
	Removed []string `json:"removed"`
	// Changed are prefixes in both with other queues.
	Changed []string `json:"changed"`
}

// Empty reports whether there is no difference.
func (d Drift) Empty() bool { return len(d.Added)+len(d.Removed)+len(d.Changed) == 0 }

// Compare returns how file differs from synced.
func Compare(file, synced []Route) Drift {
	d := Drift{Added: []string{}, Removed: []string{}, Changed: []string{}}
	have := map[string][]string{}
	for _, r := range synced {
		have[r.Prefix] = r.Queues
	}
	want := map[string]bool{}
	for _, r := range file {
		want[r.Prefix] = true
		q, ok := have[r.Prefix]
		switch {
		case !ok:
			d.Added = append(d.Added, r.Prefix)
		case !slices.Equal(q, r.Queues):
			d.Changed = append(d.Changed, r.Prefix)
		}
	}
	for _, r := range synced {
		if !want[r.Prefix] {
			d.Removed = append(d.Removed, r.Prefix)
		}
	}
	sort.Strings(d.Added)
	sort.Strings(d.Removed)
	sort.Strings(d.Changed)
	return d
}
