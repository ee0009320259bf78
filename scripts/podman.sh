#!/usr/bin/env bash
# podman as this project runs it: runc (crun fails on hybrid cgroups) and docker/containers.conf (no ulimits).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$ROOT/docker/containers.conf}"
exec podman --runtime "${PODMAN_RUNTIME:-/usr/sbin/runc}" "$@"
