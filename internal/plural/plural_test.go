package plural

import "testing"

func TestOf(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		n    int64
		want string
	}{{0, "0 batches"}, {1, "1 batch"}, {2, "2 batches"}, {-1, "-1 batches"}} {
		if got := Of(c.n, "batch", "batches"); got != c.want {
			t.Errorf("Of(%d) = %q, want %q", c.n, got, c.want)
		}
	}
}
