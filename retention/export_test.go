package retention

// SetBeforeCommit installs a hook run inside every batch transaction after
// the delete, before the commit (tests hold a batch open with it).
func SetBeforeCommit(c *Config, f func()) { c.beforeCommit = f }
