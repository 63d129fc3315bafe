package console

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"time"
	"unicode"
)

// CookieName is the session cookie. Its path is "/", so that a River UI
// mounted beside the console sees the same sign-in.
const CookieName = "outbox_console_session"

// session is a signed-in operator, carried in the cookie as
// base64(JSON).base64(HMAC-SHA256 of the JSON).
type session struct {
	Name    string `json:"n"`
	Expires int64  `json:"e"`
	// ID is random per sign-in; the CSRF token is derived from it.
	ID string `json:"s"`
}

func (h *Handler) sign(b []byte) []byte {
	m := hmac.New(sha256.New, h.key)
	m.Write(b)
	return m.Sum(nil)
}

// Session returns the signed-in operator's name, or "" when the request
// carries no valid, unexpired session.
func (h *Handler) Session(r *http.Request) string {
	s := h.session(r)
	if s == nil {
		return ""
	}
	return s.Name
}

func (h *Handler) session(r *http.Request) *session {
	if h.cfg.Token == "" {
		return nil
	}
	c, err := r.Cookie(CookieName)
	if err != nil {
		return nil
	}
	body, sig, ok := strings.Cut(c.Value, ".")
	if !ok {
		return nil
	}
	raw, err1 := base64.RawURLEncoding.DecodeString(body)
	mac, err2 := base64.RawURLEncoding.DecodeString(sig)
	if err1 != nil || err2 != nil || !hmac.Equal(mac, h.sign(raw)) {
		return nil
	}
	var s session
	if json.Unmarshal(raw, &s) != nil || time.Now().Unix() >= s.Expires || s.Name == "" {
		return nil
	}
	return &s
}

// csrfToken is the session's CSRF token (a per-session value the forms
// carry; a cross-site page can neither read it nor forge it).
func (h *Handler) csrfToken(s *session) string {
	return hex.EncodeToString(h.sign([]byte("csrf\x00" + s.ID)))
}

// sameOrigin reports whether a state-changing request comes from a page of
// this host: its Origin (or, without one, its Referer) must be this
// request's scheme and host, and Sec-Fetch-Site, when sent, must not say
// cross-site. A request with neither header is refused.
func sameOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" && site != "none" {
		return false
	}
	origin := r.Header.Get("Origin")
	if origin == "" || origin == "null" {
		ref := r.Header.Get("Referer")
		if ref == "" {
			return false
		}
		u, err := url.Parse(ref)
		if err != nil {
			return false
		}
		origin = u.Scheme + "://" + u.Host
	}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	return strings.EqualFold(origin, scheme+"://"+r.Host)
}

// mutation wraps a handler that changes something: it needs a signed-in
// session, the session's CSRF token in the form field "csrf", and a
// same-origin request.
func (h *Handler) mutation(next func(http.ResponseWriter, *http.Request, *session)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
		if !sameOrigin(r) {
			h.fail(w, r, http.StatusForbidden, "refused: the request does not come from this console's own pages (Origin check)")
			return
		}
		s := h.session(r)
		if s == nil {
			h.fail(w, r, http.StatusUnauthorized, h.signInHint())
			return
		}
		if err := r.ParseForm(); err != nil {
			h.fail(w, r, http.StatusBadRequest, "bad form")
			return
		}
		if subtle.ConstantTimeCompare([]byte(r.PostForm.Get("csrf")), []byte(h.csrfToken(s))) != 1 {
			h.fail(w, r, http.StatusForbidden, "refused: the form's CSRF token is missing or stale; reload the page and try again")
			return
		}
		next(w, r, s)
	}
}

func (h *Handler) signInHint() string {
	if h.cfg.Token == "" {
		return "this console is read-only: requeue and cancel need a credential (outboxd: set OUTBOX_CONSOLE_TOKEN)"
	}
	return "sign in first: requeue and cancel need the console token"
}

func (h *Handler) loginForm(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	h.renderLogin(w, r, http.StatusOK, loginData{Next: safeNext(h, q.Get("next")), Enabled: h.cfg.Token != "", Why: q.Get("why") == "riverui"})
}

type loginData struct {
	Next    string
	Enabled bool
	Error   string
	Name    string
	// Why says River UI sent the operator here.
	Why bool
}

