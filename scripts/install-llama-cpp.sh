#!/usr/bin/env bash
# llama.cpp for `dmtd bench engine --llama-cpp`: llama-cpp-python from PyPI, compiled once for this CPU.
# PyPI has only the source distribution; the wheel built from it is kept in ~/.cache/dmtd/wheels, so a
# fresh venv on the same machine installs in seconds. Building takes ~10-20 minutes on two cores.
set -euo pipefail
VERSION=0.3.36
BIN=${BIN:-.venv/bin}
WHEELS=${DMTD_WHEELS:-$HOME/.cache/dmtd/wheels}
if "$BIN/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  exit 0
fi
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "building llama-cpp-python needs cmake and g++: apt-get install cmake g++, then rerun" >&2; exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ >/dev/null
fi
mkdir -p "$WHEELS"
# The wheel is tied to this CPU (GGML_NATIVE): its name carries the CPU flags it was built for.
TAG=$(grep -m1 -o -w -E 'avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' '-')
DIR="$WHEELS/llama-cpp-python-$VERSION-${TAG%-}"
if ! ls "$DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $VERSION for this CPU (once; cached in $DIR) ..."
  mkdir -p "$DIR"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" \
    "$BIN/pip" wheel --no-deps --no-binary llama-cpp-python -w "$DIR" "llama-cpp-python==$VERSION"
fi
"$BIN/pip" install -q --no-deps "$DIR"/llama_cpp_python-*.whl
"$BIN/pip" install -q 'diskcache>=5.6.1' 'jinja2>=2.11.3' 'typing-extensions>=4.5.0'
"$BIN/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
