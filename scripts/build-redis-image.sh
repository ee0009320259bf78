#!/usr/bin/env bash
# localhost/dmtd/redis:7-bookworm (docker/redis.Dockerfile): the chart's Redis StatefulSet image for tests/cluster, where
# redis:7.4-alpine cannot be pulled. Debian's redis-server on the local base; seconds once its layers are cached.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PODMAN="$ROOT/scripts/podman.sh"
if ! bash scripts/install-podman.sh >/dev/null || ! "$PODMAN" info >/dev/null 2>&1; then
  [ "${IMAGES_OPTIONAL:-0}" = 1 ] && { echo "redis image not built: podman cannot run here" >&2; exit 0; }
  echo "podman cannot run here (scripts/install-podman.sh)" >&2
  exit 1
fi
bash scripts/build-base-image.sh
LOG="${DMTD_IMAGE_CACHE:-/var/cache/dmtd-images}/build-redis.log"
mkdir -p "$(dirname "$LOG")"
"$PODMAN" build --network host --layers -f docker/redis.Dockerfile -t localhost/dmtd/redis:7-bookworm docker >"$LOG" 2>&1 || {
  tail -30 "$LOG" >&2; echo "building localhost/dmtd/redis:7-bookworm failed (log: $LOG)" >&2; exit 1; }
echo "localhost/dmtd/redis:7-bookworm built"
