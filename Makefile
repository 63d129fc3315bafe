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
demo: ## run the demo: a real dispatcher, River workers, a few hundred events, latency percentiles
	$(WITH_PG) $(GO) run ./cmd/outbox-demo

.PHONY: test
test: ## run every test with -race against a real Postgres
	$(WITH_PG) $(GO) test -race -count=1 -timeout 15m ./...

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
	@if [ -x "$(GOLANGCI)" ]; then $(GOLANGCI) run ./...; else echo "golangci-lint not installed: go install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0"; fi

.PHONY: bench
bench: ## the full benchmark suite (about five minutes): table on stdout, JSON and plots in bench/results/
	$(WITH_PG) $(GO) -C bench run . $(BENCHFLAGS)

.PHONY: bench-quick
bench-quick: ## the benchmark suite in quick mode (under a minute, CI: keeps it working, asserts no figures)
	$(WITH_PG) $(GO) -C bench run . -quick $(BENCHFLAGS)
