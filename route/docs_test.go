package route_test

import (
	"os"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/route"
)

// Every routes document in docs/routes.md parses, so the reference cannot
// drift from the parser.
func TestRoutesDocExamplesParse(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile("../docs/routes.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := strings.Split(string(data), "```yaml\n")[1:]
	if len(blocks) < 2 {
		t.Fatalf("found %d YAML blocks in docs/routes.md", len(blocks))
	}
	for i, b := range blocks {
		doc, _, _ := strings.Cut(b, "```")
		if _, err := route.Parse([]byte(doc)); err != nil {
			t.Errorf("YAML block %d of docs/routes.md: %v\n%s", i+1, err, doc)
		}
	}
}
