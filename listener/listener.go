// Package listener is the dispatcher's wake source: pgxlisten on a dedicated
// connection, LISTENing on the outbox_wake channel, turning notifications
// into a coalesced wake signal (a 1-slot channel fed by non-blocking sends).
//
// pgxlisten reconnects after ReconnectDelay when its connection fails, but
// it has no heartbeat: a connection that dies silently would wait forever.
// The listener therefore pings itself: every PingInterval it sends a NOTIFY
// with a token of its own through the pool and expects it back on the
// listening connection; when no pong arrives for three intervals it tears
// the connection down and starts over. Every (re)connect and every
// disconnect sends a wake, so the dispatcher runs a claim pass right after a
// reconnect (notifications sent while disconnected are lost) and stops
// relying on notifications while disconnected.
package listener

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgxlisten"

	"github.com/outboxhq/outbox/internal/service"
)

// channel is the notification channel of the wake trigger (outbox_wake,
// migration 001).
const channel = "outbox_wake"

// pingChannel carries the listener's heartbeat.
const pingChannel = "outbox_wake_ping"

// Config configures a Listener.
type Config struct {
	// ConnConfig is used for the dedicated LISTEN connection. Required.
	ConnConfig *pgx.ConnConfig
	// Pool sends the heartbeat notifications. Required.
	Pool *pgxpool.Pool
	// Payload filters notifications: only those whose payload equals it wake
	// (the trigger sends TG_TABLE_SCHEMA, the schema that holds
	// outbox_event, which is not always current_schema()). Required.
	Payload string
	// ReconnectDelay is the wait before reconnecting after a failure.
	// 0 means 1 s (pgxlisten's own default of one minute is far too long).
	ReconnectDelay time.Duration
	// PingInterval is the heartbeat period; a connection is declared dead
	// after three intervals without a pong. 0 means 2 s.
	PingInterval time.Duration
	// Logger; nil discards. Every (re)connect is logged at info level
	// ("outbox listener connected") and every disconnect, outside Stop, at
	// warn level ("outbox listener disconnected; ...").
	Logger *slog.Logger
}

// Listener turns wake notifications into a coalesced signal.
type Listener struct {
	cfg   Config
	token string
	wake  chan struct{}

	connected atomic.Bool
	// connects counts the connections made (Connects).
	connects atomic.Uint64
	stopping atomic.Bool
	lastPong atomic.Int64 // unix nanos

	life service.Lifecycle
}