// login checks the token (in constant time) and sets the session cookie.
// It needs a same-origin request too, so that no other site signs a
// browser in under a name of its choosing.
func (h *Handler) login(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if !sameOrigin(r) {
		h.fail(w, r, http.StatusForbidden, "refused: the request does not come from this console's own pages (Origin check)")
		return
	}
	if err := r.ParseForm(); err != nil {
		h.fail(w, r, http.StatusBadRequest, "bad form")
		return
	}
	data := loginData{Next: safeNext(h, r.PostForm.Get("next")), Enabled: h.cfg.Token != "", Name: r.PostForm.Get("name")}
	if h.cfg.Token == "" {
		h.renderLogin(w, r, http.StatusForbidden, data)
		return
	}
	// Hashing both sides makes the comparison's time independent of the
	// lengths too.
	got, want := sha256.Sum256([]byte(r.PostForm.Get("token"))), sha256.Sum256([]byte(h.cfg.Token))
	if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
		data.Error = "wrong token"
		h.renderLogin(w, r, http.StatusUnauthorized, data)
		return
	}
	name := strings.TrimSpace(data.Name)
	if !validName(name) {
		data.Error = "your name (it goes in the audit table): 1 to 64 printable characters"
		h.renderLogin(w, r, http.StatusBadRequest, data)
		return
	}
	id := make([]byte, 16)
	if _, err := rand.Read(id); err != nil {
		h.fail(w, r, http.StatusInternalServerError, "cannot draw a session id")
		return
	}
	s := session{Name: name, Expires: time.Now().Add(h.cfg.SessionTTL).Unix(), ID: hex.EncodeToString(id)}
	raw, _ := json.Marshal(s)
	http.SetCookie(w, &http.Cookie{
		Name:     CookieName,
		Value:    base64.RawURLEncoding.EncodeToString(raw) + "." + base64.RawURLEncoding.EncodeToString(h.sign(raw)),
		Path:     "/",
		MaxAge:   int(h.cfg.SessionTTL.Seconds()),
		HttpOnly: true,
		Secure:   r.TLS != nil,
		SameSite: http.SameSiteStrictMode,
	})
	http.Redirect(w, r, data.Next, http.StatusSeeOther)
}

func (h *Handler) logout(w http.ResponseWriter, r *http.Request, _ *session) {
	http.SetCookie(w, &http.Cookie{Name: CookieName, Value: "", Path: "/", MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, h.url("/"), http.StatusSeeOther)
}

func validName(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !unicode.IsPrint(c) {
			return false
		}
	}
	return true
}

// safeNext keeps a post-sign-in redirect on this host: a path under the
// console's or River UI's prefix, never another site.
func safeNext(h *Handler, next string) string {
	if strings.HasPrefix(next, "/") && !strings.HasPrefix(next, "//") && !strings.Contains(next, "\\") &&
		(strings.HasPrefix(next, h.url("/")) || (h.cfg.RiverUIPrefix != "" && strings.HasPrefix(next, h.cfg.RiverUIPrefix+"/"))) {
		return next
	}
	return h.url("/")
}

// GuardRiverUI wraps a mounted River UI with the console's rules. River UI
// shows job args (for the outbox's jobs, the event payload), so reading it
// needs Config.ShowPayloads or a signed-in operator; its actions (cancel,
// retry and delete jobs, pause queues), which are every method but GET and
// HEAD, need a signed-in operator and a same-origin request. River UI's
// own fetches carry the session cookie and an Origin header; the cookie is
// SameSite=Strict, so another site's page cannot use it.
func (h *Handler) GuardRiverUI(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		signedIn := h.session(r) != nil
		read := r.Method == http.MethodGet || r.Method == http.MethodHead
		switch {
		case read && (h.cfg.ShowPayloads || signedIn):
		case read:
			if strings.Contains(r.URL.Path, "/api/") {
				http.Error(w, "River UI shows job args (event payloads): sign in to the console or enable payloads", http.StatusUnauthorized)
				return
			}
			http.Redirect(w, r, h.url("/login")+"?next="+url.QueryEscape(r.URL.RequestURI())+"&why=riverui", http.StatusSeeOther)
			return
		case !signedIn:
			http.Error(w, h.signInHint()+" (River UI's actions)", http.StatusUnauthorized)
			return
		case !sameOrigin(r):
			http.Error(w, "refused: the request does not come from this host's pages (Origin check)", http.StatusForbidden)
			return
		}
		next.ServeHTTP(w, r)
	})
}
