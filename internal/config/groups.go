package config

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	outboxriver "github.com/outboxhq/outbox/river"
	"github.com/outboxhq/outbox/route"
)

// Group is a named set of queues worked by one kind of process, for
// example a "general" group (with the dispatcher) working outbox_workflow,
// and a "mail" group working outbox_mail and outbox_webhook.
type Group struct {
	Name   string
	Queues []outboxriver.Queue
}

// QueueNames returns the group's queue names in the order given.
func (g Group) QueueNames() []string {
	out := make([]string, len(g.Queues))
	for i, q := range g.Queues {
		out[i] = q.Name
	}
	return out
}

var groupNamePattern = regexp.MustCompile(`^[a-z0-9]+([_-][a-z0-9]+)*$`)

// ParseQueues parses a comma-separated queue list, the syntax of
// OUTBOX_WORKER_QUEUES:
//
//	outbox_mail:20,outbox_webhook,outbox_marketing:5:cooldown=5ms:poll=200ms
//
// Each item is a queue name, then optional ':'-separated settings: a bare
// number (MaxWorkers), workers=N, cooldown=DURATION (FetchCooldown) and
// poll=DURATION (FetchPollInterval), durations as Go writes them ("5ms",
// "1s"). Spaces around items are ignored. A queue listed twice is an error.
func ParseQueues(spec string) ([]outboxriver.Queue, error) {
	var (
		out  []outboxriver.Queue
		errs []error
		seen = map[string]bool{}
	)
	for item := range strings.SplitSeq(spec, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		q, err := parseQueue(item)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if seen[q.Name] {
			errs = append(errs, fmt.Errorf("queue %q is listed twice", q.Name))
			continue
		}
		seen[q.Name] = true
		out = append(out, q)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

func parseQueue(item string) (outboxriver.Queue, error) {
	parts := strings.Split(item, ":")
	q := outboxriver.Queue{Name: strings.TrimSpace(parts[0])}
	if err := route.ValidateQueueName(q.Name); err != nil {
		return q, fmt.Errorf("%q: %w", item, err)
	}
	for _, p := range parts[1:] {
		p = strings.TrimSpace(p)
		key, val, hasKey := strings.Cut(p, "=")
		if !hasKey {
			key, val = "workers", p
		}
		switch key {
		case "workers":
			n, err := strconv.Atoi(val)
			if err != nil || n < 1 || n > river.QueueNumWorkersMax {
				return q, fmt.Errorf("%q: max workers %q must be a whole number from 1 to %d", item, val, river.QueueNumWorkersMax)
			}
			q.MaxWorkers = n
		case "cooldown", "poll":
			d, err := time.ParseDuration(val)
			if err != nil || d <= 0 {
				return q, fmt.Errorf("%q: %s=%q must be a positive duration such as 5ms or 1s", item, key, val)
			}
			if key == "cooldown" {
				if d < time.Millisecond {
					return q, fmt.Errorf("%q: cooldown=%s is below River's minimum of 1ms", item, d)
				}
				q.FetchCooldown = d
			} else {
				q.FetchPollInterval = d
			}
		default:
			return q, fmt.Errorf("%q: unknown setting %q: use a number (max workers), workers=N, cooldown=DURATION or poll=DURATION", item, key)
		}
	}
	if q.FetchCooldown > 0 && q.FetchPollInterval > 0 && q.FetchPollInterval < q.FetchCooldown {
		return q, fmt.Errorf("%q: poll=%s must not be shorter than cooldown=%s", item, q.FetchPollInterval, q.FetchCooldown)
	}
	return q, nil
}

// ParseGroups parses a ';'-separated list of groups, the syntax of
// OUTBOX_WORKER_GROUPS:
//
//	general=outbox_workflow,outbox_notification; mail=outbox_mail:20,outbox_webhook
//
// Each group is NAME=QUEUES, QUEUES in the syntax of ParseQueues; a name is
// lowercase letters and digits with single '_' or '-' separators.
func ParseGroups(spec string) ([]Group, error) {
	var (
		out  []Group
		errs []error
		seen = map[string]bool{}
	)
	for item := range strings.SplitSeq(spec, ";") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, queues, ok := strings.Cut(item, "=")
		name = strings.TrimSpace(name)
		if !ok {
			errs = append(errs, fmt.Errorf("%q: want NAME=QUEUE[,QUEUE...], e.g. mail=outbox_mail,outbox_webhook", item))
			continue
		}
		if !groupNamePattern.MatchString(name) || len(name) > 64 {
			errs = append(errs, fmt.Errorf("group name %q: use lowercase letters and digits with single '_' or '-' separators, at most 64 characters", name))
			continue
		}
		if seen[name] {
			errs = append(errs, fmt.Errorf("group %q is defined twice", name))
			continue
		}
		seen[name] = true
		qs, err := ParseQueues(queues)
		if err != nil {
			errs = append(errs, fmt.Errorf("group %q: %w", name, err))
			continue
		}
		if len(qs) == 0 {
			errs = append(errs, fmt.Errorf("group %q lists no queue", name))
			continue
		}
		out = append(out, Group{Name: name, Queues: qs})
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

// FindGroup returns the group called name.
func FindGroup(groups []Group, name string) (Group, bool) {
	for _, g := range groups {
		if g.Name == name {
			return g, true
		}
	}
	return Group{}, false
}

// UnworkedQueues returns the queues that routes target and that no group
// works, sorted: events routed there become River jobs that nothing runs.
// outboxd warns about them at start-up and `outboxctl stats` reports them.
func UnworkedQueues(routes *route.Table, groups []Group) []string {
	worked := map[string]bool{}
	for _, g := range groups {
		for _, q := range g.Queues {
			worked[q.Name] = true
		}
	}
	var out []string
	for _, q := range routes.AllQueues() {
		if !worked[q] {
			out = append(out, q)
		}
	}
	return out
}

// UnroutedQueues returns the queues of queues that no route targets, in
// the order given: a worker there waits for jobs the dispatcher never
// creates (a typo, or a route that was removed). outboxd warns about them
// at start-up.
func UnroutedQueues(routes *route.Table, queues []outboxriver.Queue) []string {
	routed := map[string]bool{}
	for _, q := range routes.AllQueues() {
		routed[q] = true
	}
	var out []string
	for _, q := range queues {
		if !routed[q.Name] {
			out = append(out, q.Name)
		}
	}
	return out
}

// Querier is what ActiveQueues needs: a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// activeQueuesSQL lists the queues that a running River client works:
// River's producers upsert their queue into river_queue when they start
// and every 10 minutes after (QueueReportInterval), and skip paused queues'
// work.
const activeQueuesSQL = `
SELECT name FROM river_queue
WHERE updated_at > now() - make_interval(secs => $1) AND paused_at IS NULL
ORDER BY name`

// DefaultActiveWithin is ActiveQueues' window: twice River's report
// interval of 10 minutes.
const DefaultActiveWithin = 20 * time.Minute

// ActiveQueues returns, sorted, the queues some River client reported
// working within the last within (0 means DefaultActiveWithin) and that are
// not paused. A client that stopped less than 10 minutes ago may still be
// listed. `outboxctl stats` compares them with routes.AllQueues() when no
// OUTBOX_WORKER_GROUPS declares the groups.
func ActiveQueues(ctx context.Context, db Querier, within time.Duration) ([]string, error) {
	if within <= 0 {
		within = DefaultActiveWithin
	}
	rows, err := db.Query(ctx, activeQueuesSQL, within.Seconds())
	if err != nil {
		return nil, fmt.Errorf("read river_queue: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read river_queue: %w", err)
	}
	sort.Strings(names)
	return names, nil
}