// New returns a Listener; call Start to run it.
func New(cfg Config) (*Listener, error) {
	if cfg.ConnConfig == nil {
		return nil, errors.New("listener: ConnConfig is required")
	}
	if cfg.Pool == nil {
		return nil, errors.New("listener: Pool is required")
	}
	if cfg.Payload == "" {
		return nil, errors.New("listener: Payload is required")
	}
	if cfg.ReconnectDelay <= 0 {
		cfg.ReconnectDelay = time.Second
	}
	if cfg.PingInterval <= 0 {
		cfg.PingInterval = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	return &Listener{cfg: cfg, token: hex.EncodeToString(b[:]), wake: make(chan struct{}, 1)}, nil
}

// Wake returns the coalesced wake signal: at most one pending token.
func (l *Listener) Wake() <-chan struct{} { return l.wake }

// Connected reports whether the LISTEN connection is up.
func (l *Listener) Connected() bool { return l.connected.Load() }

// Connects counts the LISTEN connections made so far: a change says the
// listener reconnected (and notifications may have been lost) in between.
func (l *Listener) Connects() uint64 { return l.connects.Load() }

func (l *Listener) signal() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

func (l *Listener) setConnected(v bool) {
	if v && !l.connected.Load() {
		// Counted before Connected says so: a reader that sees the new
		// connection sees its count.
		l.connects.Add(1)
	}
	if l.connected.Swap(v) == v {
		return
	}
	if v {
		l.cfg.Logger.Info("outbox listener connected", slog.String("channel", channel))
	} else if !l.stopping.Load() {
		l.cfg.Logger.Warn("outbox listener disconnected; falling back to polling until it reconnects")
	}
	l.signal()
}

// Start runs the listener until Stop and returns at once (the shape of
// package service: the first connection is made in the background, and
// Connected reports it).
func (l *Listener) Start(ctx context.Context) error {
	if err := l.life.Go(ctx, func(run, _ context.Context) { l.run(run) }); err != nil {
		return fmt.Errorf("listener: %w", err)
	}
	return nil
}

// Stop stops the listener and waits for its goroutines (it has no work in
// flight to finish: ctx only bounds the wait). It is idempotent.
func (l *Listener) Stop(ctx context.Context) error {
	l.stopping.Store(true)
	err := l.life.Stop(ctx)
	l.connected.Store(false)
	return err
}

// handler implements pgxlisten's Handler and BacklogHandler for the wake
// channel. HandleBacklog runs right after each LISTEN, i.e. on every
// (re)connect.
type handler struct{ l *Listener }

func (h handler) HandleNotification(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	if n.Payload == h.l.cfg.Payload {
		h.l.signal()
	}
	return nil
}

func (h handler) HandleBacklog(context.Context, string, *pgx.Conn) error {
	h.l.lastPong.Store(time.Now().UnixNano())
	h.l.setConnected(true)
	return nil
}

type pingHandler struct{ l *Listener }

// HandleNotification counts a pong only while the listening session is on
// a node that takes writes: LISTEN and NOTIFY work on a primary fenced
// read-only (a switchover), so without this check the listener would stay
// there, alive and deaf, after the producers moved to the new primary. A
// read-only answer lets the watchdog reconnect (target_session_attrs picks
// the new primary).
func (h pingHandler) HandleNotification(ctx context.Context, n *pgconn.Notification, conn *pgx.Conn) error {
	if n.Payload != h.l.token {
		return nil
	}
	var ro string
	qctx, cancel := context.WithTimeout(ctx, h.l.cfg.PingInterval)
	defer cancel()
	if err := conn.QueryRow(qctx, `SHOW transaction_read_only`).Scan(&ro); err != nil {
		// Not counted as a pong: a broken session fails its next wait,
		// a stuck one is torn down by the watchdog. Returning the error
		// would mark a live connection disconnected (LogError).
		h.l.cfg.Logger.Warn("outbox listener heartbeat check failed", slog.String("error", err.Error()))
		return nil
	}
	if ro == "on" {
		h.l.cfg.Logger.Warn("outbox listener is on a read-only node (a standby or a fenced old primary); reconnecting")
		return nil
	}
	h.l.lastPong.Store(time.Now().UnixNano())
	return nil
}

func (l *Listener) run(ctx context.Context) {
	for ctx.Err() == nil {
		l.listenOnce(ctx)
	}
}

// listenOnce runs one pgxlisten.Listener and its watchdog until the
// watchdog declares the connection dead or ctx ends.
func (l *Listener) listenOnce(ctx context.Context) {
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()

	pl := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) {
			l.setConnected(false)
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			return pgx.ConnectConfig(cctx, l.cfg.ConnConfig.Copy())
		},
		LogError: func(ctx context.Context, err error) {
			// Handlers never fail, so every error here means the
			// connection is gone (or could not be made).
			l.setConnected(false)
			if ctx.Err() == nil {
				l.cfg.Logger.Warn("outbox listener error", slog.String("error", err.Error()))
			}
		},
		ReconnectDelay: l.cfg.ReconnectDelay,
	}
	pl.Handle(channel, handler{l})
	pl.Handle(pingChannel, pingHandler{l})

	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = pl.Listen(lctx)
	}()
	defer func() {
		cancel()
		<-done
		l.setConnected(false)
	}()

	ticker := time.NewTicker(l.cfg.PingInterval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-done:
			return
		case <-ticker.C:
			if !l.connected.Load() {
				continue
			}
			last := time.Unix(0, l.lastPong.Load())
			if time.Since(last) > 3*l.cfg.PingInterval {
				l.cfg.Logger.Warn("outbox listener heartbeat lost; reconnecting",
					slog.Duration("since_last_pong", time.Since(last).Round(time.Millisecond)))
				return
			}
			pctx, pcancel := context.WithTimeout(ctx, l.cfg.PingInterval)
			_, err := l.cfg.Pool.Exec(pctx, `SELECT pg_notify($1, $2)`, pingChannel, l.token)
			pcancel()
			if err != nil && ctx.Err() == nil {
				l.cfg.Logger.Warn("outbox listener heartbeat failed", slog.String("error", fmt.Sprint(err)))
			}
		}
	}
}
