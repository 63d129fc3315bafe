package main

// audit: flags and rendering; admin.Client.AuditList does the work.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/filter"
)

func runAudit(ctx context.Context, c *cli, args []string) error {
	fs := c.opsFlags("audit")
	limit := fs.Int("limit", admin.DefaultAuditLimit, fmt.Sprintf("most rows listed, newest first (1..%d)", admin.MaxAuditLimit))
	action := fs.String("action", "", "only this action (requeue, cancel, retention)")
	since := fs.String("since", "", "only actions at or after: RFC 3339, a date, or an age (2h, 3d)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	opts := admin.AuditOpts{Limit: *limit, Action: *action}
	if *limit == 0 {
		return usagef("--limit: 0 is out of range: use 1 to %d", admin.MaxAuditLimit)
	}
	if _, err := admin.CheckAudit(opts); err != nil {
		return err
	}
	if *since != "" {
		t, err := filter.ParseTime("since", *since, time.Now())
		if err != nil {
			return &usageError{err.Error()}
		}
		opts.Since = &t
	}
	cl, err := c.admin(ctx)
	if err != nil {
		return err
	}
	list, err := cl.AuditList(ctx, opts)
	if err != nil {
		return err
	}
	if c.jsonOut {
		return c.printJSON(list)
	}
	if len(list) == 0 {
		fmt.Fprintln(c.stdout, "no audit rows")
		return nil
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tAT\tACTOR\tDB USER\tACTION\tAFFECTED\tFILTER")
	for _, a := range list {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d\t%s\n", a.ID, a.At.Local().Format(time.RFC3339), clean(a.Actor), clean(a.DBUser), clean(a.Action), a.Affected, clean(compactJSON(a.Filter)))
	}
	return tw.Flush()
}

// compactJSON prints a stored JSON value on one line, keys in the order
// the database gave them (json.Compact only drops the spaces).
func compactJSON(b []byte) string {
	var buf bytes.Buffer
	if json.Compact(&buf, b) != nil {
		return string(b)
	}
	return buf.String()
}
