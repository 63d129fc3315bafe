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
//
// Unknown keys, a rule with both or neither of queue and queues, duplicate
// prefixes and invalid queue names are errors that name the line.
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

func parseRule(n *yaml.Node) (Rule, error) {
	r := Rule{Line: n.Line}
	if n.Kind != yaml.MappingNode {
		return r, fmt.Errorf("line %d: a rule must be a mapping with prefix and queue (or queues)", n.Line)
	}
	var haveQueue, haveQueues, havePrefix bool
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
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
		default:
			return r, fmt.Errorf("line %d: unknown key %q in a rule: allowed keys are prefix, queue, queues", k.Line, k.Value)
		}
	}
	switch {
	case !havePrefix:
		return r, fmt.Errorf("line %d: rule has no prefix", n.Line)
	case haveQueue && haveQueues:
		return r, fmt.Errorf("line %d: rule %q has both queue and queues: use one", n.Line, r.Prefix)
	}
	return r, nil
}
