#!/usr/bin/env bash
# `dmtd serve --demo`: start the stack, stream one chat answer over gRPC, print tokens/s and block lengths,
# stop. As root it runs in a private network namespace (Ray listens on all interfaces); otherwise on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null; then
  exec unshare -n sh -c 'ip link set lo up && exec .venv/bin/dmtd serve --demo "$@"' sh "$@"
fi
exec .venv/bin/dmtd serve --demo "$@"
