// Package proctest helps tests that run the project's binaries as
// subprocesses (outboxd in cmd/outboxd's tests and in the chaos suite).
package proctest

import (
	"bytes"
	"sync"
)

// SyncBuffer collects a subprocess's output; it is safe to read while the
// process writes.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write implements io.Writer.
func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
