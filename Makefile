# Targets (run `make help`). Every target that needs Postgres finds one with
# scripts/with-postgres.sh: TEST_DATABASE_URL/DATABASE_URL, else
# 127.0.0.1:5432, else a throwaway cluster it starts and removes.

GO        ?= go
WITH_PG   := scripts/with-postgres.sh
GOLANGCI  ?= $(shell command -v golangci-lint 2>/dev/null || echo $(shell $(GO) env GOPATH)/bin/golangci-lint)

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

.PHONY: demo
demo: ## run the demo: a real dispatcher, two River worker groups, a retry, a suppressed duplicate, latency percentiles
	$(WITH_PG) $(GO) run ./cmd/outbox-demo $(DEMO_FLAGS)

.PHONY: test
test: ## run every test with -race against a real Postgres (the bench module's too)
	$(WITH_PG) $(GO) test -race -count=1 -timeout 15m ./...
	cd bench && ../$(WITH_PG) $(GO) test -race -count=1 -timeout 5m ./...

.PHONY: test-short
test-short: ## the tests without the slow ones
	$(WITH_PG) $(GO) test -race -count=1 -short ./...

.PHONY: build
build: ## build outboxd and outboxctl into bin/
	$(GO) build -o bin/ ./cmd/...

.PHONY: lint
lint: ## gofmt, go vet and golangci-lint (.golangci.yml)
	@test -z "$$(gofmt -l . | tee /dev/stderr)" || (echo "gofmt: files above need formatting" >&2; exit 1)
	$(GO) vet ./...
	cd bench && $(GO) vet ./...
	@if [ -x "$(GOLANGCI)" ]; then $(GOLANGCI) run ./... && cd bench && $(GOLANGCI) run --config ../.golangci.yml ./...; else echo "golangci-lint not installed: go install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0"; fi

.PHONY: bench
# The bench measures on a throwaway cluster with production-like settings
# (scripts/with-postgres.sh, OUTBOX_PG_PROFILE=production) unless
# BENCH_PG=existing, which uses the server the tests use and prints its
# settings (loudly when autovacuum is off).
BENCH_PG ?= throwaway
BENCH_ENV = $(if $(filter existing,$(BENCH_PG)),,OUTBOX_PG_THROWAWAY=1 OUTBOX_PG_PROFILE=production)

bench: ## the full benchmark suite (about twelve minutes) on a production-like throwaway Postgres: table on stdout, JSON and plots in bench/results/
	env $(BENCH_ENV) $(WITH_PG) $(GO) -C bench run . $(BENCHFLAGS)

.PHONY: bench-quick
bench-quick: ## the benchmark suite in quick mode (about two minutes, CI: keeps it working, asserts no figures)
	$(GO) -C bench test -count=1 ./...
	env $(BENCH_ENV) $(WITH_PG) $(GO) -C bench run . -quick $(BENCHFLAGS)

.PHONY: bench-peers
bench-peers: ## make bench with Graphile Worker beside the outbox in the latency-versus-rate scenario (scripts/install-node-peer.sh; skipped with a note without Node)
	env $(BENCH_ENV) $(WITH_PG) $(GO) -C bench run . -peers graphile $(BENCHFLAGS)

CHAOS_EVENTS  ?= 60000
SOAK_DURATION ?= 2m
FUZZTIME      ?= 5s

.PHONY: chaos
chaos: ## the long chaos suite (CHAOS_EVENTS events in all, default 60000): per-scenario lost / duplicated / stuck report
	$(WITH_PG) env CHAOS_EVENTS=$(CHAOS_EVENTS) $(GO) test -count=1 -timeout 120m -parallel 1 -v -run 'TestChaos|TestLedger' ./chaos

.PHONY: soak
soak: ## steady publish rate for SOAK_DURATION (default 2m; SOAK_RATE events/s): RSS, backlog, latency over time
	$(WITH_PG) env SOAK_DURATION=$(SOAK_DURATION) $(GO) test -count=1 -timeout 0 -v -run '^TestSoak$$' ./chaos

.PHONY: fuzz
fuzz: ## run every fuzz target for FUZZTIME (default 5s) from its checked-in seed corpus
	$(GO) test -run '^$$' -fuzz '^FuzzValidateType$$' -fuzztime $(FUZZTIME) .
	$(GO) test -run '^$$' -fuzz '^FuzzValidatePayload$$' -fuzztime $(FUZZTIME) .
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) ./route
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) ./internal/filter
	$(GO) test -run '^$$' -fuzz '^FuzzParseRoundTrip$$' -fuzztime $(FUZZTIME) ./internal/filter
