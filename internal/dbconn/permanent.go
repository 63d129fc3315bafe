package dbconn

import (
	"errors"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// permanentCodes are the SQLSTATEs a server answers a connection attempt with
// when retrying cannot help: the credentials, the role or the database are
// wrong, and they stay wrong until someone changes the configuration.
// Roles, passwords, databases and grants are replicated, so every host of
// one cluster gives the same answer; pg_hba.conf is not, so a 28000 that
// comes from it is permanent only when no other host could still answer
// (see permanentError).
//
// Everything else is retried: connection refused, a server starting up or
// shutting down (57P03, 57P01), too many connections (53300), a standby
// refused by target_session_attrs=read-write during a failover.
var permanentCodes = map[string]string{
	"28P01": "invalid_password",
	"28000": "invalid_authorization_specification", // role does not exist, may not log in, no pg_hba.conf entry
	"3D000": "invalid_catalog_name",                // database does not exist
	"42501": "insufficient_privilege",              // no CONNECT privilege on the database
}

// permanentError returns the server error that makes err, from a connection
// attempt, permanent, or nil. pgconn joins the errors of every host it
// tried (errors.Join), so each attempt is looked at, not only the first
// branch errors.As would follow:
//   - a permanent code other than a pg_hba.conf refusal on any host decides;
//   - a pg_hba.conf refusal (28000) decides unless another host failed in a
//     way that may pass (unreachable, starting up, read-only): the hosts of
//     a multi-host URL may be configured differently.
func permanentError(err error) *pgconn.PgError {
	attempts := []error{err}
	for e := err; e != nil; e = errors.Unwrap(e) {
		if j, ok := e.(interface{ Unwrap() []error }); ok {
			attempts = j.Unwrap()
			break
		}
	}
	var hba *pgconn.PgError
	transient := false
	for _, a := range attempts {
		var pe *pgconn.PgError
		var ne net.Error
		switch {
		case errors.As(a, &pe):
			if _, perm := permanentCodes[pe.Code]; !perm {
				transient = true
			} else if pe.Code == "28000" && strings.Contains(pe.Message, "pg_hba.conf") {
				hba = pe
			} else {
				return pe
			}
		case errors.As(a, &ne), pgconn.Timeout(a), strings.Contains(a.Error(), "ValidateConnect"):
			transient = true
		}
	}
	if hba != nil && !transient {
		return hba
	}
	return nil
}

// IsPermanent reports whether err, from a connection attempt, is one that
// retrying cannot fix (a wrong password, role or database name).
func IsPermanent(err error) bool { return permanentError(err) != nil }

// ErrPermanent is wrapped by Open's error when the server refused the
// connection for a reason retrying cannot fix; Open then fails at once
// instead of retrying for Options.Wait.
var ErrPermanent = errors.New("permanent connection error")
