// Package outbox is a transactional outbox for Postgres that hands events to
// River jobs in the same database.
//
// A producer writes its business change and an event in one transaction:
//
//	tx, _ := pool.Begin(ctx)
//	// ... the business change ...
//	res, err := outbox.Publish(ctx, tx, outbox.Event{
//		Type:    "billing.invoice.paid",
//		Payload: json.RawMessage(`{"invoice_id": 42}`),
//	})
//	// ...
//	err = tx.Commit(ctx)
//
// Publish and PublishMany take a pgx.Tx, so publishing outside a transaction
// does not compile. When the transaction commits, the dispatcher (package
// dispatcher, run by cmd/outboxd) wakes, claims the event, routes it by its
// type to one or more River queues and inserts the River jobs in the same
// transaction that marks the event done: the handoff is exactly-once.
//
// Producers in other languages call the SQL function outbox_publish(event_type,
// payload, tenant_id, dispatch_key), which applies the same rules.
package outbox
