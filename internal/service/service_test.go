package service_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/service"
)

// loopService is a service whose loop finishes its work in flight (until
// release is closed, or the hard stop) after a soft stop.
type loopService struct {
	name    string
	life    service.Lifecycle
	log     *[]string
	mu      *sync.Mutex
	release chan struct{}
	failing bool
	hard    chan struct{} // closed when the loop saw the hard stop
}

func (s *loopService) record(what string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	*s.log = append(*s.log, what+" "+s.name)
}

func (s *loopService) Start(ctx context.Context) error {
	if s.failing {
		return errors.New("no")
	}
	s.record("start")
	return s.life.Go(ctx, func(run, work context.Context) {
		<-run.Done()
		select {
		case <-s.release:
		case <-work.Done():
			close(s.hard)
		}
	})
}

func (s *loopService) Stop(ctx context.Context) error {
	err := s.life.Stop(ctx)
	if s.life.Stopped() != nil {
		s.record("stop")
	}
	return err
}

func newLoop(name string, log *[]string, mu *sync.Mutex) *loopService {
	return &loopService{name: name, log: log, mu: mu, release: make(chan struct{}), hard: make(chan struct{})}
}

func TestGroupStartsInOrderStopsInReverse(t *testing.T) {
	t.Parallel()
	var (
		log []string
		mu  sync.Mutex
	)
	a, b := newLoop("a", &log, &mu), newLoop("b", &log, &mu)
	close(a.release)
	close(b.release)
	var g service.Group
	if err := g.Start(context.Background(), service.Named{Name: "a", Service: a}, service.Named{Name: "b", Service: b}); err != nil {
		t.Fatal(err)
	}
	if err := g.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if want := []string{"start a", "start b", "stop b", "stop a"}; !slices.Equal(log, want) {
		t.Fatalf("order %v, want %v", log, want)
	}
	// Stop is idempotent, a second Start is refused.
	if err := a.Stop(context.Background()); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	if err := a.Start(context.Background()); !errors.Is(err, service.ErrStarted) {
		t.Fatalf("restart: %v, want ErrStarted", err)
	}
}

func TestGroupStartFailureStopsTheStarted(t *testing.T) {
	t.Parallel()
	var (
		log []string
		mu  sync.Mutex
	)
	a, b := newLoop("a", &log, &mu), newLoop("b", &log, &mu)
	close(a.release)
	b.failing = true
	var g service.Group
	err := g.Start(context.Background(), service.Named{Name: "a", Service: a}, service.Named{Name: "b", Service: b})
	var se *service.Error
	if !errors.As(err, &se) || se.Name != "b" || se.Op != "start" {
		t.Fatalf("Start = %v, want a start error naming b", err)
	}
	if want := []string{"start a", "stop a"}; !slices.Equal(log, want) {
		t.Fatalf("order %v, want %v", log, want)
	}
}

// TestStopSoftThenHard: Stop waits for the work in flight; when its ctx
// ends first, the work context is cancelled and Stop returns ctx's error
// after the loop has returned.
func TestStopSoftThenHard(t *testing.T) {
	t.Parallel()
	var (
		log []string
		mu  sync.Mutex
	)
	soft := newLoop("soft", &log, &mu)
	if err := soft.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	stopped := make(chan error, 1)
	go func() { stopped <- soft.Stop(context.Background()) }()
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned (%v) while work was in flight", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(soft.release)
	if err := <-stopped; err != nil {
		t.Fatalf("soft stop: %v", err)
	}

	hard := newLoop("hard", &log, &mu)
	if err := hard.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := hard.Stop(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("hard stop: %v, want context.Canceled", err)
	}
	select {
	case <-hard.hard:
	default:
		t.Fatal("Stop returned before the loop saw the hard stop")
	}
	// Stop before Start is a no-op.
	if err := newLoop("never", &log, &mu).Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
}
