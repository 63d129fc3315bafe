package dbconn

import (
	"errors"
	"fmt"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// The classification of joined per-host errors (the shape pgconn returns
// for a multi-host URL); the single-host cases run against the server in
// open_test.go.
func TestPermanentErrorAcrossHosts(t *testing.T) {
	t.Parallel()
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	hba := &pgconn.PgError{Code: "28000", Message: `no pg_hba.conf entry for host "10.0.0.1", user "app", database "app", no encryption`}
	noRole := &pgconn.PgError{Code: "28000", Message: `role "app" does not exist`}
	badPassword := &pgconn.PgError{Code: "28P01", Message: `password authentication failed for user "app"`}
	starting := &pgconn.PgError{Code: "57P03", Message: "the database system is starting up"}
	readOnly := fmt.Errorf("ValidateConnect failed: %w", errors.New("read only connection"))
	join := func(errs ...error) error { return fmt.Errorf("failed to connect: %w", errors.Join(errs...)) }
	for _, tc := range []struct {
		name      string
		err       error
		permanent bool
	}{
		{"wrong password", join(badPassword), true},
		{"unknown role behind a dead host", join(refused, noRole), true},
		{"pg_hba refusal, single host", join(hba), true},
		{"pg_hba refusal, other host unreachable", join(hba, refused), false},
		{"pg_hba refusal, other host starting up", join(starting, hba), false},
		{"pg_hba refusal, other host a standby", join(hba, readOnly), false},
		{"all hosts unreachable", join(refused, refused), false},
		{"starting up", join(starting), false},
		{"not joined", fmt.Errorf("x: %w", badPassword), true},
	} {
		if got := IsPermanent(tc.err); got != tc.permanent {
			t.Errorf("%s: IsPermanent = %v, want %v", tc.name, got, tc.permanent)
		}
	}
}
