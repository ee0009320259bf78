#!/usr/bin/env bash
# The local base image localhost/dmtd/debian-base:bookworm: no image registry is reachable here, so the
# base is Debian bookworm made with debootstrap (minbase) from the mirror this machine's apt sources name
# (DEBIAN_MIRROR overrides it) and imported into podman. Kept once built (BASE_REBUILD=1 makes it again).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PODMAN="$ROOT/scripts/podman.sh"
IMAGE="${BASE_IMAGE_LOCAL:-localhost/dmtd/debian-base:bookworm}"
SUITE=bookworm
APT_DIR="${APT_DIR:-/etc/apt}"

# The mirror this machine's apt takes Debian $SUITE itself from: a deb822 stanza (sources.list.d/*.sources) whose
# Suites name it, else a one-line `deb URI SUITE ...` entry (sources.list, sources.list.d/*.list).
apt_mirror() {
  local f
  for f in "$APT_DIR"/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v suite="$SUITE" 'BEGIN { RS = ""; FS = "\n" } {
      types = uris = suites = ""
      for (i = 1; i <= NF; i++) {
        if ($i ~ /^Types:/) types = $i
        if ($i ~ /^URIs:/) uris = $i
        if ($i ~ /^Suites:/) suites = $i
      }
      if (types ~ /[ \t]deb([ \t]|$)/ && (suites " ") ~ ("[ \t]" suite "[ \t]")) { split(uris, u, /[ \t]+/); print u[2]; exit }
    }' "$f"
  done
  { cat "$APT_DIR"/sources.list "$APT_DIR"/sources.list.d/*.list 2>/dev/null || true; } | awk -v suite="$SUITE" '$1 == "deb" {
    i = 2
    if ($i ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ }
    if ($(i + 1) == suite) { print $i; exit }
  }'
}

if [ "${1:-}" = --mirror ]; then  # print the mirror and stop (tests/images/test_base_mirror.py)
  apt_mirror | head -1
  exit 0
fi
if [ "${BASE_REBUILD:-0}" != 1 ] && "$PODMAN" image exists "$IMAGE"; then
  exit 0
fi
MIRROR="${DEBIAN_MIRROR:-$(apt_mirror | head -1)}"
if [ -z "$MIRROR" ]; then
  echo "error: no apt source of Debian $SUITE in $APT_DIR (sources.list, sources.list.d): set DEBIAN_MIRROR" >&2
  exit 2
fi
ROOTFS="$(mktemp -d /var/tmp/dmtd-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
start=$(date +%s)
debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >/dev/null
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | "$PODMAN" import - "$IMAGE" >/dev/null
echo "$IMAGE built in $(( $(date +%s) - start )) s from $MIRROR"
