package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxsql "github.com/outboxhq/outbox/sql"
)

// exampleSchema gives an example its own migrated schema and drops it after.
func exampleSchema(ctx context.Context) (*pgxpool.Pool, func()) {
	admin, err := pgx.Connect(ctx, pgtest.URL())
	if err != nil {
		panic(err)
	}
	name := fmt.Sprintf("example_%d", os.Getpid())
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+name); err != nil {
		panic(err)
	}
	pool, err := pgxpool.New(ctx, pgtest.WithSearchPath(pgtest.URL(), name))
	if err != nil {
		panic(err)
	}
	if _, err := outboxsql.Migrate(ctx, pool, nil); err != nil {
		panic(err)
	}
	return pool, func() {
		pool.Close()
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+name+" CASCADE")
		admin.Close(ctx)
	}
}

// Publish writes the business change and its event in one transaction:
// both commit together or not at all.
func ExamplePublish() {
	ctx := context.Background()
	pool, done := exampleSchema(ctx)
	defer done()
	if _, err := pool.Exec(ctx, `CREATE TABLE invoice (id int PRIMARY KEY, paid bool NOT NULL DEFAULT false)`); err != nil {
		panic(err)
	}

	pay := func(invoiceID int) (outbox.Published, error) {
		var res outbox.Published
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO invoice (id, paid) VALUES ($1, true) ON CONFLICT (id) DO UPDATE SET paid = true`, invoiceID); err != nil {
				return err
			}
			payload, _ := json.Marshal(map[string]int{"invoice_id": invoiceID})
			var err error
			res, err = outbox.Publish(ctx, tx, outbox.Event{
				Type:        "billing.invoice.paid",
				TenantID:    "acme",
				Payload:     payload,
				DispatchKey: fmt.Sprintf("invoice:%d:paid", invoiceID),
			})
			return err
		})
		return res, err
	}

	first, err := pay(42)
	if err != nil {
		panic(err)
	}
	again, err := pay(42) // a retried request: same dispatch key
	if err != nil {
		panic(err)
	}
	fmt.Println("duplicate:", again.Duplicate, "same id:", again.ID == first.ID)

	_, err = pay(-1)
	fmt.Println("negative invoice ids are fine for the outbox:", err == nil)

	_, err = outbox.PublishMany(ctx, nil, []outbox.Event{{Type: "Billing.Invoice"}})
	fmt.Println(err)
	// Output:
	// duplicate: true same id: true
	// negative invoice ids are fine for the outbox: true
	// outbox: event 0: Type "Billing.Invoice" must be at least three dot-separated segments of lowercase [a-z0-9] with inner dashes, e.g. billing.invoice.paid
}

// PublishMany writes a batch in one round trip and returns one result per
// event, in order.
func ExamplePublishMany() {
	ctx := context.Background()
	pool, done := exampleSchema(ctx)
	defer done()

	var res []outbox.Published
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		res, err = outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "search.index.updated", Payload: json.RawMessage(`{"doc": 1}`)},
			{Type: "audit.document.edited", Payload: json.RawMessage(`{"doc": 1}`), TenantID: "acme"},
		})
		return err
	})
	if err != nil {
		panic(err)
	}
	fmt.Println(len(res), res[0].ID < res[1].ID)
	// Output: 2 true
}
