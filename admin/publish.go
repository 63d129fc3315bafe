package admin

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox"
)

// Publish publishes one event in a transaction of its own, for an operator
// (a test event, a manual replay of a lost one). Producers publish inside
// their own transaction with outbox.Publish instead. Invalid input is
// refused before anything is written (outbox.ValidateEvent), and a
// duplicate dispatch key returns the existing event with Duplicate set.
// An ev.OrderingKey puts the event in its (tenant, key) order after every
// event of the key committed before it, as for any producer (outboxctl
// publish --ordering-key).
func (c *Client) Publish(ctx context.Context, ev outbox.Event) (outbox.Published, error) {
	var res outbox.Published
	err := pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		var err error
		res, err = outbox.Publish(ctx, tx, ev)
		return err
	})
	return res, c.explain(ctx, err)
}
