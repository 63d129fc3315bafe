package lockorder

import (
	"slices"
	"testing"
)

// TestCompareOrdersByTenantKeyQueue: tenant first, then key, then queue,
// by bytes (not by any collation).
func TestCompareOrdersByTenantKeyQueue(t *testing.T) {
	keys := []Key{
		{"b", "a", "a"},
		{"a", "b", "a"},
		{"a", "a", "b"},
		{"a", "a", "a"},
		{"", "Z", "q"},
		{"", "a", "q"},
	}
	slices.SortFunc(keys, Compare)
	want := []Key{{"", "Z", "q"}, {"", "a", "q"}, {"a", "a", "a"}, {"a", "a", "b"}, {"a", "b", "a"}, {"b", "a", "a"}}
	if !slices.Equal(keys, want) {
		t.Fatalf("sorted %v, want %v", keys, want)
	}
	if Compare(Key{"t", "k", "q"}, Key{"t", "k", "q"}) != 0 {
		t.Fatal("equal keys compare unequal")
	}
}
