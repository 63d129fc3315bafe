package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestExplainListsEachWorkerOnce: a job attempted twice by one client says
// so once ("worked by mail_vm_16192 (2 attempts)"), not the name twice.
func TestExplainListsEachWorkerOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	var id, jobID int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('mail.user.welcome', '{}')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if err := s.Pool.QueryRow(ctx, `INSERT INTO river_job (args, kind, max_attempts, queue, state, attempt, attempted_at, attempted_by, finalized_at)
		VALUES ('{}', 'outbox_event', 25, 'outbox_mail', 'completed', 3, now(), '{mail_vm_16192,general_vm_7,mail_vm_16192}', now()) RETURNING id`).Scan(&jobID); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'done', processed_at = now(), river_job_ids = ARRAY[$2::bigint] WHERE id = $1`, id, jobID); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := ctl(t, s.URL, "explain", fmt.Sprint(id))
	if code != 0 {
		t.Fatalf("explain: exit %d: %s", code, stderr)
	}
	if !strings.Contains(stdout, "worked by mail_vm_16192 (2 attempts), general_vm_7\n") {
		t.Fatalf("explain output:\n%s", stdout)
	}
}

// TestMessagesAgreeInNumber: "1 event", never "1 events".
func TestMessagesAgreeInNumber(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := context.Background()
	var id int64
	if err := s.Pool.QueryRow(ctx, `SELECT outbox_publish('mail.user.welcome', '{}')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET status = 'failed' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `INSERT INTO outbox_event (event_type, payload, status, processed_at) VALUES ('mail.user.welcome', '{}', 'done', now() - interval '60 days')`); err != nil {
		t.Fatal(err)
	}
	_, stdout, _ := ctl(t, s.URL, "stats")
	if !strings.Contains(stdout, "ALERT events_failed: 1 event is failed") {
		t.Errorf("stats:\n%s", stdout)
	}
	_, stdout, _ = ctl(t, s.URL, "retention", "run", "--dry-run")
	if !strings.Contains(stdout, "dry run: 1 done event processed before") {
		t.Errorf("retention --dry-run: %s", stdout)
	}
	_, stdout, _ = ctl(t, s.URL, "retention", "run")
	if !strings.Contains(stdout, "deleted 1 done event processed before") || !strings.Contains(stdout, " in 1 batch;") {
		t.Errorf("retention: %s", stdout)
	}
	if strings.Contains(stdout, "1 events") || strings.Contains(stdout, "1 batches") {
		t.Errorf("plural after 1: %s", stdout)
	}
}

// TestJSONOutputEndsWithOneNewline: every --json output, errors included,
// is one JSON document followed by exactly one newline.
func TestJSONOutputEndsWithOneNewline(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	var id int64
	if err := s.Pool.QueryRow(context.Background(), `SELECT outbox_publish('mail.user.welcome', '{}')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"migrate", "--json"},
		{"publish", "--json", "--type", "mail.user.welcome"},
		{"stats", "--json"},
		{"stats", "--json", "--check"},
		{"explain", "--json", fmt.Sprint(id)},
		{"explain", "--json", "424242"},
		{"audit", "--json"},
		{"retention", "run", "--json", "--dry-run"},
		{"requeue", "--json", "--dry-run", "--id", fmt.Sprint(id)},
		{"stats", "--json", "--stalled-after", "0s"},
		{"publish", "--json", "--type", "Bad.Type"},
	} {
		_, stdout, _ := ctl(t, s.URL, args...)
		if !strings.HasSuffix(stdout, "\n") || strings.HasSuffix(stdout, "\n\n") {
			t.Errorf("%v: output does not end with exactly one newline: %q", args, stdout)
		}
		if !strings.HasPrefix(stdout, "{") && !strings.HasPrefix(stdout, "[") {
			t.Errorf("%v: not a JSON document: %q", args, stdout)
		}
	}
}
