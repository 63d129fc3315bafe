package console

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/internal/filter"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

var funcs = template.FuncMap{
	"ts": func(t any) string {
		switch v := t.(type) {
		case time.Time:
			return v.UTC().Format("2006-01-02 15:04:05Z")
		case *time.Time:
			if v == nil {
				return "–"
			}
			return v.UTC().Format("2006-01-02 15:04:05Z")
		}
		return ""
	},
	"str": func(p *string) string {
		if p == nil {
			return ""
		}
		return *p
	},
	"secs": func(s float64) string { return (time.Duration(s * float64(time.Second))).Round(time.Second).String() },
	"rate": func(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) },
	"join": strings.Join,
	"ids": func(ids []int64) string {
		s := make([]string, len(ids))
		for i, id := range ids {
			s[i] = strconv.FormatInt(id, 10)
		}
		return strings.Join(s, ",")
	},
	"has":   slices.Contains[[]string],
	"short": func(s string) string { return firstLine(s, 200) },
	"json": func(raw json.RawMessage) string {
		return string(raw)
	},
	"first": func(n int, ids []int64) []int64 { return ids[:min(n, len(ids))] },
	"deref": func(b *bool) bool { return b != nil && *b },
}

// pages holds one template set per page: the layout plus the page.
var pages = func() map[string]*template.Template {
	m := map[string]*template.Template{}
	names, err := fs.Glob(templateFS, "templates/*.html")
	if err != nil {
		panic(err)
	}
	for _, n := range names {
		base := strings.TrimSuffix(strings.TrimPrefix(n, "templates/"), ".html")
		if base == "layout" {
			continue
		}
		m[base] = template.Must(template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", n))
	}
	return m
}()

// view is what every page's template gets.
type view struct {
	Title   string
	Nav     string
	Prefix  string
	RiverUI string
	// User is the signed-in operator ("" when not signed in); CSRF is the
	// session's token for the forms.
	User       string
	CSRF       string
	CanMutate  bool
	Payloads   bool
	Data       any
	Error      string
	StatusCode int
}

// renderLogin renders the login page.
func (h *Handler) renderLogin(w http.ResponseWriter, r *http.Request, code int, data loginData) {
	h.renderView(w, r, code, "login", &view{Data: data})
}

func (h *Handler) renderView(w http.ResponseWriter, r *http.Request, code int, name string, v *view) {
	v.Prefix, v.RiverUI, v.CanMutate, v.Payloads, v.StatusCode = h.cfg.Prefix, h.cfg.RiverUIPrefix, h.cfg.Token != "", h.cfg.ShowPayloads, code
	if v.Nav == "" {
		v.Nav = name
	}
	if v.Title == "" {
		v.Title = map[string]string{"login": "Sign in"}[name]
	}
	if s := h.session(r); s != nil {
		v.User, v.CSRF = s.Name, h.csrfToken(s)
	}
	t, ok := pages[name]
	if !ok {
		panic("console: no template " + name)
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	if err := t.Execute(w, v); err != nil {
		h.cfg.Logger.Warn("console: rendering a page failed", slog.String("page", name), slog.String("error", err.Error()))
	}
}

// fail renders an error page with msg, which must hold no connection
// details.
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, code int, msg string) {
	h.renderView(w, r, code, "error", &view{Title: http.StatusText(code), Error: msg})
}

// dbFail logs a database error and renders a page that says only what the
// operator can act on: the schema is missing, the event does not exist, a
// filter is refused, or "a database error" (the log has the details: host,
// user and schema names never reach a page).
func (h *Handler) dbFail(w http.ResponseWriter, r *http.Request, what string, err error) {
	var se *admin.SelectionError
	switch {
	case errors.As(err, &se):
		h.fail(w, r, http.StatusBadRequest, se.Error())
	case errors.Is(err, admin.ErrNotParked):
		h.fail(w, r, http.StatusConflict, err.Error())
	case errors.Is(err, admin.ErrNotFound):
		h.fail(w, r, http.StatusNotFound, "no such event: it never existed, or retention purged it after it was done")
	case errors.Is(err, admin.ErrSchemaMissing):
		h.cfg.Logger.Error("console: "+what, slog.String("error", err.Error()))
		h.fail(w, r, http.StatusServiceUnavailable, "the outbox's tables are missing: run `outboxctl migrate` first")
	case errors.Is(err, context.Canceled):
		h.fail(w, r, http.StatusServiceUnavailable, "the request was cancelled")
	default:
		h.cfg.Logger.Error("console: "+what, slog.String("error", err.Error()))
		h.fail(w, r, http.StatusInternalServerError, "a database error occurred while reading "+what+"; the server's log has the details")
	}
}

func (h *Handler) static(w http.ResponseWriter, r *http.Request) {
	b, err := staticFS.ReadFile("static/" + r.PathValue("file"))
	if err != nil {
		http.NotFound(w, r)
		return
	}
	switch {
	case strings.HasSuffix(r.PathValue("file"), ".css"):
		w.Header().Set("Content-Type", "text/css; charset=utf-8")
	case strings.HasSuffix(r.PathValue("file"), ".js"):
		w.Header().Set("Content-Type", "text/javascript; charset=utf-8")
	}
	_, _ = w.Write(b)
}

// overviewData is the overview page.
type overviewData struct {
	Stats *admin.Stats
	// Keys counts the ordering keys that wait for an operator.
	Keys   admin.KeySummary
	Last   *Point
	Window time.Duration
	// Every is the sample interval in milliseconds, for the chart's
	// refresh.
	Every int64
}

func (h *Handler) overview(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	st, err := h.admin.Stats(ctx, admin.StatsOpts{Routes: h.cfg.Routes, Thresholds: admin.DefaultThresholds()})
	if err != nil {
		h.dbFail(w, r, "the outbox's statistics", err)
		return
	}
	keys, err := h.admin.KeySummary(ctx)
	if err != nil {
		h.dbFail(w, r, "the ordering keys", err)
		return
	}
	d := overviewData{Stats: st, Keys: keys, Window: h.cfg.SampleWindow, Every: h.cfg.SampleInterval.Milliseconds()}
	if pts := h.sampler.series(); len(pts) > 0 {
		d.Last = &pts[len(pts)-1]
	}
	h.renderView(w, r, http.StatusOK, "overview", &view{Title: "Overview", Data: d})
}

// series serves the sampled points as JSON, oldest first.
func (h *Handler) series(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(struct {
		IntervalMS int64   `json:"interval_ms"`
		Points     []Point `json:"points"`
	}{h.cfg.SampleInterval.Milliseconds(), h.sampler.series()})
}

// listForm is the events page's filter, as typed.
type listForm struct {
	Statuses   []string
	TypePrefix string
	Tenant     string
	Since      string
	Until      string
}

// query is the form as a query string (for the next page's link).
func (f listForm) query() url.Values {
	q := url.Values{}
	for _, s := range f.Statuses {
		q.Add("status", s)
	}
	for k, v := range map[string]string{"type": f.TypePrefix, "tenant": f.Tenant, "since": f.Since, "until": f.Until} {
		if v != "" {
			q.Set(k, v)
		}
	}
	return q
}

// parseListForm reads the filter fields from form values (a query string
// or a POST form: the same names).
func parseListForm(v url.Values, now time.Time) (listForm, admin.EventListOpts, error) {
	f := listForm{TypePrefix: strings.TrimSpace(v.Get("type")), Tenant: strings.TrimSpace(v.Get("tenant")),
		Since: strings.TrimSpace(v.Get("since")), Until: strings.TrimSpace(v.Get("until"))}
	for _, s := range v["status"] {
		if s != "" && !slices.Contains(f.Statuses, s) {
			f.Statuses = append(f.Statuses, s)
		}
	}
	opts := admin.EventListOpts{Statuses: f.Statuses, TypePrefix: f.TypePrefix, Tenant: f.Tenant}
	for _, tf := range []struct {
		name, val string
		dst       **time.Time
	}{{"since", f.Since, &opts.Since}, {"until", f.Until, &opts.Until}} {
		if tf.val == "" {
			continue
		}
		t, err := filter.ParseTime(tf.name, tf.val, now)
		if err != nil {
			var fe *filter.Error
			if errors.As(err, &fe) {
				return f, opts, &admin.SelectionError{Flag: fe.Flag, Msg: fe.Msg}
			}
			return f, opts, err
		}
		*tf.dst = &t
	}
	return f, opts, nil
}

type eventsData struct {
	Form     listForm
	Statuses []string
	Page     *admin.EventPage
	Next     string
	First    string
}

func (h *Handler) events(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	form, opts, err := parseListForm(q, time.Now())
	if err == nil && q.Get("before") != "" {
		if opts.Before, err = strconv.ParseInt(q.Get("before"), 10, 64); err != nil {
			err = &admin.SelectionError{Flag: "before", Msg: "must be an event id"}
		}
	}
	if err != nil {
		h.dbFail(w, r, "the events", err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	page, err := h.admin.ListEvents(ctx, opts)
	if err != nil {
		h.dbFail(w, r, "the events", err)
		return
	}
	d := eventsData{Form: form, Statuses: filter.Statuses, Page: page, First: h.url("/events") + "?" + form.query().Encode()}
	if page.Next != 0 {
		nq := form.query()
		nq.Set("before", strconv.FormatInt(page.Next, 10))
		d.Next = h.url("/events") + "?" + nq.Encode()
	}
	h.renderView(w, r, http.StatusOK, "events", &view{Title: "Events", Data: d})
}

type eventData struct {
	Ex      *admin.Explanation
	Audit   []admin.AuditEntry
	Payload string
}

func (h *Handler) event(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		h.fail(w, r, http.StatusBadRequest, "an event id is a positive integer")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	ex, err := h.admin.Explain(ctx, id, admin.ExplainOpts{Routes: h.cfg.Routes, RoutesFile: h.cfg.RoutesFile, JobRetention: h.cfg.JobRetention})
	if err != nil {
		h.dbFail(w, r, "the event", err)
		return
	}
	audit, err := h.admin.AuditList(ctx, admin.AuditOpts{EventID: id, Limit: 100})
	if err != nil {
		h.dbFail(w, r, "the event's audit entries", err)
		return
	}
	d := eventData{Ex: ex, Audit: audit}
	if h.cfg.ShowPayloads {
		if ex.Event.PayloadText != nil {
			d.Payload = *ex.Event.PayloadText
		} else {
			d.Payload = string(ex.Event.Payload)
		}
	}
	h.renderView(w, r, http.StatusOK, "event", &view{Title: fmt.Sprintf("Event %d", id), Nav: "events", Data: d})
}

// jobEvent redirects from a River job (by id, as River UI shows it) to the
// page of the event it was handed off for: the way back from River UI,
// whose job page shows the outbox_event_id metadata.
func (h *Handler) jobEvent(w http.ResponseWriter, r *http.Request) {
	jobID, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || jobID <= 0 {
		h.fail(w, r, http.StatusBadRequest, "a River job id is a positive integer")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	id, err := h.admin.EventOfJob(ctx, jobID)
	if errors.Is(err, admin.ErrNotFound) {
		h.fail(w, r, http.StatusNotFound, err.Error())
		return
	}
	if err != nil {
		h.dbFail(w, r, "the River job", err)
		return
	}
	http.Redirect(w, r, h.url("/events/"+strconv.FormatInt(id, 10)), http.StatusFound)
}

func (h *Handler) audit(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	list, err := h.admin.AuditList(ctx, admin.AuditOpts{Limit: 200, Action: r.URL.Query().Get("action")})
	if err != nil {
		h.dbFail(w, r, "the audit", err)
		return
	}
	h.renderView(w, r, http.StatusOK, "audit", &view{Title: "Audit", Data: list})
}

// changeData is the preview and the result of a requeue or cancel.
type changeData struct {
	Res *admin.ChangeResult
	// AllowReplay is carried from the preview to the confirmation.
	AllowReplay bool
}

// change runs Requeue or Cancel as the form says. The preview form names
// either the selected ids (scope=selection) or the filter (scope=filter);
// the confirmation form names the ids the preview listed, with the
// statuses the preview ran with, so a confirmation changes at most what the
// operator saw.
func (h *Handler) change(ctx context.Context, r *http.Request, s *session, dryRun bool) (*changeData, error) {
	f := r.PostForm
	sel := admin.Selection{}
	switch f.Get("scope") {
	case "selection", "ids":
		for _, part := range f["id"] {
			for p := range strings.SplitSeq(part, ",") {
				if p = strings.TrimSpace(p); p == "" {
					continue
				}
				id, err := strconv.ParseInt(p, 10, 64)
				if err != nil || id <= 0 {
					return nil, &admin.SelectionError{Flag: "id", Msg: fmt.Sprintf("%q is not an event id", p)}
				}
				sel.IDs = append(sel.IDs, id)
			}
		}
		if len(sel.IDs) == 0 {
			return nil, &admin.SelectionError{Msg: "select at least one event (tick its box) first"}
		}
		// The confirmation carries the statuses its preview ran with; a
		// selection of ticked events takes the action's defaults (the
		// list's status filter is for the filter scope).
		if f.Get("scope") == "ids" {
			for _, st := range f["status"] {
				if st != "" {
					sel.Statuses = append(sel.Statuses, st)
				}
			}
		}
	case "filter":
		_, opts, err := parseListForm(f, time.Now())
		if err != nil {
			return nil, err
		}
		sel = admin.Selection{Statuses: opts.Statuses, TypePrefix: opts.TypePrefix, Tenant: opts.Tenant, Since: opts.Since, Until: opts.Until, All: f.Get("all") == "on"}
	default:
		return nil, &admin.SelectionError{Msg: "the form names no selection (scope)"}
	}
	actor := "console:" + s.Name
	d := &changeData{AllowReplay: f.Get("allow_replay") == "on"}
	var err error
	switch f.Get("action") {
	case "requeue":
		d.Res, err = h.admin.Requeue(ctx, sel, admin.RequeueOpts{Actor: actor, DryRun: dryRun, AllowReplay: d.AllowReplay})
	case "cancel":
		d.Res, err = h.admin.Cancel(ctx, sel, admin.CancelOpts{Actor: actor, DryRun: dryRun})
	default:
		return nil, &admin.SelectionError{Msg: "the action is requeue or cancel"}
	}
	return d, err
}

func (h *Handler) preview(w http.ResponseWriter, r *http.Request, s *session) {
	ctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
	defer cancel()
	if r.PostForm.Get("action") == "unpark" {
		res, err := h.unpark(ctx, r, s, true)
		if err != nil {
			h.dbFail(w, r, "the preview", err)
			return
		}
		h.renderView(w, r, http.StatusOK, "unpark-preview", &view{Title: "Preview: unpark (" + res.Request.Action + ")", Nav: "keys", Data: res})
		return
	}
	d, err := h.change(ctx, r, s, true)
	if err != nil {
		h.dbFail(w, r, "the preview", err)
		return
	}
	h.renderView(w, r, http.StatusOK, "preview", &view{Title: "Preview: " + d.Res.Action, Nav: "events", Data: d})
}

func (h *Handler) run(w http.ResponseWriter, r *http.Request, s *session) {
	if r.PostForm.Get("action") == "unpark" {
		h.runUnpark(w, r, s)
		return
	}
	if r.PostForm.Get("scope") != "ids" {
		h.fail(w, r, http.StatusBadRequest, "a change runs only from its preview's confirmation")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
	defer cancel()
	d, err := h.change(ctx, r, s, false)
	if err != nil {
		h.dbFail(w, r, "the change", err)
		return
	}
	h.cfg.Logger.Info("console: "+d.Res.Action, slog.String("actor", d.Res.Actor), slog.Int("affected", d.Res.Affected), slog.Int64("audit_id", d.Res.AuditID))
	h.renderView(w, r, http.StatusOK, "result", &view{Title: "Done: " + d.Res.Action, Nav: "events", Data: d})
}

// keysData is the ordering keys page.
type keysData struct {
	List *admin.KeyList
}

// keys lists the ordering keys that wait for an operator (admin.Keys),
// filtered by the query's tenant, key and queue.
func (h *Handler) keys(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	list, err := h.admin.Keys(ctx, admin.KeysFilter{Tenant: strings.TrimSpace(q.Get("tenant")), Key: q.Get("key"),
		Queue: strings.TrimSpace(q.Get("queue")), ParkedOnly: q.Get("parked") == "on", Limit: 500})
	if err != nil {
		h.dbFail(w, r, "the ordering keys", err)
		return
	}
	h.renderView(w, r, http.StatusOK, "keys", &view{Title: "Ordering keys", Data: keysData{List: list}})
}

// unpark runs admin.Unpark as the form says: the key, its tenant and
// queue, and unpark=retry or skip. The keys page's form names the queue
// of the row, so the preview and its confirmation touch that queue only.
func (h *Handler) unpark(ctx context.Context, r *http.Request, s *session, dryRun bool) (*admin.UnparkResult, error) {
	f := r.PostForm
	return h.admin.Unpark(ctx, admin.UnparkRequest{Actor: "console:" + s.Name, Key: f.Get("key"), Tenant: f.Get("tenant"),
		Queue: f.Get("queue"), Action: f.Get("unpark"), DryRun: dryRun, Reason: strings.TrimSpace(f.Get("reason"))})
}

// runUnpark runs an unpark from its preview's confirmation.
func (h *Handler) runUnpark(w http.ResponseWriter, r *http.Request, s *session) {
	if r.PostForm.Get("confirm") != "on" {
		h.fail(w, r, http.StatusBadRequest, "an unpark runs only from its preview's confirmation")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
	defer cancel()
	res, err := h.unpark(ctx, r, s, false)
	if err != nil {
		h.dbFail(w, r, "the unpark", err)
		return
	}
	h.cfg.Logger.Info("console: unpark", slog.String("actor", res.Request.Actor), slog.String("action", res.Request.Action),
		slog.Int("queues", len(res.Keys)), slog.Int64("audit_id", res.AuditID))
	h.renderView(w, r, http.StatusOK, "unpark-result", &view{Title: "Done: unpark (" + res.Request.Action + ")", Nav: "keys", Data: res})
}

// firstLine is the first line of s, at most n bytes (on a rune boundary).
func firstLine(s string, n int) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i] + " …"
	}
	if len(s) > n {
		for n > 0 && !utf8RuneStart(s[n]) {
			n--
		}
		s = s[:n] + "…"
	}
	return s
}

func utf8RuneStart(b byte) bool { return b&0xC0 != 0x80 }
