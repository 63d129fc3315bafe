package claim

import (
	"context"
	"errors"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestBatchTxHonoursThePgxTxContract runs pgx's documented Tx behaviours
// against the transaction a batch hands to River (begun in the claim's
// round trip): River and any future caller may use every method of it.
func TestBatchTxHonoursThePgxTxContract(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	h := &Handoff{Pool: s.Pool}

	// begin opens a batch transaction on a connection of its own, with the
	// claim of up to 10 events, and hands back both.
	begin := func(t *testing.T) (*pgxpool.Conn, pgx.Tx) {
		t.Helper()
		conn, err := s.Pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(conn.Release)
		tx, _, err := h.begin(ctx, conn.Conn(), budgetedClaimSQL, 10, DefaultBatchBytes, outbox.MaxPayloadBytes)
		if err != nil {
			t.Fatal(err)
		}
		if st := conn.Conn().PgConn().TxStatus(); st != 'T' {
			t.Fatalf("after begin the session's transaction status is %q, want T (in a transaction)", st)
		}
		return conn, tx
	}

	// closedEverywhere checks that every method of a closed tx refuses to
	// run, and that nothing ran in autocommit on the connection instead.
	closedEverywhere := func(t *testing.T, conn *pgxpool.Conn, tx pgx.Tx) {
		t.Helper()
		check := func(what string, err error) {
			t.Helper()
			if !errors.Is(err, pgx.ErrTxClosed) {
				t.Errorf("%s on a closed tx: %v, want ErrTxClosed", what, err)
			}
		}
		_, err := tx.Exec(ctx, `CREATE TEMP TABLE leaked (x int)`)
		check("Exec", err)
		rows, err := tx.Query(ctx, `SELECT 1`)
		check("Query", err)
		if rows != nil {
			rows.Close()
		}
		var one int
		check("QueryRow", tx.QueryRow(ctx, `SELECT 1`).Scan(&one))
		_, err = tx.CopyFrom(ctx, pgx.Identifier{"leaked"}, []string{"x"}, pgx.CopyFromRows([][]any{{1}}))
		check("CopyFrom", err)
		b := &pgx.Batch{}
		b.Queue(`SELECT 1`)
		br := tx.SendBatch(ctx, b)
		_, err = br.Exec()
		check("SendBatch", err)
		_ = br.Close()
		_, err = tx.Prepare(ctx, "leaked", `SELECT 1`)
		check("Prepare", err)
		_, err = tx.Begin(ctx)
		check("Begin", err)
		lo := tx.LargeObjects()
		_, err = lo.Create(ctx, 0)
		check("LargeObjects().Create", err)
		check("Commit", tx.Commit(ctx))
		check("Rollback", tx.Rollback(ctx))

		if st := conn.Conn().PgConn().TxStatus(); st != 'I' {
			t.Errorf("the session's transaction status is %q, want I (idle)", st)
		}
		var leaked bool
		if err := conn.QueryRow(ctx, `SELECT to_regclass('pg_temp.leaked') IS NOT NULL`).Scan(&leaked); err != nil {
			t.Fatal(err)
		}
		if leaked {
			t.Error("a statement on the closed tx ran in autocommit")
		}
	}

	t.Run("every method refuses after Commit", func(t *testing.T) {
		conn, tx := begin(t)
		if err := finish(ctx, tx, nil, nil, nil); err != nil {
			t.Fatal(err)
		}
		closedEverywhere(t, conn, tx)
	})

	t.Run("every method refuses after Rollback, and the claim's locks are released", func(t *testing.T) {
		id := pgtest.Publish(t, s.Pool, outbox.Event{Type: "mail.a.b", Payload: []byte(`{}`)})[0]
		conn, tx := begin(t)
		var locked bool
		err := s.Pool.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM outbox_event WHERE id = $1 FOR UPDATE SKIP LOCKED)`, id).Scan(&locked)
		if err != nil || !locked {
			t.Fatalf("the batch transaction does not hold the claimed row's lock: locked=%v err=%v", locked, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		closedEverywhere(t, conn, tx)
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM (SELECT 1 FROM outbox_event WHERE id = $1 FOR UPDATE NOWAIT) l`, id); n != 1 {
			t.Fatalf("row %d after rollback: %d", id, n)
		}
	})

	t.Run("Commit after Rollback and Rollback after Commit return ErrTxClosed", func(t *testing.T) {
		_, tx := begin(t)
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxClosed) {
			t.Fatalf("Commit after Rollback: %v, want ErrTxClosed", err)
		}
		_, tx = begin(t)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(ctx); !errors.Is(err, pgx.ErrTxClosed) {
			t.Fatalf("Rollback after Commit: %v, want ErrTxClosed", err)
		}
	})

	t.Run("nested Begin is a savepoint whose Rollback undoes only its part", func(t *testing.T) {
		conn, tx := begin(t)
		if _, err := tx.Exec(ctx, `CREATE TEMP TABLE nested (x int)`); err != nil {
			t.Fatal(err)
		}
		exec := func(tx pgx.Tx, x int) {
			t.Helper()
			if _, err := tx.Exec(ctx, `INSERT INTO nested VALUES ($1)`, x); err != nil {
				t.Fatal(err)
			}
		}
		exec(tx, 1)
		undone, err := tx.Begin(ctx)
		if err != nil {
			t.Fatalf("nested Begin: %v", err)
		}
		exec(undone, 2)
		if err := undone.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		exec(tx, 3)
		kept, err := tx.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		exec(kept, 4)
		if err := kept.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := finish(ctx, tx, nil, nil, nil); err != nil {
			t.Fatal(err)
		}
		var got []int32
		if err := conn.QueryRow(ctx, `SELECT array_agg(x ORDER BY x) FROM nested`).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if len(got) != 3 || got[0] != 1 || got[1] != 3 || got[2] != 4 {
			t.Fatalf("committed rows %v, want [1 3 4]", got)
		}
	})

	t.Run("Conn returns the connection", func(t *testing.T) {
		conn, tx := begin(t)
		if tx.Conn() != conn.Conn() {
			t.Fatal("Conn() is not the batch's connection")
		}
		rollback(ctx, tx)
	})

	t.Run("LargeObjects works inside the tx and is rolled back with it", func(t *testing.T) {
		_, tx := begin(t)
		lo := tx.LargeObjects()
		oid, err := lo.Create(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		obj, err := lo.Open(ctx, oid, pgx.LargeObjectModeWrite|pgx.LargeObjectModeRead)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := obj.Write([]byte("outbox")); err != nil {
			t.Fatal(err)
		}
		if err := obj.Close(); err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if n := pgtest.Count(t, s.Pool, `SELECT count(*) FROM pg_largeobject_metadata WHERE oid = $1`, oid); n != 0 {
			t.Fatalf("large object %d outlived the rolled-back tx", oid)
		}
	})

	t.Run("Commit of an aborted tx reports ErrTxCommitRollback", func(t *testing.T) {
		conn, tx := begin(t)
		if _, err := tx.Exec(ctx, `SELECT 1/0`); err == nil {
			t.Fatal("division by zero succeeded")
		}
		if err := finish(ctx, tx, nil, nil, nil); !errors.Is(err, pgx.ErrTxCommitRollback) {
			t.Fatalf("commit: %v, want ErrTxCommitRollback", err)
		}
		if st := conn.Conn().PgConn().TxStatus(); st != 'I' {
			t.Fatalf("the session's transaction status is %q, want I (idle)", st)
		}
	})

	t.Run("a failed claim leaves the connection idle and usable", func(t *testing.T) {
		conn, err := s.Pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		if _, _, err := h.begin(ctx, conn.Conn(), `SELECT * FROM no_such_table`); err == nil {
			t.Fatal("claim from a missing table succeeded")
		}
		if st := conn.Conn().PgConn().TxStatus(); st != 'I' || conn.Conn().IsClosed() {
			t.Fatalf("after a failed claim: status %q, closed %v; want an idle open connection", st, conn.Conn().IsClosed())
		}
	})
}

