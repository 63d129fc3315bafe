package route

import (
	"errors"
	"fmt"
	"os"

	"gopkg.in/yaml.v3"
)

// Load reads and validates the routes file at path.
func Load(path string) (*Table, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("routes file: %w", err)
	}
	t, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("routes file %s: %w", path, err)
	}
	return t, nil
}

// Parse reads a routes document:
//
//	routes:
//	  - prefix: "mail."
//	    queue: outbox_mail
//	  - prefix: "plugin.hook."
//	    queues: [outbox_plugin-hook, outbox_audit]
//	  - prefix: "billing.invoice.paid"
//	    queue: mail
//	    kind: send_invoice_email     # the job shape of each of the rule's queues
//	    args: payload
//	    priority: 2
//	    max_attempts: 10
//	    tags: [billing]
//	  - prefix: "billing.invoice.refunded"
//	    jobs:                        # a shape per queue
//	      - queue: outbox_audit
//	      - queue: mail
//	        kind: send_refund_email
//	        args: payload
//
// Unknown or repeated keys, a rule with more than one or none of queue,
// queues and jobs, duplicate prefixes, invalid queue names, and job-shape
// values River would refuse are errors that name the line and the fix.
// docs/routes.md is the reference.
func Parse(data []byte) (*Table, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("not valid YAML: %w", err)
	}
	if doc.Kind == 0 || len(doc.Content) == 0 {
		return nil, errors.New("empty: give a routes: list")
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("line %d: the document must be a mapping with a routes: key", root.Line)
	}
	var routesNode *yaml.Node
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		if k.Value != "routes" {
			return nil, fmt.Errorf("line %d: unknown key %q: the only top-level key is routes", k.Line, k.Value)
		}
		routesNode = v
	}
	if routesNode == nil {
		return nil, errors.New("no routes: key")
	}
	if routesNode.Kind != yaml.SequenceNode {
		return nil, fmt.Errorf("line %d: routes must be a list of rules", routesNode.Line)
	}
	if len(routesNode.Content) == 0 {
		return nil, fmt.Errorf("line %d: routes is empty: give at least one rule", routesNode.Line)
	}
	rules := make([]Rule, 0, len(routesNode.Content))
	for _, n := range routesNode.Content {
		r, err := parseRule(n)
		if err != nil {
			return nil, err
		}
		rules = append(rules, r)
	}
	return New(rules)
}

const (
	ruleKeys  = "prefix, queue, queues, jobs, kind, args, priority, max_attempts, tags"
	jobKeys   = "queue, kind, args, priority, max_attempts, tags"
	shapeKeys = "kind, args, priority, max_attempts, tags"
)

func parseRule(n *yaml.Node) (Rule, error) {
	r := Rule{Line: n.Line}
	if n.Kind != yaml.MappingNode {
		return r, fmt.Errorf("line %d: a rule must be a mapping with prefix and queue (or queues, or jobs)", n.Line)
	}
	var (
		haveQueue, haveQueues, havePrefix, haveJobs bool
		shape                                       = Job{Line: n.Line}
		shapeKey                                    *yaml.Node
		keys                                        = map[string]int{}
	)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if prev, dup := keys[k.Value]; dup {
			return r, fmt.Errorf("line %d: key %q is given twice in one rule (first at line %d): keep one", k.Line, k.Value, prev)
		}
		keys[k.Value] = k.Line
		switch k.Value {
		case "prefix":
			if v.Kind != yaml.ScalarNode {
				return r, fmt.Errorf("line %d: prefix must be a string", v.Line)
			}
			r.Prefix, havePrefix = v.Value, true
		case "queue":
			if v.Kind != yaml.ScalarNode {
				return r, fmt.Errorf("line %d: queue must be a single name; use queues: [...] for several", v.Line)
			}
			r.Queues, haveQueue = append(r.Queues, v.Value), true
		case "queues":
			if v.Kind != yaml.SequenceNode {
				return r, fmt.Errorf("line %d: queues must be a list, e.g. [outbox_mail, outbox_audit]", v.Line)
			}
			for _, q := range v.Content {
				if q.Kind != yaml.ScalarNode {
					return r, fmt.Errorf("line %d: each queue must be a name", q.Line)
				}
				r.Queues = append(r.Queues, q.Value)
			}
			haveQueues = true
		case "jobs":
			if v.Kind != yaml.SequenceNode || len(v.Content) == 0 {
				return r, fmt.Errorf("line %d: jobs must be a non-empty list of jobs, each with a queue and its shape, e.g. [{queue: outbox_audit}, {queue: mail, kind: send_invoice_email, args: payload}]", v.Line)
			}
			for _, jn := range v.Content {
				j, err := parseJob(jn)
				if err != nil {
					return r, err
				}
				r.Jobs = append(r.Jobs, j)
			}
			haveJobs = true
		default:
			ok, err := parseShapeKey(&shape, k, v)
			if err != nil {
				return r, err
			}
			if !ok {
				return r, fmt.Errorf("line %d: unknown key %q in a rule: allowed keys are %s", k.Line, k.Value, ruleKeys)
			}
			if shapeKey == nil {
				shapeKey = k
			}
		}
	}
	switch {
	case !havePrefix:
		return r, fmt.Errorf("line %d: rule has no prefix", n.Line)
	case haveQueue && haveQueues:
		return r, fmt.Errorf("line %d: rule %q has both queue and queues: use one", n.Line, r.Prefix)
	case haveJobs && (haveQueue || haveQueues):
		return r, fmt.Errorf("line %d: rule %q has both jobs and queue(s): list every queue under jobs", n.Line, r.Prefix)
	case haveJobs && shapeKey != nil:
		return r, fmt.Errorf("line %d: rule %q has jobs and a rule-level %s: with jobs, give %s in each job", shapeKey.Line, r.Prefix, shapeKey.Value, shapeKeys)
	}
	if !haveJobs && shapeKey != nil {
		// The rule's shape applies to each of its queues.
		for _, q := range r.Queues {
			j := shape
			j.Queue = q
			r.Jobs = append(r.Jobs, j)
		}
		r.Queues = nil
	}
	return r, nil
}

