// Package route maps event types to River queues.
//
// A Table holds rules, each an event-type prefix and one or more queues. An
// event goes to the queues of the longest prefix that matches its type; a
// rule with several queues fans out (one River job per queue). Tables are
// loaded from the YAML routes file (Load, Parse) or built in code (New), and
// both paths validate: prefixes must be whole segments, queue names must be
// names River accepts, and a prefix may appear once.
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
type Rule struct {
	// Prefix is one or more whole type segments ending in a dot ("mail.",
	// "plugin.hook."), or a complete event type for an exact match.
	Prefix string
	// Queues are the River queues that receive one job each.
	Queues []string
	// Line is the rule's line in the routes file (0 when built in code).
	Line int
}

// Table is an immutable, validated set of rules.
type Table struct {
	// rules sorted by descending prefix length, so the first match is the
	// longest.
	rules []Rule
}

// MaxQueueNameLength is River's limit on queue names.
const MaxQueueNameLength = 64

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
	case len(name) > MaxQueueNameLength:
		return fmt.Errorf("queue name %q is %d characters, River allows at most %d", name, len(name), MaxQueueNameLength)
	case !queueNamePattern.MatchString(name):
		msg := fmt.Sprintf("queue name %q is not valid for River: use lowercase letters and digits separated by single '_' or '-' (no dots)", name)
		if s := SuggestQueueName(name); s != "" && s != name {
			msg += fmt.Sprintf("; try %q", s)
		}
		return errors.New(msg)
	}
	return nil
}

// SuggestQueueName turns an invalid queue name into a valid one where it
// can ("outbox.mail" → "outbox_mail").
func SuggestQueueName(name string) string {
	s := queueReplaceChars.ReplaceAllString(strings.ToLower(name), "_")
	s = strings.Trim(s, "_")
	if len(s) > MaxQueueNameLength {
		s = strings.TrimRight(s[:MaxQueueNameLength], "_")
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
		if len(r.Queues) == 0 {
			errs = append(errs, fmt.Errorf("%s: no queue: give queue: <name> or queues: [<name>, ...]", where))
			continue
		}
		queues := make([]string, 0, len(r.Queues))
		qseen := map[string]bool{}
		bad := false
		for _, q := range r.Queues {
			if err := ValidateQueueName(q); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", where, err))
				bad = true
				continue
			}
			if qseen[q] {
				errs = append(errs, fmt.Errorf("%s: queue %q is listed twice", where, q))
				bad = true
				continue
			}
			qseen[q] = true
			queues = append(queues, q)
		}
		if bad {
			continue
		}
		r.Queues = queues
		seen[r.Prefix] = r
		out = append(out, r)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	sort.SliceStable(out, func(i, j int) bool { return len(out[i].Prefix) > len(out[j].Prefix) })
	return &Table{rules: out}, nil
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
