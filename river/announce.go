package outboxriver

import (
	"fmt"
	"slices"
)

// AnnounceSQL sends River's insert notification for each payload of $1
// (AnnouncePayloads) in the caller's transaction, so that the workers of
// those queues fetch as soon as it commits.
//
// River announces an insert itself, but at most once per FetchCooldown per
// inserting client and queue (River's minimum is 1 ms), decided when the
// insert runs, and it sends no trailing notification: the jobs of a second
// batch inserted inside that window wait for the next notification or for
// the workers' FetchPollInterval. A caller that inserts many batches a
// second (the dispatcher announces its own in the same format, in the
// statement that hands its batch off) announces each batch's queues here. Within one
// transaction Postgres delivers identical notifications (same channel,
// same payload) once, so a batch whose insert River did announce costs
// nothing more.
//
// The channel and the payload are River's (riverpgxv5 PGNotifyMany and
// maybeNotifyInsertForQueues: "<schema>.river_insert", {"queue": "<name>"},
// the schema being current_schema() for a client without Config.Schema, as
// NewInsertClient's is). TestAnnounceFoldsIntoRiversNotification and, for
// the dispatcher's handoff, TestEveryBatchWakesTheWorkers (claim) fail if
// a River upgrade changes them.
const AnnounceSQL = `SELECT pg_notify(current_schema() || '.river_insert', p) FROM unnest($1::text[]) AS p`

// AnnouncePayloads returns the payloads of AnnounceSQL for queues: one per
// distinct queue, in River's format.
func AnnouncePayloads(queues []string) []string {
	qs := slices.Clone(queues)
	slices.Sort(qs)
	qs = slices.Compact(qs)
	out := make([]string, len(qs))
	for i, q := range qs {
		out[i] = fmt.Sprintf("{\"queue\": %q}", q)
	}
	return out
}
