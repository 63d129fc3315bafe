package console_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/console"
	"github.com/outboxhq/outbox/internal/ordertest"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/route"
)

const testToken = "s3cret-console-token-for-tests"

// server mounts a console at /console and River UI (riverUI, or a stand-in
// when nil), guarded like outboxd guards the real one, at /riverui on a test
// server.
func server(t *testing.T, s *pgtest.Schema, cfg console.Config, riverUI ...http.Handler) (*httptest.Server, *console.Handler) {
	t.Helper()
	cfg.Pool = s.Pool
	cfg.Prefix = "/console"
	cfg.RiverUIPrefix = "/riverui"
	if cfg.Routes == nil {
		routes, err := route.New([]route.Rule{{Prefix: "mail.", Queues: []string{"outbox_mail"}}, {Prefix: "billing.", Queues: []string{"outbox_billing"}}})
		if err != nil {
			t.Fatal(err)
		}
		cfg.Routes, cfg.RoutesFile = routes, "routes.yaml"
	}
	h, err := console.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Stop)
	mux := http.NewServeMux()
	mux.Handle("/console/", h)
	var rui http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "river ui "+r.Method+" "+r.URL.Path)
	})
	if len(riverUI) > 0 {
		rui = riverUI[0]
	}
	mux.Handle("/riverui/", h.GuardRiverUI(rui))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, h
}

// client is a browser stand-in: it keeps cookies, does not follow
// redirects, and sends the Origin a browser sends for this server's pages.
type client struct {
	t      *testing.T
	base   string
	http   *http.Client
	origin string
}

func newClient(t *testing.T, srv *httptest.Server) *client {
	jar, _ := cookiejar.New(nil)
	return &client{t: t, base: srv.URL, origin: srv.URL, http: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}}
}

func (c *client) do(method, path string, form url.Values) (int, string, http.Header) {
	c.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, c.base+path, body)
	if err != nil {
		c.t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	if c.origin != "" && method != http.MethodGet {
		req.Header.Set("Origin", c.origin)
	}
	res, err := c.http.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b), res.Header
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// signIn signs in as name and returns the CSRF token of the session.
func (c *client) signIn(name string) string {
	c.t.Helper()
	code, body, _ := c.do("POST", "/console/login", url.Values{"name": {name}, "token": {testToken}, "next": {"/console/events"}})
	if code != http.StatusSeeOther {
		c.t.Fatalf("sign in: %d %s", code, body)
	}
	_, body, _ = c.do("GET", "/console/events", nil)
	m := csrfRE.FindStringSubmatch(body)
	if m == nil {
		c.t.Fatalf("no CSRF token on the events page:\n%s", body)
	}
	return m[1]
}

func seed(t *testing.T, s *pgtest.Schema) (failed []int64) {
	t.Helper()
	ctx := context.Background()
	for i := range 3 {
		var id int64
		typ := "mail.user.welcome"
		if i == 2 {
			typ = "billing.invoice.paid"
		}
		if err := s.Pool.QueryRow(ctx, `INSERT INTO outbox_event (event_type, payload, status, tenant_id, last_error, retries)
			VALUES ($1, '{"secret":"p4yl0ad"}', 'failed', 'acme', 'smtp timeout', 7) RETURNING id`, typ).Scan(&id); err != nil {
			t.Fatal(err)
		}
		failed = append(failed, id)
	}
	pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcome", Payload: []byte(`{"secret":"p4yl0ad"}`), TenantID: "globex"})
	return failed
}

