package dbconn

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

// permanentCodes are the SQLSTATEs a server answers a connection attempt with
// when retrying cannot help: the credentials, the role or the database are
// wrong, and they stay wrong until someone changes the configuration. Every
// host of one cluster shares its roles, passwords and databases, so one
// host's answer speaks for all of them.
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

// permanentError returns the first server error in err's tree whose
// SQLSTATE is in permanentCodes, or nil. pgconn joins the errors of every
// host it tried (errors.Join), so the whole tree is searched, not only the
// first branch errors.As would follow.
func permanentError(err error) *pgconn.PgError {
	var found *pgconn.PgError
	var walk func(error) bool
	walk = func(e error) bool {
		if e == nil {
			return false
		}
		if pe, ok := e.(*pgconn.PgError); ok {
			if _, perm := permanentCodes[pe.Code]; perm {
				found = pe
				return true
			}
		}
		switch u := e.(type) {
		case interface{ Unwrap() []error }:
			for _, c := range u.Unwrap() {
				if walk(c) {
					return true
				}
			}
		case interface{ Unwrap() error }:
			return walk(u.Unwrap())
		}
		return false
	}
	walk(err)
	return found
}

// IsPermanent reports whether err, from a connection attempt, is one that
// retrying cannot fix (a wrong password, role or database name).
func IsPermanent(err error) bool { return permanentError(err) != nil }

// ErrPermanent is wrapped by Open's error when the server refused the
// connection for a reason retrying cannot fix; Open then fails at once
// instead of retrying for Options.Wait.
var ErrPermanent = errors.New("permanent connection error")
