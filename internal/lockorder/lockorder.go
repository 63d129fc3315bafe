// Package lockorder is the one order in which the outbox takes the row
// locks of outbox_ordering_key (migration 011): the handoff inserts a
// batch's ordered jobs in it (package claim), and the ordered completion
// middleware completes a group's jobs in it (package outboxriver). The
// triggers lock each job's key row as the job is inserted or completed, so
// a handoff and a completion that share two keys queue behind each other
// instead of deadlocking. Both sides must compare with Compare.
package lockorder

import (
	"cmp"
	"strings"
)

// Key is the key row an ordered job's insert or completion locks: its
// tenant ("" for none), ordering key and River queue.
type Key struct {
	Tenant, OrderingKey, Queue string
}

// Compare orders keys by tenant, ordering key and queue, byte by byte.
func Compare(a, b Key) int {
	return cmp.Or(strings.Compare(a.Tenant, b.Tenant), strings.Compare(a.OrderingKey, b.OrderingKey), strings.Compare(a.Queue, b.Queue))
}
