#!/usr/bin/env bash
# The committed stubs in platform/dmtd/v1 must be exactly what protoc generates from proto/ now.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash scripts/gen-proto.sh "$tmp"
for f in "$tmp"/dmtd/v1/*; do
  if ! cmp -s "$f" "platform/dmtd/v1/$(basename "$f")"; then
    echo "stale generated stub: platform/dmtd/v1/$(basename "$f") — run scripts/gen-proto.sh" >&2
    exit 1
  fi
done
echo "proto stubs are fresh"
