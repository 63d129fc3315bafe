package outbox

// TypePattern is the event-type regexp, for rules_test.go, which checks
// that the database's copies of the rule are the same text.
var TypePattern = typePattern