// TestRollbackIgnoresCancellation: the rollback of a batch whose
// context is done still ends the transaction on the server.
func TestRollbackIgnoresCancellation(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 60*time.Second)
	h := &Handoff{Pool: s.Pool}
	conn, err := s.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	tx, _, err := h.begin(ctx, conn.Conn(), budgetedClaimSQL, 10, DefaultBatchBytes, outbox.MaxPayloadBytes)
	if err != nil {
		t.Fatal(err)
	}
	done, cancel := context.WithCancel(ctx)
	cancel()
	rollback(done, tx)
	if st := conn.Conn().PgConn().TxStatus(); st != 'I' || conn.Conn().IsClosed() {
		t.Fatalf("after rollback with a done context: status %q, closed %v; want an idle open connection", st, conn.Conn().IsClosed())
	}
}

// TestRollbackOfAHungConnectionIsBounded: when the server stops answering
// (a network partition), the rollback of a batch gives up after
// rollbackTimeout and pgx closes the connection, instead of blocking the
// dispatcher forever.
func TestRollbackOfAHungConnectionIsBounded(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 120*time.Second)
	cfg, err := pgx.ParseConfig(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	p := newFreezer(t, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
	cfg.Host, cfg.Port, cfg.Fallbacks = "127.0.0.1", p.port, nil
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	h := &Handoff{Pool: s.Pool}
	tx, _, err := h.begin(ctx, conn, budgetedClaimSQL, 10, DefaultBatchBytes, outbox.MaxPayloadBytes)
	if err != nil {
		t.Fatal(err)
	}
	p.freeze()
	done := make(chan struct{})
	go func() {
		defer close(done)
		rollback(ctx, tx)
	}()
	// rollbackTimeout plus pgx's grace after its cancel request, with room
	// for a loaded machine.
	select {
	case <-done:
	case <-time.After(rollbackTimeout + 25*time.Second):
		t.Fatal("the rollback of a hung connection did not return")
	}
	if !conn.IsClosed() {
		t.Fatal("after a failed rollback the connection is still open: its session state is unknown")
	}
}

// freezer is a TCP proxy to a Postgres server that can stop forwarding
// (freeze), as a network partition would.
type freezer struct {
	port   uint16
	frozen chan struct{} // closed by freeze
}

func newFreezer(t *testing.T, target string) *freezer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &freezer{port: uint16(ln.Addr().(*net.TCPAddr).Port), frozen: make(chan struct{})}
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	track := func(c net.Conn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
	}
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				_ = client.Close()
				continue
			}
			track(client)
			track(server)
			go f.pipe(server, client)
			go f.pipe(client, server)
		}
	}()
	return f
}

func (f *freezer) freeze() { close(f.frozen) }

// pipe copies src to dst until src fails; once frozen it drops whatever it
// reads and forwards nothing more.
func (f *freezer) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if err != nil {
			return
		}
		select {
		case <-f.frozen:
			continue
		default:
		}
		if _, err := dst.Write(buf[:n]); err != nil {
			return
		}
	}
}

// TestFinishOptionalStatement: a failing optional statement (run last,
// under a savepoint) is rolled back alone, reported to its onFail, and the
// statements before it commit; a failing statement that is not optional
// fails the whole transaction.
func TestFinishOptionalStatement(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t, nil)
	ctx := pgtest.Context(t, 30*time.Second)
	if _, err := s.Pool.Exec(ctx, `CREATE TABLE finish_probe (what text)`); err != nil {
		t.Fatal(err)
	}
	insert := func(what string) queued {
		return queued{what: "insert " + what, sql: `INSERT INTO finish_probe VALUES ($1)`, args: []any{what}}
	}
	failing := queued{what: "fail", sql: `INSERT INTO finish_probe SELECT 'never' WHERE 1/0 = 1`}
	run := func(opt *optional, stmts ...queued) error {
		tx, err := s.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer rollback(ctx, tx)
		return finish(ctx, tx, stmts, opt, nil)
	}

	var failed error
	opt := &optional{queued: failing, onFail: func(err error) { failed = err }}
	var n int
	optRow := &optional{queued: queued{what: "count", sql: `SELECT count(*) FROM finish_probe`, row: []any{&n}}}
	if err := run(optRow, insert("kept")); err != nil || n != 1 {
		t.Fatalf("finish with an optional statement that succeeds: %v, count %d, want nil and 1", err, n)
	}
	if err := run(opt, insert("kept too")); err != nil {
		t.Fatalf("finish with a failing optional statement: %v, want nil", err)
	}
	if failed == nil || !strings.Contains(failed.Error(), "division by zero") {
		t.Errorf("onFail got %v, want the division by zero", failed)
	}
	if err := run(nil, insert("lost"), failing); err == nil || !strings.Contains(err.Error(), "division by zero") {
		t.Errorf("finish with a failing statement: %v, want the division by zero", err)
	}
	rows, err := s.Pool.Query(ctx, `SELECT what FROM finish_probe ORDER BY what`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, []string{"kept", "kept too"}) {
		t.Errorf("rows committed: %q, want kept and kept too", got)
	}
}
