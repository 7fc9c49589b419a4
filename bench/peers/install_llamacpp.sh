#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only) into .peers/llamacpp (at the repo root), for
# bench/serving.py --impls llamacpp. The source is the llama.cpp that llama-cpp-python's sdist
# vendors, because PyPI is reachable here and GitHub is not.
# Idempotent: does nothing if .peers/llamacpp/bin/llama-server already runs.
# Recipe and reasons: bench/peers/README.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEER="$ROOT/.peers/llamacpp"
BIN="$PEER/bin/llama-server"
PIP="$ROOT/.venv/bin/pip"

# llama-cpp-python 0.3.36 vendors ggml-org/llama.cpp@0c1e57098 (its CHANGELOG.md), which is
# llama.cpp's release b11312. The sdist carries llama.cpp's git metadata as a shallow clone of
# that one commit, so cmake would read the build number from it as 1: both are given instead.
VERSION=0.3.36
LLAMA_COMMIT=0c1e57098
LLAMA_BUILD_NUMBER=11312
SDIST="$PEER/llama_cpp_python-$VERSION.tar.gz"
SRC="$PEER/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$PEER/build"

if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
    echo "[install_llamacpp] already built"
    echo "$BIN"
    exit 0
fi

if [[ ! -x "$PIP" ]]; then
    echo "[install_llamacpp] $PIP is missing: run \`make install\` first" >&2
    exit 1
fi
mkdir -p "$PEER"

if [[ ! -f "$SDIST" ]]; then
    echo "[install_llamacpp] downloading llama-cpp-python==$VERSION sdist (~77 MB)"
    # pip prepares the sdist's metadata on the way (~30 s); --no-deps keeps it to this one file.
    "$PIP" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEER"
fi

if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    echo "[install_llamacpp] unpacking $(basename "$SDIST")"
    # Into a scratch folder first, so an interrupted unpack is never taken for a whole one.
    rm -rf "$PEER/unpack" "$PEER/llama_cpp_python-$VERSION"
    mkdir -p "$PEER/unpack"
    tar -xzf "$SDIST" -C "$PEER/unpack"
    mv "$PEER/unpack/llama_cpp_python-$VERSION" "$PEER/"
    rmdir "$PEER/unpack"
fi

echo "[install_llamacpp] configuring llama.cpp $LLAMA_COMMIT (b$LLAMA_BUILD_NUMBER), CPU only"
# LLAMA_CURL is deprecated and ignored in this version (no curl either way); it is kept so an
# older llama.cpp also builds without it. LLAMA_OPENSSL=OFF: plain HTTP on loopback is enough.
# No web UI: its assets are neither in the sdist nor downloadable here (no Hugging Face), and
# the OpenAI endpoints do not need it.
cmake -S "$SRC" -B "$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT" \
    -DLLAMA_BUILD_NUMBER="$LLAMA_BUILD_NUMBER" \
    >"$PEER/configure.log" 2>&1 || {
    tail -n 30 "$PEER/configure.log" >&2
    exit 1
}

echo "[install_llamacpp] building llama-server (nice 19, -j2; about 7 min on 2 cores; log: $PEER/build.log)"
start=$SECONDS
nice -n 19 cmake --build "$BUILD" --target llama-server -j2 >"$PEER/build.log" 2>&1 || {
    tail -n 30 "$PEER/build.log" >&2
    exit 1
}
echo "[install_llamacpp] built in $((SECONDS - start)) s"

mkdir -p "$PEER/bin"
cp "$BUILD/bin/llama-server" "$BIN"
"$BIN" --version
echo "[install_llamacpp] done"
echo "$BIN"
