package admin_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/retention"
	"github.com/outboxhq/outbox/route"
)

// A selection by status alone is refused unless it says All; the error
// names the rule, and a bad field names its flag.
func ExampleCheckRequeue() {
	_, err := admin.CheckRequeue(admin.Selection{}, admin.RequeueOpts{Actor: "alice"})
	fmt.Println(err)

	_, err = admin.CheckRequeue(admin.Selection{All: true, Statuses: []string{"pending"}}, admin.RequeueOpts{Actor: "alice"})
	var serr *admin.SelectionError
	if errors.As(err, &serr) {
		fmt.Println(serr.Flag)
	}

	sel, err := admin.CheckRequeue(admin.Selection{TypePrefix: "mail."}, admin.RequeueOpts{Actor: "alice"})
	fmt.Println(sel.Statuses, sel.Limit, err)
	// Output:
	// refusing to requeue every failed event without a filter: narrow the selection with --id, --type-prefix, --tenant, --since, --until or --error-contains, or pass --all to mean it (at most --limit=1000 events per run)
	// status
	// [failed] 1000 <nil>
}

func ExampleRequeueStatuses() {
	r := admin.RequeueStatuses(false)
	fmt.Println(r.Eligible, r.Default, r.DefaultByID)
	r = admin.RequeueStatuses(true)
	fmt.Println(r.Eligible, r.Default, r.DefaultByID)
	c := admin.CancelStatuses()
	fmt.Println(c.Eligible, c.Default, c.DefaultByID)
	// Output:
	// [failed cancelled processing] [failed] [failed cancelled processing]
	// [failed cancelled processing done] [failed] [failed cancelled processing done]
	// [pending failed processing] [pending failed] [pending failed processing]
}

// Requeue the failed mail events of one tenant from the last day: first a
// dry run, then the change, which is audited.
func ExampleClient_Requeue() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	cl := admin.New(pool)

	since := time.Now().Add(-24 * time.Hour)
	sel := admin.Selection{TypePrefix: "mail.", Tenant: "acme", Since: &since}
	dry, err := cl.Requeue(ctx, sel, admin.RequeueOpts{Actor: "alice", DryRun: true})
	if err != nil {
		log.Print(err)
		return
	}
	fmt.Printf("%d events would be requeued, %d beyond the limit\n", dry.Affected, dry.Remaining)

	res, err := cl.Requeue(ctx, sel, admin.RequeueOpts{Actor: "alice"})
	if err != nil {
		log.Print(err)
		return
	}
	fmt.Printf("requeued %v, audit #%d\n", res.IDs, res.AuditID)
}

// Cancel two events by id.
func ExampleClient_Cancel() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	res, err := admin.New(pool).Cancel(ctx, admin.Selection{IDs: []int64{41, 42}}, admin.CancelOpts{Actor: "alice"})
	if err != nil {
		log.Print(err)
		return
	}
	fmt.Println(res.Affected, res.Skipped)
}

// A health probe: alert on anything outboxctl stats --check would.
func ExampleClient_Stats() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	routes, err := route.Load(os.Getenv("OUTBOX_ROUTES_FILE"))
	if err != nil {
		log.Print(err)
		return
	}

	st, err := admin.New(pool).Stats(ctx, admin.StatsOpts{Routes: routes, Thresholds: admin.DefaultThresholds()})
	if errors.Is(err, admin.ErrSchemaMissing) {
		log.Print(err) // run `outboxctl migrate` first
		return
	}
	if err != nil {
		log.Print(err)
		return
	}
	for _, a := range st.Alerts {
		fmt.Printf("ALERT %s: %s\n", a.Name, a.Message)
	}
}

func ExampleClient_Explain() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	ex, err := admin.New(pool).Explain(ctx, 42, admin.ExplainOpts{})
	if errors.Is(err, admin.ErrNotFound) {
		fmt.Println("no such event (or purged after it was done)")
		return
	}
	if err != nil {
		log.Print(err)
		return
	}
	fmt.Println(ex.Event.Status)
	for _, j := range ex.Jobs {
		fmt.Println(j.ID, j.Queue, j.State)
	}
}

func ExampleClient_AuditList() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	list, err := admin.New(pool).AuditList(ctx, admin.AuditOpts{Action: "requeue", Limit: 10})
	if err != nil {
		log.Print(err)
		return
	}
	for _, a := range list {
		fmt.Println(a.At, a.Actor, a.Affected, string(a.Filter))
	}
}

func ExampleClient_RetentionRun() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	res, err := admin.New(pool).RetentionRun(ctx, admin.RetentionOpts{MaxAge: 30 * 24 * time.Hour, Actor: "cron"})
	if errors.Is(err, retention.ErrLocked) {
		return // outboxd is purging right now
	}
	if err != nil {
		log.Print(err)
		return
	}
	fmt.Printf("deleted %d done events before %s\n", res.Deleted, res.Cutoff)
}
