package outboxsql

// For tests only.
var (
	MigrateTo       = migrateTo
	SplitStatements = splitStatements
)

func DropConcurrently(stmt string) string { return concurrently.ReplaceAllString(stmt, "$1") }
