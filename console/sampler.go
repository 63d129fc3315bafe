package console

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Point is one sample of the overview's series.
type Point struct {
	// At is the database's clock when sampled.
	At time.Time `json:"at"`
	// PublishPerS is events written per second since the previous sample
	// (rows with an id above the previous sample's highest id; an event
	// committed late with a lower id is not counted).
	PublishPerS float64 `json:"publish_per_s"`
	// HandoffPerS is events handed to River per second since the previous
	// sample (done rows whose processed_at falls in between).
	HandoffPerS float64 `json:"handoff_per_s"`
	// Pending (the due backlog: events scheduled for later are not in it)
	// and Failed are counts at the sample.
	Pending int64 `json:"pending"`
	Failed  int64 `json:"failed"`
	// OldestPendingS is the age of the oldest due pending event, in
	// seconds (0 when none is due).
	OldestPendingS float64 `json:"oldest_pending_s"`
}

// sampleSQL reads one sample; each part uses an index: the primary key
// (ids above the last one), outbox_event_done_idx (processed_at of done
// rows) and outbox_event_claim_idx (pending rows by scheduled_at). $1 is
// the previous highest id, $2 the previous sample's time; both are NULL on
// the first sample, which then counts nothing (a CASE evaluates its
// sub-select only when taken), so that start-up does not count the table.
const sampleSQL = `
SELECT now(),
       coalesce((SELECT max(id) FROM outbox_event), 0),
       CASE WHEN $1::bigint IS NOT NULL THEN (SELECT count(*) FROM outbox_event WHERE id > $1::bigint) ELSE 0 END,
       CASE WHEN $2::timestamptz IS NOT NULL THEN (SELECT count(*) FROM outbox_event
            WHERE status = 'done' AND processed_at > $2::timestamptz AND processed_at <= now()) ELSE 0 END,
       (SELECT count(*) FROM outbox_event WHERE status = 'pending' AND scheduled_at <= now()),
       (SELECT count(*) FROM outbox_event WHERE status = 'failed'),
       coalesce((SELECT extract(epoch FROM now() - min(scheduled_at)) FROM outbox_event
                 WHERE status = 'pending' AND scheduled_at <= now()), 0)::float8`

// sampler keeps the last window of points.
type sampler struct {
	pool     *pgxpool.Pool
	interval time.Duration
	keep     int
	logger   *slog.Logger

	mu     sync.Mutex
	points []Point
	maxID  int64
	last   time.Time // zero before the first sample
	// onSample, when set (tests), is called after each sample.
	onSample func()
}

func newSampler(pool *pgxpool.Pool, interval, window time.Duration, logger *slog.Logger) *sampler {
	keep := max(int(window/interval), 2)
	return &sampler{pool: pool, interval: interval, keep: keep, logger: logger}
}

func (s *sampler) run(ctx context.Context) {
	t := time.NewTicker(s.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.sample(ctx)
		}
	}
}

// sample reads one point. The first one only sets the baseline of the
// rates; an error is logged and the point skipped.
func (s *sampler) sample(ctx context.Context) {
	s.mu.Lock()
	prevID, prevAt := s.maxID, s.last
	s.mu.Unlock()
	var (
		fromID *int64
		since  *time.Time
	)
	if !prevAt.IsZero() {
		fromID, since = &prevID, &prevAt
	}
	// A sample may take longer than the interval on a busy database; the
	// next one then waits (the ticker drops the ticks in between).
	qctx, cancel := context.WithTimeout(ctx, max(s.interval, 10*time.Second))
	defer cancel()
	var (
		p                Point
		maxID, published int64
		handed           int64
	)
	err := s.pool.QueryRow(qctx, sampleSQL, fromID, since).Scan(&p.At, &maxID, &published, &handed, &p.Pending, &p.Failed, &p.OldestPendingS)
	if err != nil {
		if ctx.Err() == nil {
			s.logger.Warn("console: sampling the overview's series failed", slog.String("error", err.Error()))
		}
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !prevAt.IsZero() {
		if secs := p.At.Sub(prevAt).Seconds(); secs > 0 {
			p.PublishPerS = float64(published) / secs
			p.HandoffPerS = float64(handed) / secs
		}
		s.points = append(s.points, p)
		if len(s.points) > s.keep {
			s.points = append(s.points[:0], s.points[len(s.points)-s.keep:]...)
		}
	}
	s.maxID, s.last = maxID, p.At
	if s.onSample != nil {
		s.onSample()
	}
}

// series returns a copy of the kept points, oldest first.
func (s *sampler) series() []Point {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Point{}, s.points...)
}
