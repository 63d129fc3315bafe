package outboxriver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultReceiptTTL is how long a receipt or a claim suppresses duplicate
// deliveries when Receiver.TTL is 0. A job is redelivered after a crash
// (River rescues a stuck job after an hour by default), a timeout, or an
// operator's retry; the TTL must be longer than the window in which that
// can happen.
const DefaultReceiptTTL = 24 * time.Hour

// MaxReceiverNameBytes is the longest Receiver.Name.
const MaxReceiverNameBytes = 128

// Receiver names one idempotent effect. Receipts and claims are keyed by
// (Name, event id): two receivers of one event (a fan-out, or one handler
// with two effects) need two names, and a receiver must keep its name
// across deploys.
type Receiver struct {
	// Name is the receiver's stable name, 1 to 128 bytes, e.g. "mailer" or
	// "billing.ledger". Required.
	Name string
	// TTL is how long a receipt (WithIdempotency) or a claim (WithClaim)
	// suppresses duplicates; after it the row is ignored and purged
	// (PurgeReceipts). 0 means DefaultReceiptTTL (24 h).
	TTL time.Duration
}

func (r Receiver) ttl() (time.Duration, error) {
	switch {
	case r.Name == "":
		return 0, errors.New("outboxriver: Receiver.Name is empty: give each receiver a stable name, e.g. \"mailer\"")
	case len(r.Name) > MaxReceiverNameBytes:
		return 0, fmt.Errorf("outboxriver: Receiver.Name %q is %d bytes, the limit is %d", r.Name, len(r.Name), MaxReceiverNameBytes)
	case r.TTL < 0:
		return 0, fmt.Errorf("outboxriver: Receiver.TTL of %q is negative (%s); 0 means the default of %s", r.Name, r.TTL, DefaultReceiptTTL)
	case r.TTL == 0:
		return DefaultReceiptTTL, nil
	default:
		return r.TTL, nil
	}
}

// receiptSQL writes the receipt of a same-database effect, or finds that
// one is already there. ON CONFLICT waits for a concurrent transaction that
// inserted the same key: if it commits, this statement returns no row (a
// duplicate); if it rolls back, this one inserts. An expired row is taken
// over, so a delivery after the TTL applies the effect again.
const receiptSQL = `
INSERT INTO outbox_receipt AS r (receiver, event_id, state, job_id, attempt, completed_at, expires_at)
VALUES ($1, $2, 'done', $3, $4, now(), now() + make_interval(secs => $5))
ON CONFLICT (receiver, event_id) DO UPDATE
SET state = 'done', job_id = EXCLUDED.job_id, attempt = EXCLUDED.attempt, result = NULL, token = NULL,
    created_at = now(), completed_at = now(), expires_at = EXCLUDED.expires_at
WHERE r.expires_at <= now()
RETURNING true`

// WithIdempotency applies a same-database effect exactly once per
// (receiver, event). Inside tx, it writes the receipt row keyed by
// (r.Name, ev.ID), runs fn with tx (the effect's writes), and completes
// ev's River job with river.JobCompleteTx. When tx commits, the effect, the
// receipt and the job's completion are all visible; when it rolls back,
// none is, and River's retry runs fn again. A redelivered job (after a
// crash between commit and River's own completion, or a second job for the
// same event) finds the receipt: fn does not run, the job is completed,
// and duplicate is true.
//
// WithIdempotency never commits tx: the caller does, and a handler that
// returns nil after the commit is done. Because committing completes the
// job, call it once per handler, as the handler's last step; a second
// effect needs its own receiver and job. ctx must be the worker's context
// (it carries River's client, which JobCompleteTx needs). An Event built by
// hand or by EventFromMetadata, not from a running job, gets the receipt
// without a job completion. A plain river.Worker[T] of a River-native route
// gets its Event from JobEvent, or calls WithIdempotencyJob.
func WithIdempotency(ctx context.Context, tx pgx.Tx, r Receiver, ev Event, fn func(ctx context.Context, tx pgx.Tx) error) (duplicate bool, err error) {
	ttl, err := r.ttl()
	if err != nil {
		return false, err
	}
	var applied bool
	err = tx.QueryRow(ctx, receiptSQL, r.Name, ev.ID, nullID(ev.JobID), nullAttempt(ev.Attempt), ttl.Seconds()).Scan(&applied)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		duplicate = true
	case err != nil:
		return false, fmt.Errorf("outboxriver: write receipt of event %d for %s: %w", ev.ID, r.Name, err)
	default:
		if err := fn(ctx, tx); err != nil {
			return false, err
		}
	}
	if ev.complete != nil {
		if err := ev.complete(ctx, tx); err != nil {
			return duplicate, fmt.Errorf("outboxriver: complete job %d of event %d in the receiver's transaction: %w", ev.JobID, ev.ID, err)
		}
	}
	return duplicate, nil
}

// ErrClaimHeld is returned by WithClaim when another delivery of the same
// (receiver, event) holds the claim and has not finished. Returned from a
// handler, it makes River retry the job later, when the claim is done (the
// retry gets the cached result) or released (the retry runs the effect).
var ErrClaimHeld = errors.New("outboxriver: claim held by another delivery")

// ErrClaimLost is returned by WithClaim when the effect ran but the claim
// had expired and been taken by another delivery before the result could be
// recorded: the effect may have run twice. Raise Receiver.TTL above the
// longest effect.
var ErrClaimLost = errors.New("outboxriver: claim expired and was taken over while the effect ran")

// claimSQL takes the claim of (receiver, event) in one statement: it
// inserts, or takes over a row whose TTL has passed, or a row left
// 'claimed' by an earlier attempt of the same job (that attempt crashed or
// could not release: River never runs two attempts of one job at once,
// short of rescuing a job stuck for hours). Any other row is kept and the
// statement returns nothing.
const claimSQL = `
INSERT INTO outbox_receipt AS r (receiver, event_id, state, job_id, attempt, token, expires_at)
VALUES ($1, $2, 'claimed', $3, $4, $5, now() + make_interval(secs => $6))
ON CONFLICT (receiver, event_id) DO UPDATE
SET state = 'claimed', job_id = EXCLUDED.job_id, attempt = EXCLUDED.attempt, token = EXCLUDED.token,
    result = NULL, created_at = now(), completed_at = NULL, expires_at = EXCLUDED.expires_at
WHERE r.expires_at <= now()
   OR (r.state = 'claimed' AND r.job_id = EXCLUDED.job_id AND r.attempt < EXCLUDED.attempt)
RETURNING true`

const claimStateSQL = `
SELECT state, result, job_id, attempt, expires_at
FROM outbox_receipt WHERE receiver = $1 AND event_id = $2`

// claimDoneSQL records the result; the token guard makes sure the claim is
// still ours. The TTL restarts at completion.
const claimDoneSQL = `
UPDATE outbox_receipt
SET state = 'done', result = $4, token = NULL, completed_at = now(), expires_at = now() + make_interval(secs => $5)
WHERE receiver = $1 AND event_id = $2 AND token = $3`

const claimReleaseSQL = `
DELETE FROM outbox_receipt WHERE receiver = $1 AND event_id = $2 AND token = $3`

