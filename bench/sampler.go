package main

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// waitSampler samples pg_stat_activity every 10 ms while a measurement
// runs and counts what the bench database's active backends are doing
// (wait_event_type:wait_event, or "CPU" when active and not waiting): the
// lock waits and I/O waits that limit a scenario.
type waitSampler struct {
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	counts map[string]int
	total  int
}

func startSampler(ctx context.Context, p *pgxpool.Pool, appLike string) *waitSampler {
	ctx, cancel := context.WithCancel(ctx)
	s := &waitSampler{cancel: cancel, done: make(chan struct{}), counts: map[string]int{}}
	go func() {
		defer close(s.done)
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			rows, err := p.Query(ctx, `
SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU'), count(*)
FROM pg_stat_activity
WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()
  AND application_name LIKE $1
GROUP BY 1`, appLike)
			if err != nil {
				continue
			}
			s.mu.Lock()
			for rows.Next() {
				var k string
				var n int
				if rows.Scan(&k, &n) == nil {
					s.counts[k] += n
					s.total += n
				}
			}
			s.mu.Unlock()
			rows.Close()
		}
	}()
	return s
}

// stop ends sampling and returns the top events as "event 42%" strings.
func (s *waitSampler) stop() []string {
	s.cancel()
	<-s.done
	return s.top()
}

// top returns the top events as "event 42%" strings.
func (s *waitSampler) top() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	type kv struct {
		k string
		n int
	}
	var all []kv
	for k, n := range s.counts {
		all = append(all, kv{k, n})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].n > all[j].n })
	var out []string
	for i, e := range all {
		if i == 6 {
			break
		}
		out = append(out, fmt.Sprintf("%s %.0f%%", strings.TrimSpace(e.k), 100*float64(e.n)/float64(max(s.total, 1))))
	}
	return out
}

// roleSampler is a waitSampler per role: one query every interval counts
// the active backends of the bench database by application_name, and
// roles maps an application_name to the role it counts for (names not
// in it are ignored).
type roleSampler struct {
	cancel context.CancelFunc
	done   chan struct{}
	roles  map[string]string
	mu     sync.Mutex
	by     map[string]*waitSampler
}

func startRoleSampler(ctx context.Context, p *pgxpool.Pool, interval time.Duration, roles map[string]string) *roleSampler {
	ctx, cancel := context.WithCancel(ctx)
	s := &roleSampler{cancel: cancel, done: make(chan struct{}), roles: roles, by: map[string]*waitSampler{}}
	for _, r := range roles {
		s.by[r] = &waitSampler{counts: map[string]int{}}
	}
	go func() {
		defer close(s.done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			rows, err := p.Query(ctx, `
SELECT application_name, coalesce(wait_event_type || ':' || wait_event, 'CPU'), count(*)
FROM pg_stat_activity
WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()
GROUP BY 1, 2`)
			if err != nil {
				continue
			}
			s.mu.Lock()
			for rows.Next() {
				var app, k string
				var n int
				if rows.Scan(&app, &k, &n) != nil {
					continue
				}
				if w := s.by[s.roles[app]]; w != nil {
					w.counts[k] += n
					w.total += n
				}
			}
			s.mu.Unlock()
			rows.Close()
		}
	}()
	return s
}

// stop ends sampling and returns each role's top events (roles never seen
// active are left out).
func (s *roleSampler) stop() map[string][]string {
	s.cancel()
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string][]string{}
	for r, w := range s.by {
		if w.total == 0 {
			continue
		}
		out[r] = w.top()
	}
	return out
}
