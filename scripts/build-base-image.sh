#!/usr/bin/env bash
# The local base image localhost/dmtd/debian-base:bookworm: no image registry is reachable here, so the
# base is Debian bookworm made with debootstrap (minbase) from this machine's own Debian mirror and
# imported into podman. Kept once built (BASE_REBUILD=1 makes it again).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PODMAN="$ROOT/scripts/podman.sh"
IMAGE="${BASE_IMAGE_LOCAL:-localhost/dmtd/debian-base:bookworm}"
if [ "${BASE_REBUILD:-0}" != 1 ] && "$PODMAN" image exists "$IMAGE"; then
  exit 0
fi
MIRROR="${DEBIAN_MIRROR:-$(grep -h -m1 '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | head -1)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
ROOTFS="$(mktemp -d /var/tmp/dmtd-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
start=$(date +%s)
debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >/dev/null
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | "$PODMAN" import - "$IMAGE" >/dev/null
echo "$IMAGE built in $(( $(date +%s) - start )) s from $MIRROR"
