package admin

// EventListSQL is the event list's query, for the plan test.
const EventListSQL = eventListSQL
