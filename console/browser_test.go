package console_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"riverqueue.com/riverui"

	"github.com/outboxhq/outbox/console"
	"github.com/outboxhq/outbox/internal/pgtest"
	outboxriver "github.com/outboxhq/outbox/river"
)

// chromium finds a Chromium or Chrome binary, or skips the test:
// scripts/install-chromium.sh installs it (.ci/run does).
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("CHROMIUM_PATH"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "headless-shell"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skip("browser test skipped: no Chromium found (run scripts/install-chromium.sh, or set CHROMIUM_PATH)")
	return ""
}

// TestConsoleInBrowser drives the console in headless Chromium, one browser
// and one tab, step by step: the overview and its chart, filtering the list,
// the token check at sign-in, a requeue through its preview to its audit
// row, an event page and its link into River UI (the real River UI, mounted
// beside the console). With UPDATE_SCREENSHOTS=1 it saves the pages'
// screenshots in docs/img for docs/console.md.
func TestConsoleInBrowser(t *testing.T) {
	t.Parallel()
	exe := chromium(t)
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 2*time.Minute)
	failed := seed(t, s)

	// One event handed off to a real River job, for the event page and
	// the link into River UI.
	rc, err := river.NewClient(riverpgxv5.New(s.Pool), &river.Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var done int64
	if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, status, processed_at, tenant_id)
		VALUES ('mail.user.welcome', '{}', 'done', now(), 'acme') RETURNING id`).Scan(&done); err != nil {
		t.Fatal(err)
	}
	job, err := rc.Insert(ctx, outboxriver.EventArgs{EventID: done, EventType: "mail.user.welcome", Payload: []byte(`{}`), CreatedAt: time.Now()},
		&river.InsertOpts{Queue: "outbox_mail", Metadata: []byte(fmt.Sprintf(`{"outbox_event_id": %d}`, done))})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pool.Exec(ctx, `UPDATE outbox_event SET river_job_ids = ARRAY[$2::bigint] WHERE id = $1`, done, job.Job.ID); err != nil {
		t.Fatal(err)
	}

	// The console and River UI on one server, as outboxd mounts them.
	rui, err := riverui.NewHandler(&riverui.HandlerOpts{Endpoints: riverui.NewEndpoints(rc, nil), Logger: slog.New(slog.DiscardHandler), Prefix: "/riverui"})
	if err != nil {
		t.Fatal(err)
	}
	if err := rui.Start(ctx); err != nil {
		t.Fatal(err)
	}
	srv, _ := server(t, s, console.Config{Token: testToken, SampleInterval: 100 * time.Millisecond}, rui)
	base := srv.URL

	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe), chromedp.NoSandbox, chromedp.WindowSize(1100, 760))...)
	defer cancelAlloc()
	tab, cancelTab := chromedp.NewContext(actx)
	defer cancelTab()
	// The first call starts the browser, on a context without a timeout
	// (chromedp ties the browser's life to it).
	if err := chromedp.Do(tab, chromedp.Navigate("about:blank")); err != nil {
		t.Fatal(err)
	}
	page := func() string {
		html, _ := chromedp.Run(tab, chromedp.OuterHTML(chromedp.CSS("body")))
		return html
	}
	do := func(t *testing.T, step string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		sctx, cancel := context.WithTimeout(tab, 45*time.Second)
		defer cancel()
		if err := chromedp.Do(sctx, actions...); err != nil {
			t.Fatalf("%s: %v\npage:\n%.3000s", step, err, page())
		}
	}
	get := func(t *testing.T, step string, a chromedp.Action[string]) string {
		t.Helper()
		sctx, cancel := context.WithTimeout(tab, 45*time.Second)
		defer cancel()
		v, err := chromedp.Run(sctx, a)
		if err != nil {
			t.Fatalf("%s: %v\npage:\n%.3000s", step, err, page())
		}
		return strings.TrimSpace(v)
	}
	text := func(t *testing.T, sel string) string {
		t.Helper()
		return get(t, sel, chromedp.Text(chromedp.CSS(sel)))
	}
	// until waits for a JavaScript condition; it polls again when a
	// navigation destroyed the page it was polling (after a click on a
	// link), until the step's deadline.
	until := func(expr string) chromedp.Action[chromedp.Void] {
		return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			for {
				_, err := chromedp.Poll[bool](expr, chromedp.WithPollingInterval(50*time.Millisecond))(ctx, tg)
				if err == nil || ctx.Err() != nil {
					return err
				}
				select {
				case <-ctx.Done():
					return err
				case <-time.After(50 * time.Millisecond):
				}
			}
		})
	}
	shot := func(name string, full ...bool) chromedp.Action[chromedp.Void] {
		return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			if os.Getenv("UPDATE_SCREENSHOTS") == "" {
				return nil
			}
			capture := chromedp.CaptureScreenshot()
			if len(full) > 0 {
				capture = chromedp.FullScreenshot(100)
			}
			png, err := capture(ctx, tg)
			if err != nil {
				return err
			}
			return os.WriteFile(filepath.Join("..", "docs", "img", "console-"+name+".png"), png, 0o644)
		})
	}
	css := func(s string) chromedp.CSS { return chromedp.CSS(s) }

	t.Run("overview", func(t *testing.T) {
		do(t, "overview", chromedp.Navigate(base+"/console/"))
		if got := text(t, "#failed"); got != "3" {
			t.Errorf("failed count %q", got)
		}
		if got := text(t, `#queues tr[data-queue="outbox_billing"]`); !strings.Contains(got, "outbox_billing") {
			t.Errorf("routed queue row %q", got)
		}
		// The chart is drawn once the series has two points.
		do(t, "chart", until(`(document.getElementById("chart").getAttribute("data-points")|0) >= 2 && document.querySelectorAll("#rates polyline").length == 2`), shot("overview"))
	})

	t.Run("filtering", func(t *testing.T) {
		do(t, "filter",
			chromedp.Navigate(base+"/console/events"),
			chromedp.Click(css(`#filter input[value="failed"]`)),
			chromedp.SendKeys(css(`#filter input[name="type"]`), "billing."),
			chromedp.Click(css("#apply")),
			until(`location.search.includes("type=billing.") && document.readyState == "complete"`),
			chromedp.WaitVisible(css(`#events tbody tr[data-id="`+itoa(failed[2])+`"]`)))
		rows, err := chromedp.Run(tab, chromedp.Evaluate[int](`document.querySelectorAll("#events tbody tr").length`))
		loc := get(t, "location", chromedp.Location())
		if err != nil || rows != 1 || !strings.Contains(loc, "status=failed") || !strings.Contains(loc, "type=billing.") {
			t.Errorf("%d rows (%v) at %s", rows, err, loc)
		}
		do(t, "no actions before sign-in", chromedp.WaitVisible(css("#need-signin")))
	})

	t.Run("token check", func(t *testing.T) {
		do(t, "wrong token",
			chromedp.Navigate(base+"/console/login"),
			chromedp.SendKeys(css(`#login input[name="name"]`), "alice"),
			chromedp.SendKeys(css(`#login input[name="token"]`), "not-the-right-token"),
			chromedp.Click(css("#login-submit")),
			chromedp.WaitVisible(css("#login-error")))
		if got := text(t, "#login-error"); got != "wrong token" {
			t.Errorf("wrong token: %q", got)
		}
		do(t, "right token",
			chromedp.SetValue(css(`#login input[name="token"]`), testToken),
			chromedp.Click(css("#login-submit")),
			chromedp.WaitVisible(css("#user")))
		if got := text(t, "#user"); got != "alice" {
			t.Errorf("signed in as %q", got)
		}
	})

	t.Run("requeue with preview and audit", func(t *testing.T) {
		do(t, "preview",
			chromedp.Navigate(base+"/console/events?status=failed"),
			chromedp.Click(css(`#events input[value="`+itoa(failed[0])+`"]`)),
			chromedp.Click(css(`#events input[value="`+itoa(failed[1])+`"]`)),
			shot("events"),
			chromedp.Click(css("#requeue")),
			chromedp.WaitVisible(css("#affected")),
			shot("preview"))
		if got := text(t, "#affected"); got != "2" {
			t.Errorf("preview affects %q", got)
		}
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'failed'`); n != 3 {
			t.Errorf("the preview changed events: %d failed", n)
		}
		do(t, "confirm", chromedp.Click(css("#confirm-button")), chromedp.WaitVisible(css("#audit-id")))
		if got := text(t, "#summary"); !strings.Contains(got, "2 event(s) changed by console:alice") {
			t.Errorf("result %q", got)
		}
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit WHERE actor = 'console:alice' AND action = 'requeue' AND affected = 2`); n != 1 {
			t.Errorf("audit rows: %d", n)
		}
		do(t, "audit page", chromedp.Click(css("#audit-id")), chromedp.WaitVisible(css("#audit td.actor")))
		if got := text(t, "#audit td.actor"); got != "console:alice" {
			t.Errorf("audit page actor %q", got)
		}
	})

	t.Run("event page links into River UI", func(t *testing.T) {
		do(t, "event page", chromedp.Navigate(base+"/console/events/"+itoa(done)), chromedp.WaitVisible(css("#jobs a.riverui-job")), shot("event", true))
		sctx, cancel := context.WithTimeout(tab, 45*time.Second)
		defer cancel()
		href, err := chromedp.Run(sctx, chromedp.AttributeValue(css("#jobs a.riverui-job"), "href"))
		if want := "/riverui/jobs/" + strconv.FormatInt(job.Job.ID, 10); err != nil || href.Value != want {
			t.Fatalf("job link %q (%v), want %q", href.Value, err, want)
		}
		do(t, "River UI job page",
			chromedp.Click(css("#jobs a.riverui-job")),
			until(`document.body.innerText.includes("outbox_event") && document.body.innerText.includes("outbox_mail")`),
			shot("riverui"))
		if loc := get(t, "location", chromedp.Location()); !strings.HasSuffix(loc, "/riverui/jobs/"+strconv.FormatInt(job.Job.ID, 10)) {
			t.Errorf("River UI at %s", loc)
		}
		// And back: the console finds the event of a job.
		do(t, "back from the job", chromedp.Navigate(base+"/console/jobs/"+strconv.FormatInt(job.Job.ID, 10)), chromedp.WaitVisible(css("#event")))
		if loc := get(t, "location", chromedp.Location()); !strings.HasSuffix(loc, "/console/events/"+itoa(done)) {
			t.Errorf("back from the job at %s", loc)
		}
	})
}
