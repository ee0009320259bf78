#!/usr/bin/env bash
# The registry tests start Debian's redis-server themselves; install it when missing (as root, via apt).
set -euo pipefail
command -v redis-server >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "redis-server is missing: install it (apt-get install redis-server) and rerun" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
# Debian starts a system instance on install; the tests run their own on free ports.
(service redis-server stop || true) >/dev/null 2>&1
command -v redis-server
