package dbconn

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Failover support.
//
// A multi-host DATABASE_URL (postgres://h1:5432,h2:5432/db) lets pgx try the
// hosts in order on every new connection. Without target_session_attrs it
// takes the first host that answers, which after a failover may be the old
// primary back as a read-only standby; Open therefore defaults a multi-host
// URL to target_session_attrs=read-write, so that every new connection
// (pool, listener, wake lock) lands on the current primary.
//
// pgx checks target_session_attrs only when a connection opens. A
// connection that later answers SQLSTATE 25006 (read_only_sql_transaction:
// "cannot execute … in a read-only transaction" or "… during recovery") is
// on a node that no longer takes writes, and retrying on it fails forever
// (River's leader has been seen stuck for hours like that). The pool's
// tracer marks such a connection and the pool destroys it when it is
// released instead of reusing it; the next connection is opened afresh and
// goes to the read-write host. This covers every user of the pool: the
// dispatcher's batches, the listener's heartbeat, retention, and River's
// clients built on it.

// targetSessionAttrs matches an explicit target_session_attrs in either
// form of connection string, and captures its value.
var targetSessionAttrs = regexp.MustCompile(`(?i)(?:^|[?&\s])target_session_attrs\s*=\s*'?([a-z-]*)`)

// multiHost reports whether c names more than one host:port (pgx also puts
// the same host into Fallbacks for sslmode=prefer's plain-text retry; that
// does not count).
func multiHost(c *pgconn.Config) bool {
	first := fmt.Sprintf("%s:%d", c.Host, c.Port)
	for _, fb := range c.Fallbacks {
		if fmt.Sprintf("%s:%d", fb.Host, fb.Port) != first {
			return true
		}
	}
	return false
}

// configureFailover applies the read-write default to a multi-host url and
// installs the eviction of read-only connections on cfg.
func configureFailover(cfg *pgxpool.Config, url string, logger *slog.Logger) {
	target := os.Getenv("PGTARGETSESSIONATTRS")
	if m := targetSessionAttrs.FindStringSubmatch(url); m != nil {
		target = m[1]
	}
	if target == "" && multiHost(&cfg.ConnConfig.Config) && cfg.ConnConfig.ValidateConnect == nil {
		cfg.ConnConfig.ValidateConnect = pgconn.ValidateConnectTargetSessionAttrsReadWrite
		target = "read-write"
	}
	wantWrite := target == "read-write" || target == "primary"

	cfg.ConnConfig.Tracer = readOnlyTracer{}
	prev := cfg.AfterRelease
	cfg.AfterRelease = func(c *pgx.Conn) bool {
		why := ""
		switch {
		case ReadOnly(c):
			why = "it answered SQLSTATE 25006 (read-only transaction)"
		case wantWrite && OnReadOnlyNode(c):
			why = "its server reports that it is a standby or read-only"
		}
		if why != "" {
			logger.Warn("closing a database connection: "+why+"; the server is no longer the primary, new connections go to the read-write host",
				slog.String("host", c.PgConn().Conn().RemoteAddr().String()))
			return false
		}
		return prev == nil || prev(c)
	}
}

// OnReadOnlyNode reports whether the server of c has told it (PostgreSQL 14
// and later report these settings on every change, with the reply to the
// next statement) that it is a hot standby or that its transactions default
// to read-only, as on a fenced old primary. It costs no round trip, and it
// is false when the server does not report them. A dedicated session that
// must be on the primary (the dispatcher's wake lock) checks it before
// reuse; the pool opened by Open drops such connections on release when it
// targets a read-write host.
func OnReadOnlyNode(c *pgx.Conn) bool {
	pc := c.PgConn()
	return pc.ParameterStatus("in_hot_standby") == "on" || pc.ParameterStatus("default_transaction_read_only") == "on"
}

// readOnlyKey is the CustomData key that marks a connection to be evicted.
const readOnlyKey = "outbox.dbconn.read_only"

// ReadOnly reports whether c has answered SQLSTATE 25006 since it opened;
// the pool opened by Open destroys such a connection when it is released.
// Code holding a connection outside the pool may close it on the same sign.
func ReadOnly(c *pgx.Conn) bool {
	v, _ := c.PgConn().CustomData()[readOnlyKey].(bool)
	return v
}

// IsReadOnly reports whether err is SQLSTATE 25006 (read_only_sql_transaction).
func IsReadOnly(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "25006"
}

func markIfReadOnly(c *pgx.Conn, err error) {
	if c != nil && err != nil && IsReadOnly(err) {
		c.PgConn().CustomData()[readOnlyKey] = true
	}
}

// readOnlyTracer marks connections whose statements fail with 25006. It
// implements every pgx tracer that reports a statement's error: queries
// (Query, QueryRow, Exec, and so transactions' BEGIN/COMMIT), batches,
// COPY and Prepare.
type readOnlyTracer struct{}

func (readOnlyTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (readOnlyTracer) TraceQueryEnd(_ context.Context, c *pgx.Conn, d pgx.TraceQueryEndData) {
	markIfReadOnly(c, d.Err)
}

func (readOnlyTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (readOnlyTracer) TraceBatchQuery(_ context.Context, c *pgx.Conn, d pgx.TraceBatchQueryData) {
	markIfReadOnly(c, d.Err)
}

func (readOnlyTracer) TraceBatchEnd(_ context.Context, c *pgx.Conn, d pgx.TraceBatchEndData) {
	markIfReadOnly(c, d.Err)
}

func (readOnlyTracer) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceCopyFromStartData) context.Context {
	return ctx
}

func (readOnlyTracer) TraceCopyFromEnd(_ context.Context, c *pgx.Conn, d pgx.TraceCopyFromEndData) {
	markIfReadOnly(c, d.Err)
}

func (readOnlyTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

func (readOnlyTracer) TracePrepareEnd(_ context.Context, c *pgx.Conn, d pgx.TracePrepareEndData) {
	markIfReadOnly(c, d.Err)
}
