#!/usr/bin/env bash
# with-postgres.sh COMMAND...: run COMMAND with TEST_DATABASE_URL and
# DATABASE_URL pointing at a Postgres that accepts connections.
#
# Discovery, in order:
#   1. TEST_DATABASE_URL or DATABASE_URL, when set;
#   2. postgres://postgres@127.0.0.1:5432/postgres, when it answers;
#   3. a throwaway cluster started from the installed server binaries (initdb,
#      postgres; apt-get installs postgresql when they are missing), run as the
#      postgres user on a free port in a temporary directory, and stopped and
#      removed when the script ends (COMMAND's exit, a failed start, Ctrl-C,
#      SIGTERM).
# On a server found by 1 or 2 the script itself creates nothing; what the
# make targets create there, and how they clean up, is in README.md.
# OUTBOX_PG_THROWAWAY=1 skips 1 and 2 and always starts a throwaway cluster.
# OUTBOX_PG_PROFILE selects the throwaway cluster's settings:
#   test (default)  fsync, synchronous_commit and full_page_writes off: fast
#                   and fine for correctness tests, wrong for any figure;
#   production      what a production server runs (durable commits,
#                   autovacuum on, 2 GB shared_buffers, checkpoint spread):
#                   the settings every benchmark figure is taken with
#                   (make bench uses it; docs/benchmarks.md lists them).
set -euo pipefail

log() { echo "with-postgres: $*" >&2; }

url="${TEST_DATABASE_URL:-${DATABASE_URL:-}}"
cleanup() { :; }
run=()
# A signal ends the script through exit, so the EXIT trap (cleanup) runs.
trap 'exit 130' INT
trap 'exit 143' TERM

can_connect() {
	if command -v psql >/dev/null 2>&1; then
		psql "$1" -Atqc 'select 1' >/dev/null 2>&1
	elif command -v pg_isready >/dev/null 2>&1; then
		pg_isready -q -d "$1"
	else
		# No client tools: try the TCP port.
		(exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null
	fi
}

find_bin() {
	local name=$1
	if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return; fi
	local cand
	cand=$(ls -d /usr/lib/postgresql/*/bin/"$name" 2>/dev/null | sort -V | tail -1 || true)
	[ -n "$cand" ] && echo "$cand"
}

start_throwaway() {
	initdb="" pgctl=""
	initdb=$(find_bin initdb || true)
	if [ -z "$initdb" ]; then
		log "no Postgres server binaries; installing postgresql with apt-get"
		export DEBIAN_FRONTEND=noninteractive
		apt-get update -qq >&2 && apt-get install -y -qq postgresql >&2
		initdb=$(find_bin initdb)
	fi
	pgctl=$(dirname "$initdb")/pg_ctl
	dir="" port=""
	dir=$(mktemp -d /tmp/outbox-pg.XXXXXX)
	# From here on the cluster is removed however the script ends: a failed
	# initdb or start, COMMAND's exit, Ctrl-C or SIGTERM (see the traps).
	cleanup() {
		if [ -f "$dir/data/postmaster.pid" ]; then
			log "stopping the throwaway Postgres"
			"${run[@]}" "$pgctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
		fi
		rm -rf "$dir"
	}
	trap cleanup EXIT
	port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 55432)
	if [ "$(id -u)" = 0 ]; then
		id postgres >/dev/null 2>&1 || useradd --system --home "$dir" postgres
		chown postgres "$dir"
		run=(runuser -u postgres --)
	fi
	log "starting a throwaway Postgres in $dir on port $port"
	"${run[@]}" "$initdb" -D "$dir/data" -U postgres -A trust --no-sync >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; exit 1; }
	local settings="-c max_connections=300 -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
	case "${OUTBOX_PG_PROFILE:-test}" in
	test) ;;
	production)
		settings="-c max_connections=300 -c fsync=on -c synchronous_commit=on -c full_page_writes=on"
		settings+=" -c autovacuum=on -c shared_buffers=2GB -c effective_cache_size=12GB -c work_mem=16MB"
		settings+=" -c maintenance_work_mem=512MB -c wal_buffers=64MB -c max_wal_size=8GB -c min_wal_size=1GB"
		settings+=" -c checkpoint_completion_target=0.9 -c random_page_cost=1.1 -c wal_compression=on"
		;;
	*) log "OUTBOX_PG_PROFILE=${OUTBOX_PG_PROFILE}: want test or production"; exit 2 ;;
	esac
	log "settings profile ${OUTBOX_PG_PROFILE:-test}: $settings"
	"${run[@]}" "$pgctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
		-o "-c listen_addresses=127.0.0.1 -p $port -k $dir $settings" start >&2 \
		|| { cat "$dir/server.log" >&2; exit 1; }
	url="postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable"
}

if [ "${OUTBOX_PG_THROWAWAY:-}" = 1 ]; then
	url=""
	start_throwaway
elif [ -z "$url" ]; then
	if can_connect "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"; then
		url="postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	else
		start_throwaway
	fi
fi
export TEST_DATABASE_URL="$url" DATABASE_URL="$url"
# Not exec: the script stays to remove a throwaway cluster after COMMAND.
"$@"
