package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
)

// cpuMeter reads the CPU time this process and the Postgres server have
// used, so that a run can report CPU per event: a cost that, unlike
// latency, another load on the machine barely changes. The server's time
// is its postmaster's (with the children it reaped: exited backends) plus
// every live child's, read from /proc, so it is only known when the server
// runs on this machine and /proc shows it (the throwaway cluster of `make
// bench` does); otherwise it reads as unknown.
type cpuMeter struct {
	postmaster int // 0: the server's processes cannot be read
}

// newCPUMeter finds the postmaster of the server p is connected to.
func newCPUMeter(ctx context.Context, p *pgxpool.Pool) *cpuMeter {
	var pid int
	if err := p.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		return &cpuMeter{}
	}
	f, err := procStatFields(pid)
	if err != nil {
		return &cpuMeter{}
	}
	ppid, _ := strconv.Atoi(f[1])
	return &cpuMeter{postmaster: ppid}
}

// cpuReading is CPU seconds used so far: this process, and the server
// (negative when unknown).
type cpuReading struct{ self, server float64 }

func (m *cpuMeter) read() cpuReading {
	r := cpuReading{server: -1}
	if f, err := procStatFields(os.Getpid()); err == nil {
		r.self = ticks(f[11]) + ticks(f[12])
	}
	if m.postmaster == 0 {
		return r
	}
	f, err := procStatFields(m.postmaster)
	if err != nil {
		return r
	}
	// utime, stime, cutime, cstime of the postmaster.
	server := ticks(f[11]) + ticks(f[12]) + ticks(f[13]) + ticks(f[14])
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return r
	}
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		cf, err := procStatFields(pid)
		if err != nil || cf[1] != strconv.Itoa(m.postmaster) {
			continue
		}
		server += ticks(cf[11]) + ticks(cf[12])
	}
	r.server = server
	return r
}

// CPUCost is the CPU time a run used per event, in milliseconds.
type CPUCost struct {
	// Bench is this process: producers, dispatcher, River workers and the
	// measurement itself.
	Bench float64 `json:"bench_ms_per_event"`
	// Server is the Postgres server's processes (negative: unknown).
	Server float64 `json:"server_ms_per_event"`
}

func (m *cpuMeter) cost(from, to cpuReading, events int) *CPUCost {
	if events == 0 {
		return nil
	}
	c := &CPUCost{Bench: (to.self - from.self) * 1000 / float64(events), Server: -1}
	if from.server >= 0 && to.server >= 0 {
		c.Server = (to.server - from.server) * 1000 / float64(events)
	}
	return c
}

func (c *CPUCost) String() string {
	if c == nil {
		return "–"
	}
	if c.Server < 0 {
		return fmt.Sprintf("%.2f + ?", c.Bench)
	}
	return fmt.Sprintf("%.2f + %.2f", c.Bench, c.Server)
}

// procStatFields returns the fields of /proc/PID/stat after the command
// name (which may contain spaces): [0] is the state, [1] the parent's pid,
// [11] to [14] utime, stime, cutime and cstime in clock ticks.
func procStatFields(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 15 {
		return nil, fmt.Errorf("short /proc/%d/stat", pid)
	}
	return f, nil
}

func ticks(s string) float64 {
	v, _ := strconv.ParseFloat(s, 64)
	return v / clockTicks
}
