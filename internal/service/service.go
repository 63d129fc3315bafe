// Package service is the one start/stop shape of outboxd's long-running
// components (the dispatcher, the listener, the retention runner), after
// River's startstop package, and the list that starts them in order and
// stops them in reverse.
//
// The shape:
//
//   - Start(ctx) error starts the component's goroutine and returns once it
//     runs, or returns why it could not start. ctx bounds the start-up only:
//     cancelling it later does not stop the component (call Stop). A second
//     Start is an error: a component is not restarted.
//   - Stop(ctx) error is the soft stop: the component finishes the work in
//     flight (the dispatcher's batches) and returns nil once its goroutines
//     have exited. When ctx ends first, the work in flight is cancelled (the
//     hard stop) and Stop returns ctx's error, still only after the
//     goroutines have exited. Stop is idempotent and safe before Start.
//
// River's startstop has Stop() without a context and separate Started and
// Stopped channels; here Start returns only once the goroutine runs (so no
// Started channel is needed) and Stop takes the deadline of the soft stop,
// as River's Client.Stop(ctx) does, because the dispatcher's soft stop waits
// for transactions that a shutdown timeout must be able to cut short.
//
// Lifecycle implements the bookkeeping behind that shape for a component
// with one loop goroutine.
package service

import (
	"context"
	"errors"
	"sync"
)

// Service is a component that starts and stops (see the package comment).
type Service interface {
	Start(ctx context.Context) error
	Stop(ctx context.Context) error
}

// Lifecycle is the start/stop bookkeeping of a component with one loop
// goroutine. Its zero value is ready; embed or hold it by value in the
// component.
type Lifecycle struct {
	mu      sync.Mutex
	started bool
	soft    context.CancelFunc // cancels the loop's run context: Stop was called
	hard    context.CancelFunc // cancels the work context: Stop's ctx ended
	done    chan struct{}
}

// ErrStarted is returned by a second Start.
var ErrStarted = errors.New("already started")

// Go starts loop in a goroutine and returns at once; it returns ErrStarted
// when the lifecycle was started before. loop gets two contexts, neither
// derived from the caller's cancellation (ctx's values are kept): run ends
// when Stop is called (a soft stop: stop taking new work), and work ends
// when Stop's ctx ends first (a hard stop: abandon the work in flight).
// work outlives run, so work in flight started with work finishes after a
// soft stop. loop must return soon after run ends and before work ends
// plus the time to roll back what is in flight.
func (l *Lifecycle) Go(ctx context.Context, loop func(run, work context.Context)) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.started {
		return ErrStarted
	}
	l.started = true
	work, hard := context.WithCancel(context.WithoutCancel(ctx))
	run, soft := context.WithCancel(work)
	l.soft, l.hard, l.done = soft, hard, make(chan struct{})
	go func() {
		defer close(l.done)
		loop(run, work)
	}()
	return nil
}

// Stop asks the loop to stop (cancels run) and waits for it to return. If
// ctx ends first, it cancels work and returns ctx's error once the loop has
// returned. It is idempotent and a no-op before Go.
func (l *Lifecycle) Stop(ctx context.Context) error {
	l.mu.Lock()
	soft, hard, done := l.soft, l.hard, l.done
	l.mu.Unlock()
	if done == nil {
		return nil
	}
	soft()
	defer hard()
	select {
	case <-done:
		return nil
	default:
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		hard()
		<-done
		return ctx.Err()
	}
}

// Stopped returns a channel closed once the loop has returned (nil before
// Go).
func (l *Lifecycle) Stopped() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.done
}

// Named is a service with the name used in logs and errors.
type Named struct {
	Name string
	Service
}

// Group starts services in order and stops the started ones in reverse
// order: a service may rely on those started before it for as long as it
// runs.
type Group struct {
	started []Named
}

// Start starts each service in order. When one fails, it stops those
// already started (in reverse, with ctx) and returns the failure, naming
// the service.
func (g *Group) Start(ctx context.Context, services ...Named) error {
	for _, s := range services {
		if err := s.Start(ctx); err != nil {
			_ = g.Stop(context.WithoutCancel(ctx))
			return &Error{Name: s.Name, Op: "start", Err: err}
		}
		g.started = append(g.started, s)
	}
	return nil
}

// Stop stops the started services in reverse order, each with ctx (so a
// shutdown timeout is shared: once it has passed, the rest are stopped
// hard), and returns their errors joined.
func (g *Group) Stop(ctx context.Context) error {
	var errs []error
	for i := len(g.started) - 1; i >= 0; i-- {
		s := g.started[i]
		if err := s.Stop(ctx); err != nil {
			errs = append(errs, &Error{Name: s.Name, Op: "stop", Err: err})
		}
	}
	g.started = nil
	return errors.Join(errs...)
}

// Error says which service failed to start or stop.
type Error struct {
	Name string
	Op   string // "start" or "stop"
	Err  error
}

func (e *Error) Error() string { return e.Op + " " + e.Name + ": " + e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }
