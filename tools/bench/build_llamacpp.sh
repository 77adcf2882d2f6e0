#!/usr/bin/env bash
# The speed peer for the benches: llama.cpp's CPU tools and a venv that runs its HF -> GGUF converter.
#
#   tools/bench/build_llamacpp.sh PREFIX [--jobs=N] [--torch=SPEC]
#
# llama.cpp's source comes from the llama-cpp-python sdist on PyPI (version and sha256 pinned below), which vendors
# llama.cpp (0.3.36: llama.cpp 0c1e570, the build every measurement in docs/ used).  Afterwards PREFIX holds
#   bin/llama-bench, bin/llama-quantize, bin/llama-server   (CPU build, -march=native)
#   venv/   Python with torch (CPU), transformers, safetensors and llama.cpp's gguf-py: the converter's, and the
#           transformers oracle's of --mode=peer
#   src/    the llama.cpp tree (convert_hf_to_gguf.py, conversion/, gguf-py/)
# which is what `python -m tools.bench --llamacpp=PREFIX` expects; the benches convert with
# PREFIX/venv/bin/python tools/bench/hf_to_gguf.py.  Each step is skipped where its output is already there, so a
# failed run can be re-run.  8-15 minutes on 2 cores; never run in CI.
set -euo pipefail

SDIST_VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
TOOLS=(llama-bench llama-quantize llama-server)

usage() { echo "usage: $0 PREFIX [--jobs=N] [--torch=SPEC]" >&2; exit 2; }

prefix="" jobs="$(nproc)" torch_spec="torch==2.13.0"
for arg in "$@"; do
  case "$arg" in
    --jobs=*) jobs="${arg#--jobs=}" ;;
    --torch=*) torch_spec="${arg#--torch=}" ;;
    -h|--help) usage ;;
    -*) echo "build_llamacpp.sh: unknown option $arg" >&2; usage ;;
    *) [ -z "$prefix" ] || usage; prefix="$arg" ;;
  esac
done
[ -n "$prefix" ] || usage
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "build_llamacpp.sh: --jobs=$jobs: a positive integer" >&2; exit 2; }
for tool in python3 c++; do
  command -v "$tool" >/dev/null || { echo "build_llamacpp.sh: $tool not found on PATH" >&2; exit 1; }
done
mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
py="$prefix/venv/bin/python"

make_venv() {
  [ -x "$py" ] || python3 -m venv "$prefix/venv"
  "$py" -m pip install -q --upgrade pip cmake ninja
}

fetch_source() {                # src/ from the pinned sdist, checked against its hash
  [ -f "$prefix/src/convert_hf_to_gguf.py" ] && return
  local dl="$prefix/download"
  mkdir -p "$dl"
  echo "llama-cpp-python==$SDIST_VERSION --hash=sha256:$SDIST_SHA256" > "$dl/requirements.txt"
  "$py" -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$dl/requirements.txt" -d "$dl"
  rm -rf "$dl/unpacked" "$prefix/src"
  mkdir -p "$dl/unpacked"
  tar -xzf "$dl/llama_cpp_python-$SDIST_VERSION.tar.gz" -C "$dl/unpacked"
  mv "$dl/unpacked/llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp" "$prefix/src"
  rm -rf "$dl/unpacked"
}

build_tools() {                 # the CPU tools only: no curl, no TLS, no tests, no web UI download
  local missing=0 t
  for t in "${TOOLS[@]}"; do [ -x "$prefix/bin/$t" ] || missing=1; done
  [ "$missing" = 0 ] && return
  PATH="$prefix/venv/bin:$PATH" cmake -S "$prefix/src" -B "$prefix/src/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$prefix/cmake.log"
  PATH="$prefix/venv/bin:$PATH" ninja -C "$prefix/src/build" -j "$jobs" "${TOOLS[@]}"
  mkdir -p "$prefix/bin"
  for t in "${TOOLS[@]}"; do cp "$prefix/src/build/bin/$t" "$prefix/bin/"; done
}

converter_env() {               # what convert_hf_to_gguf.py, gguf_reskew.py / gguf_widen.py and the oracle import
  "$py" -c "import torch, transformers, safetensors, gguf" 2>/dev/null && return
  "$py" -m pip install -q "$torch_spec" "transformers>=5.0" safetensors sentencepiece protobuf numpy \
    "$prefix/src/gguf-py"
}

make_venv
fetch_source
build_tools
converter_env
echo "llama.cpp CPU tools in $prefix/bin; the benches take --llamacpp=$prefix"