// TestReadOnlyPagesNeedNoSetup: without a token the overview, the list with
// its filters and an event page render; payloads stay hidden; every
// mutation is refused and says how to enable it.
func TestReadOnlyPagesNeedNoSetup(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	failed := seed(t, s)
	srv, _ := server(t, s, console.Config{})
	c := newClient(t, srv)

	code, body, hdr := c.do("GET", "/console/", nil)
	if code != 200 || !strings.Contains(body, `id="failed"`) || !strings.Contains(body, ">3</a>") || !strings.Contains(body, `data-queue="outbox_billing"`) {
		t.Fatalf("overview: %d\n%s", code, body)
	}
	if !strings.Contains(hdr.Get("Content-Security-Policy"), "frame-ancestors 'none'") {
		t.Errorf("CSP: %q", hdr.Get("Content-Security-Policy"))
	}
	code, body, _ = c.do("GET", "/console/events?status=failed&type=billing.", nil)
	if code != 200 || strings.Count(body, `<tr data-id=`) != 1 || !strings.Contains(body, `data-id="`+itoa(failed[2])+`"`) {
		t.Fatalf("filtered list: %d\n%s", code, body)
	}
	code, body, _ = c.do("GET", "/console/events/"+itoa(failed[0]), nil)
	if code != 200 || !strings.Contains(body, "smtp timeout") || !strings.Contains(body, `id="payload-hidden"`) || strings.Contains(body, "p4yl0ad") {
		t.Fatalf("event page: %d\n%s", code, body)
	}
	if code, _, _ = c.do("GET", "/console/events/424242", nil); code != 404 {
		t.Errorf("unknown event: %d", code)
	}
	if code, body, _ = c.do("GET", "/console/jobs/424242", nil); code != 404 || !strings.Contains(body, "no such job") {
		t.Errorf("unknown River job: %d\n%s", code, body)
	}
	if code, body, _ = c.do("POST", "/console/login", url.Values{"name": {"eve"}, "token": {"anything-at-all-here"}}); code != 403 || !strings.Contains(body, "OUTBOX_CONSOLE_TOKEN") {
		t.Errorf("sign in without a token configured: %d\n%s", code, body)
	}
	if code, body, _ = c.do("POST", "/console/actions/preview", url.Values{"scope": {"selection"}, "id": {itoa(failed[0])}, "action": {"requeue"}}); code != 401 || !strings.Contains(body, "read-only") {
		t.Errorf("mutation without a token configured: %d\n%s", code, body)
	}
	// River UI shows job args: closed without payloads or a session.
	if code, _, hdr = c.do("GET", "/riverui/jobs/1", nil); code != http.StatusSeeOther || !strings.HasPrefix(hdr.Get("Location"), "/console/login?next=%2Friverui%2Fjobs%2F1") {
		t.Errorf("River UI without payloads: %d %v", code, hdr)
	}
}

