#!/usr/bin/env bash
# podman + runc (the runtime that works on this host's hybrid cgroups) + debootstrap (the local base image),
# installed via apt when missing, like the other install scripts. Exits 0 when all three are present.
set -euo pipefail
if command -v podman >/dev/null 2>&1 && [ -x /usr/sbin/runc ] && command -v debootstrap >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "podman, runc or debootstrap is missing: install them (apt-get install podman runc debootstrap)" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
command -v podman
