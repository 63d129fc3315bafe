package console

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/admin"
	"github.com/outboxhq/outbox/route"
)

// Config configures a console Handler.
type Config struct {
	// Pool reaches the outbox's and River's tables. Required.
	Pool *pgxpool.Pool
	// Prefix is the path the handler is mounted at, without a trailing
	// slash ("/console"); "" means the root. Mount the handler at
	// Prefix+"/" (http.ServeMux: mux.Handle("/console/", h)).
	Prefix string
	// RiverUIPrefix is where River UI is mounted ("/riverui"), for the
	// links to jobs and queues; "" means no River UI and no links.
	RiverUIPrefix string
	// Routes, when set, make the overview list every routed queue (with
	// its depth, even before a job or a worker exists) and the event page
	// show the rule that matches; RoutesFile names where they came from.
	Routes     *route.Table
	RoutesFile string
	// Token is the credential that signs an operator in for mutations
	// (requeue, cancel, unpark, River UI's actions): at least 16 bytes. "" means
	// the console is read-only.
	Token string
	// ShowPayloads shows event payloads on the event page and lets River UI
	// (which shows job args) be read without signing in. false (the
	// default) hides them: signed-in operators may still open River UI.
	ShowPayloads bool
	// SampleInterval is how often the overview's series is sampled; 0
	// means 5 s.
	SampleInterval time.Duration
	// SampleWindow is how much of the series is kept; 0 means 10 minutes.
	SampleWindow time.Duration
	// SessionTTL is how long a sign-in lasts; 0 means 12 hours.
	SessionTTL time.Duration
	// JobRetention is River's shortest retention of finalized jobs, for
	// the event page's verdict on a missing job (admin.ExplainOpts); 0
	// means River's default.
	JobRetention time.Duration
	// Logger gets database errors (which pages never show); nil means
	// slog.Default().
	Logger *slog.Logger
}

// MinTokenLen is the shortest Config.Token accepted.
const MinTokenLen = 16

func (c *Config) validate() error {
	if c.Pool == nil {
		return errors.New("console: Config.Pool is required")
	}
	if c.Token != "" && len(c.Token) < MinTokenLen {
		return fmt.Errorf("console: Config.Token is %d bytes: use at least %d (e.g. openssl rand -hex 24)", len(c.Token), MinTokenLen)
	}
	for name, p := range map[string]string{"Prefix": c.Prefix, "RiverUIPrefix": c.RiverUIPrefix} {
		if p != "" && (!strings.HasPrefix(p, "/") || strings.HasSuffix(p, "/")) {
			return fmt.Errorf("console: Config.%s=%q must start with / and not end with one (\"/console\"), or be empty", name, p)
		}
	}
	if c.SampleInterval < 0 || c.SampleWindow < 0 || c.SessionTTL < 0 || c.JobRetention < 0 {
		return errors.New("console: durations in Config must not be negative (0 means the default)")
	}
	if c.SampleInterval == 0 {
		c.SampleInterval = 5 * time.Second
	}
	if c.SampleWindow == 0 {
		c.SampleWindow = 10 * time.Minute
	}
	if c.SessionTTL == 0 {
		c.SessionTTL = 12 * time.Hour
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Handler serves the console. Create it with New, call Start before
// serving and Stop when done.
type Handler struct {
	cfg     Config
	admin   *admin.Client
	mux     *http.ServeMux
	key     []byte // signs the session cookies and CSRF tokens
	sampler *sampler

	mu      sync.Mutex
	cancel  context.CancelFunc
	stopped chan struct{}
}

// New returns a console Handler.
func New(cfg Config) (*Handler, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	h := &Handler{cfg: cfg, admin: admin.New(cfg.Pool), key: make([]byte, 32)}
	if _, err := rand.Read(h.key); err != nil {
		return nil, err
	}
	h.sampler = newSampler(cfg.Pool, cfg.SampleInterval, cfg.SampleWindow, cfg.Logger)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", h.overview)
	mux.HandleFunc("GET /events", h.events)
	mux.HandleFunc("GET /events/{id}", h.event)
	mux.HandleFunc("GET /jobs/{id}", h.jobEvent)
	mux.HandleFunc("GET /audit", h.audit)
	mux.HandleFunc("GET /keys", h.keys)
	mux.HandleFunc("GET /api/series", h.series)
	mux.HandleFunc("GET /static/{file}", h.static)
	mux.HandleFunc("GET /login", h.loginForm)
	mux.HandleFunc("POST /login", h.login)
	mux.HandleFunc("POST /logout", h.mutation(h.logout))
	mux.HandleFunc("POST /actions/preview", h.mutation(h.preview))
	mux.HandleFunc("POST /actions/run", h.mutation(h.run))
	h.mux = mux
	return h, nil
}

// Start starts the sampler of the overview's series; it returns after the
// first sample was attempted. Stop stops it.
func (h *Handler) Start(ctx context.Context) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cancel != nil {
		return errors.New("console: already started")
	}
	ctx, h.cancel = context.WithCancel(ctx)
	h.stopped = make(chan struct{})
	h.sampler.sample(ctx)
	go func() {
		defer close(h.stopped)
		h.sampler.run(ctx)
	}()
	return nil
}

// Stop stops the sampler and waits for it. It is idempotent.
func (h *Handler) Stop() {
	h.mu.Lock()
	cancel, stopped := h.cancel, h.stopped
	h.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	<-stopped
}

// ServeHTTP serves the pages under Config.Prefix.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	header := w.Header()
	header.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
	header.Set("X-Frame-Options", "DENY")
	header.Set("X-Content-Type-Options", "nosniff")
	header.Set("Referrer-Policy", "same-origin")
	header.Set("Cache-Control", "no-store")
	path, ok := strings.CutPrefix(r.URL.Path, h.cfg.Prefix)
	if !ok || (path != "" && !strings.HasPrefix(path, "/")) {
		http.NotFound(w, r)
		return
	}
	if path == "" {
		http.Redirect(w, r, h.cfg.Prefix+"/", http.StatusFound)
		return
	}
	r2 := r.Clone(r.Context())
	r2.URL.Path = path
	r2.URL.RawPath = ""
	h.mux.ServeHTTP(w, r2)
}

// url is a path under the console's prefix.
func (h *Handler) url(path string) string { return h.cfg.Prefix + path }
