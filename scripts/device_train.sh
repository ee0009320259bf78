#!/usr/bin/env bash
# On a GPU machine without network access, in the repository's root: reassemble the carried payload
# (a tar of the wheels the training code needs beside the image's torch, then the base's GGUF as gguf.xz),
# check its SHA-256, install the wheels under /tmp/site and run scripts/device_train.py.
#   scripts/device_train.sh SHA256 OUT PART... -- [device_train.py args]
set -euo pipefail
sha=$1; out=$2; shift 2
parts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do parts+=("$1"); shift; done
[ $# -gt 0 ] && shift
mkdir -p /tmp/pay
cat "${parts[@]}" > /tmp/payload.tar
echo "$sha  /tmp/payload.tar" | sha256sum -c -
tar xf /tmp/payload.tar -C /tmp/pay
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/pay/*.whl
python3 -c "
import lzma, shutil
with lzma.open('/tmp/pay/gguf.xz') as a, open('/tmp/pay/SmolLM2-135M-Instruct.Q4_1.gguf', 'wb') as b:
    shutil.copyfileobj(a, b, 1 << 24)"
PYTHONPATH=/tmp/site DMTD_CACHE=/tmp/dmtdc PYTHONUNBUFFERED=1 exec python3 scripts/device_train.py \
  --gguf /tmp/pay/SmolLM2-135M-Instruct.Q4_1.gguf --out "$out" "$@"