// WithClaim applies an external effect (a mail, an HTTP call) at most once
// per (receiver, event) while its claim lives, and returns the effect's
// result to every duplicate delivery.
//
// It first takes a claim keyed by (r.Name, ev.ID) in its own committed
// statement, so concurrent deliveries see it. Then:
//
//   - claim taken: fn runs. On success its result is stored as JSON and
//     the claim becomes a receipt that lives r.TTL; WithClaim returns the
//     result with duplicate false. On error (or panic) the claim is
//     released and fn's error returned, so River's retry runs fn again.
//   - the effect is already done: fn does not run; the stored result is
//     decoded into T and returned with duplicate true.
//   - another delivery is running fn now: an error wrapping ErrClaimHeld
//     (return it; River retries later).
//
// A delivery that dies inside fn leaves its claim; the next attempt of the
// same job takes it over and runs fn again, and any other delivery waits
// for the TTL. Whether the dead attempt's effect happened is unknowable
// from here, so pass ev.ID to the remote side as its idempotency key where
// it takes one. WithClaim writes through pool and does not complete the
// job: the handler returns nil and River completes it.
func WithClaim[T any](ctx context.Context, pool *pgxpool.Pool, r Receiver, ev Event, fn func(ctx context.Context) (T, error)) (result T, duplicate bool, err error) {
	var zero T
	ttl, err := r.ttl()
	if err != nil {
		return zero, false, err
	}
	token, err := newToken()
	if err != nil {
		return zero, false, err
	}
	for try := 0; ; try++ {
		var taken bool
		err := pool.QueryRow(ctx, claimSQL, r.Name, ev.ID, nullID(ev.JobID), nullAttempt(ev.Attempt), token, ttl.Seconds()).Scan(&taken)
		if err == nil {
			break
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return zero, false, fmt.Errorf("outboxriver: claim event %d for %s: %w", ev.ID, r.Name, err)
		}
		var (
			state     string
			raw       []byte
			jobID     *int64
			attempt   *int
			expiresAt time.Time
		)
		err = pool.QueryRow(ctx, claimStateSQL, r.Name, ev.ID).Scan(&state, &raw, &jobID, &attempt, &expiresAt)
		if errors.Is(err, pgx.ErrNoRows) && try < 3 {
			continue // released between the two statements: claim again
		}
		if err != nil {
			return zero, false, fmt.Errorf("outboxriver: read claim of event %d for %s: %w", ev.ID, r.Name, err)
		}
		if state == "done" {
			if len(raw) > 0 {
				if err := json.Unmarshal(raw, &result); err != nil {
					return zero, true, fmt.Errorf("outboxriver: cached result of %s for event %d does not decode into %T: %w", r.Name, ev.ID, result, err)
				}
			}
			return result, true, nil
		}
		holder := "a delivery without a job"
		if jobID != nil {
			holder = fmt.Sprintf("job %d", *jobID)
			if attempt != nil {
				holder += fmt.Sprintf(" (attempt %d)", *attempt)
			}
		}
		return zero, false, fmt.Errorf("%w: %s holds the claim of event %d for %s until %s",
			ErrClaimHeld, holder, ev.ID, r.Name, expiresAt.UTC().Format(time.RFC3339))
	}

	// The claim is ours. Record the outcome even if ctx ends meanwhile (a
	// job timeout right after the effect must not lose the result).
	finish := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	}
	release := func() error {
		fctx, cancel := finish()
		defer cancel()
		if _, err := pool.Exec(fctx, claimReleaseSQL, r.Name, ev.ID, token); err != nil {
			return fmt.Errorf("outboxriver: release claim of event %d for %s (the job's next attempt takes it over): %w", ev.ID, r.Name, err)
		}
		return nil
	}
	ok := false
	defer func() {
		if !ok {
			if p := recover(); p != nil {
				_ = release()
				panic(p)
			}
		}
	}()
	result, err = fn(ctx)
	if err != nil {
		ok = true
		return zero, false, errors.Join(err, release())
	}
	ok = true
	raw, merr := json.Marshal(result)
	if merr != nil {
		// The effect happened: keep the claim as done (without a result)
		// rather than releasing it and running the effect again.
		raw = nil
		merr = fmt.Errorf("outboxriver: result of %s for event %d is not JSON-encodable, duplicates get the zero value: %w", r.Name, ev.ID, merr)
	}
	fctx, cancel := finish()
	defer cancel()
	tag, err := pool.Exec(fctx, claimDoneSQL, r.Name, ev.ID, token, raw, ttl.Seconds())
	if err != nil {
		return result, false, fmt.Errorf("outboxriver: the effect of %s for event %d ran but its result was not recorded (the job's next attempt will run it again): %w", r.Name, ev.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return result, false, fmt.Errorf("%w (receiver %s, event %d)", ErrClaimLost, r.Name, ev.ID)
	}
	return result, false, merr
}

// purgeReceiptsSQL deletes up to $1 receipts and claims whose TTL has
// passed, oldest first. An expired row no longer suppresses anything, so
// deleting it changes no outcome. SKIP LOCKED lets several purgers (and a
// WithClaim taking over an expired row) run at once; the CTE locks exactly
// the rows it deletes. docs/receivers.md shows it for purging from SQL.
const purgeReceiptsSQL = `
WITH expired AS (
    SELECT receiver, event_id FROM outbox_receipt
    WHERE expires_at < now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED)
DELETE FROM outbox_receipt r USING expired e
WHERE r.receiver = e.receiver AND r.event_id = e.event_id`

// Execer is what PurgeReceipts needs: a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// PurgeReceipts deletes one batch of at most limit expired receipts and
// claims, oldest first, and returns how many it deleted. An expired row no
// longer suppresses anything, so deleting it changes no outcome; several
// purgers may run at once (they skip each other's rows). Call it until it
// returns fewer than limit. limit < 1 means 1000.
func PurgeReceipts(ctx context.Context, db Execer, limit int) (int64, error) {
	if limit < 1 {
		limit = 1000
	}
	tag, err := db.Exec(ctx, purgeReceiptsSQL, limit)
	if err != nil {
		return 0, fmt.Errorf("outboxriver: purge receipts: %w", err)
	}
	return tag.RowsAffected(), nil
}

func newToken() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("outboxriver: claim token: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

func nullID(id int64) *int64 {
	if id == 0 {
		return nil
	}
	return &id
}

func nullAttempt(a int) *int {
	if a == 0 {
		return nil
	}
	return &a
}
