#!/usr/bin/env bash
# Generate the Python stubs of proto/dmtd/v1/*.proto into platform/dmtd/v1/ (or into $1, for the freshness test).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-platform}"
py="${PYTHON:-.venv/bin/python}"
"$py" -m grpc_tools.protoc -Iproto --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" proto/dmtd/v1/*.proto
touch "$out/dmtd/v1/__init__.py"
