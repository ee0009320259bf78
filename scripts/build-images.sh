#!/usr/bin/env bash
# `make images`: builds ghcr.io/dmtd/operator:<appVersion> and ghcr.io/dmtd/serving:<appVersion> (the names
# and tag helm/dmtd uses) with podman, from the local Debian base (scripts/build-base-image.sh).
#   IMAGES="operator"  builds only that one;  BASE_IMAGE=python:3.11-slim  builds on another base.
# For the build only: the machine's CA bundle (pip through the TLS proxy), the local torch CPU wheel
# (/opt/wheels, or TORCH_WHEEL_DIR) and a pip cache outside the image. Layers are cached by podman, so a
# rebuild with nothing changed takes seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PODMAN="$ROOT/scripts/podman.sh"
# IMAGES_OPTIONAL=1 (make test): where podman cannot run, say why and build nothing; the image tests skip.
if ! bash scripts/install-podman.sh >/dev/null || ! "$PODMAN" info >/dev/null 2>&1; then
  if [ "${IMAGES_OPTIONAL:-0}" = 1 ]; then
    echo "images not built: podman cannot run here (the image smoke tests will skip)" >&2
    exit 0
  fi
  echo "podman cannot run here (scripts/install-podman.sh; podman with runc needs root)" >&2
  exit 1
fi
BASE="${BASE_IMAGE:-localhost/dmtd/debian-base:bookworm}"
if [ "$BASE" = localhost/dmtd/debian-base:bookworm ]; then
  bash scripts/build-base-image.sh
fi
TAG="${IMAGE_TAG:-$(awk -F'"' '/^appVersion:/ {print $2}' helm/dmtd/Chart.yaml)}"
WHEELS="${TORCH_WHEEL_DIR:-/opt/wheels}"
CACHE="${DMTD_IMAGE_CACHE:-/var/cache/dmtd-images}"
mkdir -p "$CACHE/pip"
mounts=()
[ -f /etc/ssl/certs/ca-certificates.crt ] && mounts+=(-v /etc/ssl/certs/ca-certificates.crt:/host-ca.crt:ro)
if ls "$WHEELS"/torch-*.whl >/dev/null 2>&1; then mounts+=(-v "$WHEELS:/wheels:ro"); fi
mounts+=(-v "$CACHE/pip:/pip-cache")
for name in ${IMAGES:-operator serving}; do
  start=$(date +%s)
  "$PODMAN" build --network host --layers "${mounts[@]}" --build-arg "BASE_IMAGE=$BASE" \
    -f "docker/$name.Dockerfile" -t "ghcr.io/dmtd/$name:$TAG" . >"$CACHE/build-$name.log" 2>&1 || {
      tail -40 "$CACHE/build-$name.log" >&2; echo "building ghcr.io/dmtd/$name:$TAG failed (log: $CACHE/build-$name.log)" >&2
      exit 1; }
  echo "ghcr.io/dmtd/$name:$TAG built in $(( $(date +%s) - start )) s"
done
# Drop the images the new tags replaced (untagged, no children); the layers the current tags use stay cached.
"$PODMAN" image prune -f >/dev/null
