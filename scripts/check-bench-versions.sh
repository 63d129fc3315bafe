#!/usr/bin/env bash
# check-bench-versions.sh: bench/ must build against the same versions of the
# modules it shares with the root module (pgx, River, ...), or the benchmark
# measures a different driver from the one the product ships. Exits 1 and
# names each module whose versions differ.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only modules whose packages are compiled into either build count.
mods() { go list -deps -f '{{with .Module}}{{if not .Main}}{{.Path}} {{.Version}}{{end}}{{end}}' ./... | sort -u; }
root=$(mods)
bench=$(cd bench && mods | grep -v '^github.com/outboxhq/outbox ')
bad=$(join <(echo "$root") <(echo "$bench") | awk '$2 != $3 && $2 != "" {print "  " $1 ": root " $2 ", bench " $3}')
if [ -n "$bad" ]; then
	echo "bench/ and the root module use different versions:" >&2
	echo "$bad" >&2
	echo "align bench/go.mod with the root's (cd bench && go get MODULE@VERSION)" >&2
	exit 1
fi
echo "bench/ uses the root module's versions"
