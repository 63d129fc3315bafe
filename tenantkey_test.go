package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestDispatchKeyIsPerTenant: the same key from two tenants is two events;
// from the same tenant it is a duplicate of the first; events without a
// tenant form one scope of their own. Through Publish, PublishMany (also
// inside one batch) and outbox_publish.
func TestDispatchKeyIsPerTenant(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{MaxConns: 2})
	ctx := pgtest.Context(t, 60*time.Second)
	paths := map[string]func(tenant, key string) outbox.Published{
		"Publish": func(tenant, key string) (p outbox.Published) {
			if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) (err error) {
				p, err = outbox.Publish(ctx, tx, outbox.Event{Type: "a.b.c", TenantID: tenant, DispatchKey: key})
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return p
		},
		"outbox_publish": func(tenant, key string) (p outbox.Published) {
			var tp *string
			if tenant != "" {
				tp = &tenant
			}
			before := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event`)
			if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('a.b.c', '{}', $1, $2)`, tp, key).Scan(&p.ID); err != nil {
				t.Fatal(err)
			}
			p.Duplicate = pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event`) == before
			return p
		},
	}
	for name, publish := range paths {
		key := "invoice-1:" + name
		a := publish("tenant-a", key)
		b := publish("tenant-b", key)
		none := publish("", key)
		a2 := publish("tenant-a", key)
		none2 := publish("", key)
		if a.Duplicate || b.Duplicate || none.Duplicate || a.ID == b.ID || a.ID == none.ID || b.ID == none.ID {
			t.Errorf("%s: tenants a %+v, b %+v, none %+v: want three events", name, a, b, none)
		}
		if !a2.Duplicate || a2.ID != a.ID {
			t.Errorf("%s: tenant a again = %+v, want a duplicate of %d", name, a2, a.ID)
		}
		if !none2.Duplicate || none2.ID != none.ID {
			t.Errorf("%s: no tenant again = %+v, want a duplicate of %d", name, none2, none.ID)
		}
	}

	var res []outbox.Published
	if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) (err error) {
		res, err = outbox.PublishMany(ctx, tx, []outbox.Event{
			{Type: "a.b.c", TenantID: "tenant-a", DispatchKey: "batch"},
			{Type: "a.b.c", TenantID: "tenant-b", DispatchKey: "batch"},
			{Type: "a.b.c", DispatchKey: "batch"},
			{Type: "a.b.c", TenantID: "tenant-b", DispatchKey: "batch"},
			{Type: "a.b.c", DispatchKey: "batch"},
			{Type: "a.b.c", TenantID: "tenant-a", DispatchKey: "invoice-1:Publish"},
		})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if res[0].Duplicate || res[1].Duplicate || res[2].Duplicate || res[0].ID == res[1].ID || res[1].ID == res[2].ID {
		t.Errorf("PublishMany: %+v, want three events first", res)
	}
	if !res[3].Duplicate || res[3].ID != res[1].ID || !res[4].Duplicate || res[4].ID != res[2].ID {
		t.Errorf("PublishMany: %+v, want 3 and 4 duplicates of 1 and 2", res)
	}
	var stored int64
	if err := s.Pool.QueryRow(context.Background(), `SELECT id FROM outbox_event WHERE tenant_id = 'tenant-a' AND dispatch_key = 'invoice-1:Publish'`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if !res[5].Duplicate || res[5].ID != stored {
		t.Errorf("PublishMany: %+v, want 5 a duplicate of stored %d", res[5], stored)
	}
}
