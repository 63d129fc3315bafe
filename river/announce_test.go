package outboxriver_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

func TestAnnouncePayloadsOnePerQueueInRiversFormat(t *testing.T) {
	t.Parallel()
	got := outboxriver.AnnouncePayloads([]string{"outbox_mail", "outbox_audit", "outbox_mail"})
	want := []string{`{"queue": "outbox_audit"}`, `{"queue": "outbox_mail"}`}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("payloads %q, want %q", got, want)
	}
}

// TestAnnounceFoldsIntoRiversNotification checks that AnnounceSQL sends
// what River's insert sends, on River's channel: in one transaction with
// River's own notification the two are delivered once.
func TestAnnounceFoldsIntoRiversNotification(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	notes := s.ListenRiverInsert(t, ctx)

	ins, err := outboxriver.NewInsertClient(s.Pool, outboxriver.InsertClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		if _, err := ins.InsertManyTx(ctx, tx, []river.InsertManyParams{{
			Args: outboxriver.EventArgs{EventID: 1, EventType: "mail.user.created"}, InsertOpts: &river.InsertOpts{Queue: "outbox_mail"},
		}}); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, outboxriver.AnnounceSQL, outboxriver.AnnouncePayloads([]string{"outbox_mail", "outbox_audit"}))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for _, p := range notes() {
		got[p]++
	}
	if got[`{"queue": "outbox_mail"}`] != 1 || got[`{"queue": "outbox_audit"}`] != 1 || len(got) != 2 {
		t.Errorf("notifications %v, want River's and the announce's folded into one per queue", got)
	}
}

// TestSilentInsertClientNotifiesOnce checks that a Silent insert client
// leaves the announcement of its inserts to the caller: River notifies for
// its first insert only.
func TestSilentInsertClientNotifiesOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	notes := s.ListenRiverInsert(t, ctx)
	ins, err := outboxriver.NewInsertClient(s.Pool, outboxriver.InsertClientConfig{Silent: true})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			_, err := ins.InsertTx(ctx, tx, outboxriver.EventArgs{EventID: int64(i), EventType: "mail.user.created"}, &river.InsertOpts{Queue: "outbox_mail"})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := len(notes()); n != 1 {
		t.Errorf("River sent %d insert notifications for 3 inserts, want 1 (the first)", n)
	}
}
