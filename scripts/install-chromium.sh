#!/usr/bin/env bash
# Installs Chromium from the Debian packages when it is missing, for the
# console's browser tests (console/browser_test.go). Needs root (CI runs as
# root); prints what it found and exits 0 when Chromium is already there.
set -euo pipefail
for b in chromium chromium-browser google-chrome google-chrome-stable headless-shell; do
	if command -v "$b" >/dev/null 2>&1; then
		echo "install-chromium: found $(command -v "$b")"
		exit 0
	fi
done
if ! command -v apt-get >/dev/null 2>&1; then
	echo "install-chromium: no Chromium and no apt-get: install Chromium by hand (the browser tests skip without it)" >&2
	exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "install-chromium: installed $(command -v chromium)"
