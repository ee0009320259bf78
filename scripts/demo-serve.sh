#!/usr/bin/env bash
# `dmtd serve --demo`: start the stack, stream one chat answer over gRPC, print tokens/s and block lengths,
# stop. As root it runs in a private network namespace (Ray listens on all interfaces); otherwise on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
# On a 2-core CPU even τ = 1 runs at ~50 ms per token, so the default 50 ms ITL SLO keeps the τ controller
# under pressure (τ 4, gate off: fast, poor text). A 150 ms SLO lets it rest at the variant's operating
# point, as on a GPU; pass --itl-slo-ms 50 to watch it trade quality for speed.
# --stream-interval-ms 0: every DMTD cycle its own message, so the histogram below shows the cycles' lengths
# (the default groups a request's cycles of 40 ms into one message; docs/serving.md, "The stream interval").
set -- --itl-slo-ms 150 --stream-interval-ms 0 "$@"
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null; then
  exec unshare -n sh -c 'ip link set lo up && exec .venv/bin/dmtd serve --demo "$@"' sh "$@"
fi
exec .venv/bin/dmtd serve --demo "$@"
