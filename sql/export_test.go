package outboxsql

// MigrateTo and SplitStatements are for tests only.
var (
	MigrateTo       = migrateTo
	SplitStatements = splitStatements
)
