#!/usr/bin/env bash
# Prepare what scripts/device_train.sh and scripts/device_engine.sh need on a lent GPU machine, which reaches no package index and takes at
# most 64 MiB a call (the working tree included): a tar of the wheels the training code imports beside the image's
# torch (pydantic and its parts, gguf) and the base's GGUF (xz), cut into parts that each travel with one call.
#   bash scripts/device_payload.sh [PARTS]      # default 3; prints the SHA-256 and the calls to make
# Parts land in .dev1/p, .dev2/p, ... (ignored through .git/info/exclude). Carry .dev1 in the first call,
# .dev2 in the second, ... within the machine's warm window (30 s), and run device_train.sh in the last one.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}
py=.venv/bin/python
grep -qx '/.dev\*/' .git/info/exclude 2>/dev/null || echo '/.dev*/' >> .git/info/exclude
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
ver() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$w" \
  "pydantic==$(ver pydantic)" "pydantic_core==$(ver pydantic_core)" "annotated-types==$(ver annotated-types)" \
  "typing-inspection==$(ver typing-inspection)" "typing_extensions==$(ver typing_extensions)" "gguf==$(ver gguf)" \
  "redis==$(ver redis)"
g=$("$py" -c "from dmtd.variants.smollm2 import gguf_path; print(gguf_path())")
xz -T2 -6 -c "$g" > "$w/gguf.xz"
(cd "$w" && tar cf payload.tar $(ls *.whl) gguf.xz)   # wheels first: the first part alone unpacks them
size=$(stat -c %s "$w/payload.tar"); part=$(( (size + n - 1) / n ))
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb | tail -1 | cut -f1)
room=$(( (64 << 20) - tree ))
echo "payload $size bytes in $n parts of <= $part; working tree $tree bytes; a call carries <= $room"
if [ "$part" -gt "$room" ]; then
  echo "a part does not fit beside the working tree: run again with more parts" >&2
  exit 2
fi
rm -rf .dev[0-9]*
for i in $(seq 1 "$n"); do
  mkdir -p ".dev$i"
  dd if="$w/payload.tar" of=".dev$i/p" bs=1M iflag=count_bytes,skip_bytes skip=$(( (i - 1) * part )) \
     count="$part" status=none
done
sha=$(sha256sum "$w/payload.tar" | cut -d' ' -f1)
echo "SHA-256 $sha"
echo "last call: bash scripts/device_train.sh $sha \$OUT $(for i in $(seq 1 "$n"); do printf '.dev%s/p ' "$i"; done)-- --budget-s 540"