// parseJob reads one entry of a rule's jobs: list.
func parseJob(n *yaml.Node) (Job, error) {
	j := Job{Line: n.Line}
	if n.Kind != yaml.MappingNode {
		return j, fmt.Errorf("line %d: a job must be a mapping with a queue and its shape (%s)", n.Line, shapeKeys)
	}
	keys := map[string]int{}
	haveQueue := false
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if prev, dup := keys[k.Value]; dup {
			return j, fmt.Errorf("line %d: key %q is given twice in one job (first at line %d): keep one", k.Line, k.Value, prev)
		}
		keys[k.Value] = k.Line
		if k.Value == "queue" {
			if v.Kind != yaml.ScalarNode {
				return j, fmt.Errorf("line %d: a job's queue must be a single name; list one job per queue", v.Line)
			}
			j.Queue, haveQueue = v.Value, true
			continue
		}
		ok, err := parseShapeKey(&j, k, v)
		if err != nil {
			return j, err
		}
		if !ok {
			return j, fmt.Errorf("line %d: unknown key %q in a job: allowed keys are %s", k.Line, k.Value, jobKeys)
		}
	}
	if !haveQueue {
		return j, fmt.Errorf("line %d: job has no queue: give queue: <name>", n.Line)
	}
	return j, nil
}

// parseShapeKey reads one job-shape key (kind, args, priority,
// max_attempts, tags) into j and validates its value, naming its line. It
// reports false for any other key.
func parseShapeKey(j *Job, k, v *yaml.Node) (bool, error) {
	switch k.Value {
	case "kind":
		if v.Kind != yaml.ScalarNode {
			return true, fmt.Errorf("line %d: kind must be a string, the kind of your River worker's args", v.Line)
		}
		if err := validateKind(v.Value); err != nil {
			return true, fmt.Errorf("line %d: %w", v.Line, err)
		}
		j.Kind = v.Value
	case "args":
		if v.Kind != yaml.ScalarNode || v.Value == "" {
			return true, fmt.Errorf("line %d: args must be envelope or payload", v.Line)
		}
		if err := validateArgs(Args(v.Value)); err != nil {
			return true, fmt.Errorf("line %d: %w", v.Line, err)
		}
		j.Args = Args(v.Value)
	case "priority":
		p, err := intValue(v, "priority", "1 (highest) to 4 (lowest)")
		if err != nil {
			return true, err
		}
		if err := validatePriority(p); err != nil {
			return true, fmt.Errorf("line %d: %w", v.Line, err)
		}
		j.Priority = p
	case "max_attempts":
		m, err := intValue(v, "max_attempts", fmt.Sprintf("1 to %d", maxMaxAttempts))
		if err != nil {
			return true, err
		}
		if err := validateMaxAttempts(m); err != nil {
			return true, fmt.Errorf("line %d: %w", v.Line, err)
		}
		j.MaxAttempts = m
	case "tags":
		if v.Kind != yaml.SequenceNode {
			return true, fmt.Errorf("line %d: tags must be a list, e.g. [billing, invoice]", v.Line)
		}
		j.Tags = make([]string, 0, len(v.Content))
		for _, t := range v.Content {
			if t.Kind != yaml.ScalarNode {
				return true, fmt.Errorf("line %d: each tag must be a string", t.Line)
			}
			if err := validateTag(t.Value); err != nil {
				return true, fmt.Errorf("line %d: %w", t.Line, err)
			}
			j.Tags = append(j.Tags, t.Value)
		}
	default:
		return false, nil
	}
	return true, nil
}

// intValue reads an integer scalar.
func intValue(v *yaml.Node, key, want string) (int, error) {
	var n int
	if v.Kind != yaml.ScalarNode || v.ShortTag() != "!!int" || v.Decode(&n) != nil {
		return 0, fmt.Errorf("line %d: %s must be an integer, %s", v.Line, key, want)
	}
	return n, nil
}