// TestTokenCSRFAndOriginGuardMutations: a requeue needs a sign-in with the
// token, the session's CSRF token and a same-origin request; the preview
// changes nothing; the confirmation changes the previewed events and writes
// an audit row with the operator's name.
func TestTokenCSRFAndOriginGuardMutations(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	failed := seed(t, s)
	srv, _ := server(t, s, console.Config{Token: testToken})
	c := newClient(t, srv)
	ids := url.Values{"scope": {"selection"}, "id": {itoa(failed[0]), itoa(failed[1])}, "action": {"requeue"}}

	if code, _, _ := c.do("POST", "/console/actions/preview", ids); code != 401 {
		t.Errorf("not signed in: %d", code)
	}
	if code, body, _ := c.do("POST", "/console/login", url.Values{"name": {"mallory"}, "token": {"not-the-token-at-all"}}); code != 401 || !strings.Contains(body, "wrong token") {
		t.Errorf("wrong token: %d", code)
	}
	csrf := c.signIn("alice")
	if code, _, _ := c.do("POST", "/console/actions/preview", ids); code != 403 {
		t.Errorf("no CSRF token: %d", code)
	}
	withCSRF := url.Values{"csrf": {csrf}}
	for k, v := range ids {
		withCSRF[k] = v
	}
	c.origin = "http://evil.example"
	if code, _, _ := c.do("POST", "/console/actions/preview", withCSRF); code != 403 {
		t.Errorf("cross-origin: %d", code)
	}
	c.origin = ""
	if code, _, _ := c.do("POST", "/console/actions/preview", withCSRF); code != 403 {
		t.Errorf("no Origin nor Referer: %d", code)
	}
	c.origin = srv.URL

	code, body, _ := c.do("POST", "/console/actions/preview", withCSRF)
	if code != 200 || !strings.Contains(body, `<b id="affected">2</b>`) || !strings.Contains(body, `id="confirm"`) {
		t.Fatalf("preview: %d\n%s", code, body)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'failed'`); n != 3 {
		t.Fatalf("the preview changed events: %d failed left", n)
	}
	// A confirmation only runs from a preview's form (scope=ids).
	if code, _, _ := c.do("POST", "/console/actions/run", withCSRF); code != 400 {
		t.Errorf("run without a preview: %d", code)
	}
	confirm := url.Values{"csrf": {csrf}, "scope": {"ids"}, "action": {"requeue"}, "id": {itoa(failed[0]) + "," + itoa(failed[1])}, "status": {"failed"}}
	code, body, _ = c.do("POST", "/console/actions/run", confirm)
	if code != 200 || !strings.Contains(body, `<b id="affected">2</b>`) {
		t.Fatalf("run: %d\n%s", code, body)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_event WHERE status = 'pending' AND id = ANY($1)`, failed[:2]); n != 2 {
		t.Errorf("requeued: %d of 2", n)
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit WHERE actor = 'console:alice' AND action = 'requeue' AND affected = 2`); n != 1 {
		t.Errorf("audit rows of console:alice: %d", n)
	}
	// A preview by filter: the billing event only (the two others are
	// pending now); a status alone is refused without "all".
	byFilter := url.Values{"csrf": {csrf}, "scope": {"filter"}, "action": {"cancel"}, "type": {"billing."}, "status": {"failed"}}
	if code, body, _ = c.do("POST", "/console/actions/preview", byFilter); code != 200 || !strings.Contains(body, `<b id="affected">1</b>`) || !strings.Contains(body, "value=\""+itoa(failed[2])+"\"") {
		t.Errorf("preview by filter: %d\n%s", code, body)
	}
	byFilter.Del("type")
	if code, body, _ = c.do("POST", "/console/actions/preview", byFilter); code != 400 || !strings.Contains(body, "--all") {
		t.Errorf("status alone without all: %d\n%s", code, body)
	}
	// River UI: readable once signed in; its actions need the same origin.
	if code, body, _ = c.do("GET", "/riverui/jobs/1", nil); code != 200 || body != "river ui GET /riverui/jobs/1" {
		t.Errorf("River UI signed in: %d %q", code, body)
	}
	if code, _, _ = c.do("POST", "/riverui/api/jobs/cancel", url.Values{}); code != 200 {
		t.Errorf("River UI action signed in: %d", code)
	}
	c.origin = "http://evil.example"
	if code, _, _ = c.do("POST", "/riverui/api/jobs/cancel", url.Values{}); code != 403 {
		t.Errorf("River UI action cross-origin: %d", code)
	}
	anon := newClient(t, srv)
	if code, _, _ = anon.do("POST", "/riverui/api/jobs/cancel", url.Values{}); code != 401 {
		t.Errorf("River UI action not signed in: %d", code)
	}
	// A forged or tampered cookie is no session.
	anon.http.Jar.SetCookies(mustURL(t, srv.URL), []*http.Cookie{{Name: console.CookieName, Value: "eyJuIjoiZXZlIiwiZSI6OTk5OTk5OTk5OSwicyI6IngifQ.AAAA"}})
	if code, _, _ = anon.do("POST", "/riverui/api/jobs/cancel", url.Values{}); code != 401 {
		t.Errorf("forged cookie: %d", code)
	}
}

// TestPagesHideConnectionDetails: a database error (here: no outbox
// tables) gives a page that says what to do, never the host, user or
// schema.
func TestPagesHideConnectionDetails(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, &pgtest.Options{NoMigrate: true})
	srv, _ := server(t, s, console.Config{})
	c := newClient(t, srv)
	for _, path := range []string{"/console/", "/console/events", "/console/events/1", "/console/audit"} {
		code, body, _ := c.do("GET", path, nil)
		if code < 500 || !strings.Contains(body, "outboxctl migrate") {
			t.Errorf("%s: %d\n%s", path, code, body)
		}
		for _, secret := range []string{s.Name, "127.0.0.1", "postgres", "5432"} {
			if strings.Contains(body, secret) {
				t.Errorf("%s reveals %q:\n%s", path, secret, body)
			}
		}
	}
}

// TestSeriesSamplesRates: the sampler turns new and handed-off events into
// rates and counts.
func TestSeriesSamplesRates(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	srv, _ := server(t, s, console.Config{SampleInterval: 100 * time.Millisecond})
	c := newClient(t, srv)
	pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.user.welcome", Payload: []byte(`{}`)}, outbox.Event{Type: "mail.user.welcome", Payload: []byte(`{}`)})
	pgtest.WaitFor(t, 60*time.Second, "a point with the two pending events and a publish rate", func() bool {
		_, body, _ := c.do("GET", "/console/api/series", nil)
		var series struct{ Points []console.Point }
		if err := json.Unmarshal([]byte(body), &series); err != nil {
			t.Fatalf("%v: %s", err, body)
		}
		published, pending := false, false
		for _, p := range series.Points {
			published = published || p.PublishPerS > 0
			pending = pending || p.Pending == 2
		}
		return published && pending
	})
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

func mustURL(t *testing.T, s string) *url.URL {
	u, err := url.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// TestPayloadsShownWhenEnabled: with ShowPayloads the event page shows the
// payload, and River UI is readable without a sign-in (its actions are
// not).
func TestPayloadsShownWhenEnabled(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	failed := seed(t, s)
	srv, _ := server(t, s, console.Config{ShowPayloads: true, Token: testToken})
	c := newClient(t, srv)
	if code, body, _ := c.do("GET", "/console/events/"+itoa(failed[0]), nil); code != 200 || !strings.Contains(body, `<pre id="payload">{&#34;secret&#34;: &#34;p4yl0ad&#34;}</pre>`) {
		t.Errorf("event page: %d\n%s", code, body)
	}
	if code, body, _ := c.do("GET", "/riverui/jobs/1", nil); code != 200 || body != "river ui GET /riverui/jobs/1" {
		t.Errorf("River UI read: %d %q", code, body)
	}
	if code, _, _ := c.do("POST", "/riverui/api/jobs/retry", url.Values{}); code != 401 {
		t.Errorf("River UI action without a sign-in: %d", code)
	}
}

// TestKeysPageAndUnpark: the overview counts the parked key and the keys
// page lists it with links to its head event and River UI's job page,
// escaped; unpark goes through the same sign-in, CSRF, preview and
// confirmation as requeue: the preview changes nothing, the confirmation
// skips the head and writes an audit row with the operator's name; a key
// that is not parked, and an unknown action, are refused.
func TestKeysPageAndUnpark(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	const key = "order-42<script>"
	events, jobs := ordertest.ParkKey(t, s.Pool, "acme", key, 2, "webhook 500")
	srv, _ := server(t, s, console.Config{Token: testToken})
	c := newClient(t, srv)

	if code, body, _ := c.do("GET", "/console/", nil); code != 200 || !strings.Contains(body, `<b id="parked-keys"><a href="/console/keys">1</a></b>`) {
		t.Fatalf("overview: %d, no parked key count\n%s", code, body)
	}
	code, body, _ := c.do("GET", "/console/keys", nil)
	if code != 200 || !strings.Contains(body, `data-kind="parked"`) || !strings.Contains(body, `order-42&lt;script&gt;`) || strings.Contains(body, "<script>") ||
		!strings.Contains(body, `href="/console/events/`+itoa(events[0])+`"`) || !strings.Contains(body, `href="/riverui/jobs/`+itoa(jobs[0])+`"`) ||
		!strings.Contains(body, "webhook 500") || strings.Contains(body, `class="inline unpark"`) {
		t.Fatalf("keys page, signed out: %d\n%s", code, body)
	}
	// The event page of the waiting event shows the key's order, and that
	// its job waits in the key's line, not in River yet.
	if code, body, _ = c.do("GET", "/console/events/"+itoa(events[1]), nil); code != 200 || !strings.Contains(body, `id="ordering-key"`) ||
		!strings.Contains(body, "waits behind head job "+itoa(jobs[0])) || !strings.Contains(body, "line, not in River yet") ||
		!strings.Contains(body, `/console/keys?key=order-42%3cscript%3e&amp;queue=outbox_order`) {
		t.Fatalf("event page of a waiting event: %d\n%s", code, body)
	}
	// Its job is not in River yet: the jobs table says so and does not
	// link it to River UI, which would not find it.
	if strings.Contains(body, `href="/riverui/jobs/`+itoa(jobs[1])+`"`) || !strings.Contains(body, `<span class="in-line">in its key's line, not in River yet</span>`) {
		t.Fatalf("event page of a waiting event links its job to River UI or does not say it is in the line\n%s", body)
	}
	form := url.Values{"action": {"unpark"}, "key": {key}, "tenant": {"acme"}, "queue": {"outbox_order"}, "unpark": {"skip"}}
	if code, _, _ := c.do("POST", "/console/actions/preview", form); code != 401 {
		t.Errorf("unpark preview signed out: %d", code)
	}
	csrf := c.signIn("alice")
	if code, _, _ := c.do("POST", "/console/actions/preview", form); code != 403 {
		t.Errorf("unpark preview without CSRF: %d", code)
	}
	if _, body, _ := c.do("GET", "/console/keys", nil); !strings.Contains(body, `class="inline unpark"`) {
		t.Fatalf("keys page, signed in: no unpark form\n%s", body)
	}
	form.Set("csrf", csrf)
	code, body, _ = c.do("POST", "/console/actions/preview", form)
	if code != 200 || !strings.Contains(body, `<b id="affected">1</b>`) || !strings.Contains(body, `id="confirm"`) || !strings.Contains(body, `name="confirm" value="on"`) {
		t.Fatalf("unpark preview: %d\n%s", code, body)
	}
	// The next job still waits in the key's line (pending there, not in
	// river_job until its turn).
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM `+pgtest.Jobs+` WHERE id = $1 AND state = 'pending' AND in_line`, jobs[1]); n != 1 ||
		pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1`, jobs[1]) != 0 || pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit`) != 0 {
		t.Fatal("the preview changed something")
	}
	// The run needs the preview's confirmation.
	if code, _, _ := c.do("POST", "/console/actions/run", form); code != 400 {
		t.Errorf("unpark run without the confirmation: %d", code)
	}
	form.Set("confirm", "on")
	form.Set("reason", "customer gone")
	code, body, _ = c.do("POST", "/console/actions/run", form)
	if code != 200 || !strings.Contains(body, `id="audit-id"`) {
		t.Fatalf("unpark run: %d\n%s", code, body)
	}
	// Released: River's row, available, with the id it had in the line.
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'available'`, jobs[1]); n != 1 ||
		pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_ordering_wait WHERE job_id = $1`, jobs[1]) != 0 {
		t.Error("the next job was not released")
	}
	if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM outbox_audit WHERE actor = 'console:alice' AND action = 'unpark' AND detail->>'reason' = 'customer gone'`); n != 1 {
		t.Errorf("audit rows of console:alice: %d", n)
	}
	if code, body, _ = c.do("POST", "/console/actions/preview", form); code != 409 || !strings.Contains(body, "is not parked") {
		t.Errorf("unpark of a key no longer parked: %d\n%s", code, body)
	}
	form.Set("unpark", "delete")
	if code, body, _ = c.do("POST", "/console/actions/preview", form); code != 400 || !strings.Contains(body, "action must be retry") {
		t.Errorf("unknown unpark action: %d\n%s", code, body)
	}
	if code, body, _ = c.do("GET", "/console/keys?parked=on", nil); code != 200 || !strings.Contains(body, `id="no-keys"`) {
		t.Errorf("keys page after the unpark: %d\n%s", code, body)
	}
}
