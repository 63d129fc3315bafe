package jsonlimit

import (
	"encoding/json"
	"strings"
	"testing"
)

func nested(n int) []byte {
	return []byte(strings.Repeat("[", n) + strings.Repeat("]", n))
}

func TestDepth(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in   string
		want int
	}{
		{`1`, 0},
		{`"[[["`, 0},
		{`{}`, 1},
		{`[]`, 1},
		{`{"a":[]}`, 2},
		{`{"a":"\"[{","b":[[1],{"c":{}}]}`, 4},
		{`[[],[],[[]]]`, 3},
	}
	for _, c := range cases {
		if got := Depth([]byte(c.in)); got != c.want {
			t.Errorf("Depth(%s) = %d, want %d", c.in, got, c.want)
		}
		if Exceeds([]byte(c.in), c.want) || (c.want > 0 && !Exceeds([]byte(c.in), c.want-1)) {
			t.Errorf("Exceeds(%s) disagrees with depth %d", c.in, c.want)
		}
	}
}

// TestMaxDepthDecodesInsideArgs checks the reason for MaxDepth: a payload at
// the limit, wrapped in one more object (the River job args), still decodes
// with encoding/json, and Go's own limit is far beyond it.
func TestMaxDepthDecodesInsideArgs(t *testing.T) {
	t.Parallel()
	p := nested(MaxDepth)
	if Depth(p) != MaxDepth || Exceeds(p, MaxDepth) {
		t.Fatalf("Depth = %d", Depth(p))
	}
	args := append(append([]byte(`{"payload":`), p...), '}')
	var v struct{ Payload json.RawMessage }
	if err := json.Unmarshal(args, &v); err != nil {
		t.Fatalf("args at MaxDepth do not decode: %v", err)
	}
	// encoding/json's own limit (10,000) is what MaxDepth stays clear of.
	if err := json.Unmarshal(nested(10001), new(any)); err == nil {
		t.Fatal("encoding/json accepted 10,001 levels; its limit changed, revisit MaxDepth")
	}
}
