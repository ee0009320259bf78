#!/usr/bin/env bash
# The web dashboard test drives Debian's chromium headless (DevTools protocol); install it when missing
# (as root, via apt). Nothing is downloaded at test time.
set -euo pipefail
for exe in chromium chromium-browser; do
  if command -v "$exe" >/dev/null 2>&1; then command -v "$exe"; exit 0; fi
done
if [ "$(id -u)" != 0 ]; then
  echo "chromium is missing: install it (apt-get install chromium) and rerun" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
command -v chromium
