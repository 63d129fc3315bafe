// Package route maps event types to River queues and job shapes.
//
// A Table holds rules, each an event-type prefix and one or more queues. An
// event goes to the queues of the longest prefix that matches its type; a
// rule with several queues fans out (one River job per queue). Each queue's
// job has a shape (Job): its River kind, its args (the outbox envelope or
// the event payload verbatim), priority, max attempts and tags. Tables are
// loaded from the YAML routes file (Load, Parse) or built in code (New), and
// both paths validate: prefixes must be whole segments, queue names, kinds,
// priorities, attempt limits and tags must be values River accepts, and a
// prefix may appear once. docs/routes.md is the reference.
package route

import (
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"

	"github.com/outboxhq/outbox"
)

// Rule routes the event types starting with Prefix to Queues.
//
// Jobs gives the shape of the job each queue receives (kind, args, priority,
// max attempts, tags). A rule built in code may give Queues only (every
// job gets the default shape: kind outbox_event, envelope args), Jobs only,
// or both when they name the same queues in the same order. New fills in
// the other, so the rules of a Table always have Jobs[i].Queue ==
// Queues[i] and every default spelled out (Kind, Args).
type Rule struct {
	// Prefix is one or more whole type segments ending in a dot ("mail.",
	// "plugin.hook."), or a complete event type for an exact match.
	Prefix string
	// Queues are the River queues that receive one job each.
	Queues []string
	// Jobs are the jobs of the rule, one per queue.
	Jobs []Job
	// Line is the rule's line in the routes file (0 when built in code).
	Line int
}

// Table is an immutable, validated set of rules.
type Table struct {
	// rules sorted by descending prefix length, so the first match is the
	// longest.
	rules []Rule
}

// maxQueueNameLength is River's limit on queue names.
const maxQueueNameLength = 64

var (
	queueNamePattern  = regexp.MustCompile(`^[a-z0-9]+([_-][a-z0-9]+)*$`)
	prefixPattern     = regexp.MustCompile(`^([a-z0-9]+(-[a-z0-9]+)*\.)+$`)
	queueReplaceChars = regexp.MustCompile(`[^a-z0-9]+`)
)

// ValidateQueueName returns an error, with a suggested fix, when River would
// reject name as a queue name.
func ValidateQueueName(name string) error {
	switch {
	case name == "":
		return errors.New("queue name is empty")
	case len(name) > maxQueueNameLength:
		return fmt.Errorf("queue name %q is %d characters, River allows at most %d", name, len(name), maxQueueNameLength)
	case !queueNamePattern.MatchString(name):
		msg := fmt.Sprintf("queue name %q is not valid for River: use lowercase letters and digits separated by single '_' or '-' (no dots)", name)
		if s := suggestQueueName(name); s != "" && s != name {
			msg += fmt.Sprintf("; try %q", s)
		}
		return errors.New(msg)
	}
	return nil
}

// suggestQueueName turns an invalid queue name into a valid one where it
// can ("outbox.mail" → "outbox_mail").
func suggestQueueName(name string) string {
	s := queueReplaceChars.ReplaceAllString(strings.ToLower(name), "_")
	s = strings.Trim(s, "_")
	if len(s) > maxQueueNameLength {
		s = strings.TrimRight(s[:maxQueueNameLength], "_")
	}
	if !queueNamePattern.MatchString(s) {
		return ""
	}
	return s
}

// ValidatePrefix checks a rule's prefix.
func ValidatePrefix(prefix string) error {
	switch {
	case prefix == "":
		return errors.New(`prefix is empty: give whole segments ending in a dot, e.g. "mail."`)
	case prefixPattern.MatchString(prefix), outbox.ValidateType(prefix) == nil:
		return nil
	case prefixPattern.MatchString(prefix + "."):
		return fmt.Errorf("prefix %q must end with a dot so that it matches whole segments: use %q", prefix, prefix+".")
	default:
		return fmt.Errorf("prefix %q must be whole lowercase segments of [a-z0-9] with inner dashes, each ending in a dot (e.g. \"plugin.hook.\"), or a complete event type", prefix)
	}
}

