package admin

import (
	"testing"

	"github.com/outboxhq/outbox/internal/filter"
)

// TestLimitsAgreeWithFilter: the exported limits are the ones the selection
// is checked against.
func TestLimitsAgreeWithFilter(t *testing.T) {
	t.Parallel()
	if DefaultLimit != filter.DefaultLimit || MaxLimit != filter.MaxLimit || MaxIDs != filter.MaxIDs {
		t.Fatalf("admin limits %d/%d/%d, filter %d/%d/%d", DefaultLimit, MaxLimit, MaxIDs, filter.DefaultLimit, filter.MaxLimit, filter.MaxIDs)
	}
}
