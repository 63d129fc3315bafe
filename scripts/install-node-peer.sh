#!/usr/bin/env bash
# install-node-peer.sh: make the bench's Graphile Worker peer runnable
# (bench/peers/graphile): Node and npm from Debian's packages when missing
# (apt-get, as root only), then `npm ci` from the checked-in
# package-lock.json. Exits non-zero, with the reason on stderr, when it
# cannot; the bench then skips the peer and says so (it never fails the
# suite for it).
set -euo pipefail

dir="$(cd "$(dirname "$0")/.." && pwd)/bench/peers/graphile"
log() { echo "install-node-peer: $*" >&2; }

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
	if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
		log "node or npm is missing and cannot be installed here (needs root and apt-get)"
		exit 1
	fi
	log "installing nodejs and npm with apt-get"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq >&2 && apt-get install -y -qq nodejs npm >&2 || {
		log "apt-get install nodejs npm failed"
		exit 1
	}
fi

major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 18 ]; then
	log "node $(node --version) is too old (graphile-worker 0.16 wants 14 or later; this script wants 18)"
	exit 1
fi

lock="$dir/package-lock.json"
stamp="$dir/node_modules/.package-lock.json"
if [ -f "$stamp" ] && [ "$stamp" -nt "$lock" ] && [ -d "$dir/node_modules/graphile-worker" ]; then
	exit 0
fi
log "npm ci in $dir (node $(node --version), npm $(npm --version))"
(cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >&2) || {
	log "npm ci failed"
	exit 1
}