// New validates rules and builds a Table. The error names the rule (its
// prefix and, when known, its line) and the fix.
func New(rules []Rule) (*Table, error) {
	if len(rules) == 0 {
		return nil, errors.New("no routes: give at least one rule (prefix and queue)")
	}
	seen := make(map[string]Rule, len(rules))
	var errs []error
	out := make([]Rule, 0, len(rules))
	for i, r := range rules {
		where := ruleName(i, r)
		if err := ValidatePrefix(r.Prefix); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", where, err))
			continue
		}
		if prev, dup := seen[r.Prefix]; dup {
			errs = append(errs, fmt.Errorf("%s: duplicate prefix %q, first given by %s: merge the two rules (use queues: [...] to fan out)", where, r.Prefix, ruleName(-1, prev)))
			continue
		}
		jobs, jerrs := ruleJobs(r, where)
		if len(jerrs) > 0 {
			errs = append(errs, jerrs...)
			continue
		}
		r.Jobs = jobs
		r.Queues = make([]string, len(jobs))
		for i, j := range jobs {
			r.Queues[i] = j.Queue
		}
		seen[r.Prefix] = r
		out = append(out, r)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	sort.SliceStable(out, func(i, j int) bool { return len(out[i].Prefix) > len(out[j].Prefix) })
	return &Table{rules: out}, nil
}

// ruleJobs returns the validated jobs of r, defaults filled in, from its
// Jobs or its Queues.
func ruleJobs(r Rule, where string) ([]Job, []error) {
	var errs []error
	jobs := make([]Job, 0, max(len(r.Jobs), len(r.Queues)))
	switch {
	case len(r.Jobs) == 0 && len(r.Queues) == 0:
		return nil, []error{fmt.Errorf("%s: no queue: give queue: <name>, queues: [<name>, ...] or jobs: [{queue: <name>, ...}, ...]", where)}
	case len(r.Jobs) == 0:
		for _, q := range r.Queues {
			jobs = append(jobs, Job{Queue: q, Line: r.Line})
		}
	case len(r.Queues) == 0:
		jobs = append(jobs, r.Jobs...)
	default:
		if len(r.Queues) != len(r.Jobs) {
			return nil, []error{fmt.Errorf("%s: Queues has %d names but Jobs has %d jobs: give one of the two, or the same queues in both", where, len(r.Queues), len(r.Jobs))}
		}
		for i, j := range r.Jobs {
			if j.Queue != r.Queues[i] {
				return nil, []error{fmt.Errorf("%s: Queues[%d] is %q but Jobs[%d].Queue is %q: give one of the two, or the same queues in both", where, i, r.Queues[i], i, j.Queue)}
			}
		}
		jobs = append(jobs, r.Jobs...)
	}
	qseen := map[string]bool{}
	for i := range jobs {
		j := &jobs[i]
		at := where
		if j.Line > 0 && j.Line != r.Line {
			at = fmt.Sprintf("%s, job at line %d", where, j.Line)
		}
		if err := ValidateQueueName(j.Queue); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", at, err))
		} else if qseen[j.Queue] {
			errs = append(errs, fmt.Errorf("%s: queue %q is listed twice (one job per queue)", at, j.Queue))
		}
		qseen[j.Queue] = true
		for _, err := range j.normalize() {
			if j.Queue != "" && len(jobs) > 1 {
				err = fmt.Errorf("queue %s: %w", j.Queue, err)
			}
			errs = append(errs, fmt.Errorf("%s: %w", at, err))
		}
	}
	return jobs, errs
}

func ruleName(i int, r Rule) string {
	switch {
	case r.Line > 0:
		return fmt.Sprintf("route at line %d (prefix %q)", r.Line, r.Prefix)
	case i >= 0:
		return fmt.Sprintf("route %d (prefix %q)", i+1, r.Prefix)
	default:
		return fmt.Sprintf("the rule with prefix %q", r.Prefix)
	}
}

// Match returns the rule of the longest prefix matching eventType.
func (t *Table) Match(eventType string) (Rule, bool) {
	for _, r := range t.rules {
		if PrefixMatches(r.Prefix, eventType) {
			return r, true
		}
	}
	return Rule{}, false
}

// PrefixMatches reports whether a rule prefix matches eventType: a prefix
// ending in a dot matches the types that start with it, a complete type
// matches itself, and the empty prefix (a catch-all, which routes refuse
// but receivers' handler registries allow) matches everything.
func PrefixMatches(prefix, eventType string) bool {
	switch {
	case prefix == "":
		return true
	case strings.HasSuffix(prefix, "."):
		return strings.HasPrefix(eventType, prefix)
	default:
		return prefix == eventType
	}
}

// Rules returns the rules, longest prefix first.
func (t *Table) Rules() []Rule { return append([]Rule(nil), t.rules...) }

// AllQueues returns every queue some rule targets, sorted.
func (t *Table) AllQueues() []string {
	set := map[string]bool{}
	for _, r := range t.rules {
		for _, q := range r.Queues {
			set[q] = true
		}
	}
	out := make([]string, 0, len(set))
	for q := range set {
		out = append(out, q)
	}
	sort.Strings(out)
	return out
}
