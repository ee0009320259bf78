#!/usr/bin/env bash
# Debian's prometheus (2.42) for tests/cluster: a real server scraping the gateway and the replicas, whose HTTP API
# the operator's metrics source queries. Installed via apt when missing (as root), like the other install scripts.
set -euo pipefail
command -v prometheus >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "prometheus is missing: install it (apt-get install --no-install-recommends prometheus) and rerun" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# Debian starts a system instance on install; the tests run their own on addresses of their own namespace.
(service prometheus stop || true) >/dev/null 2>&1
command -v prometheus
