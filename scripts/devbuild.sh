#!/usr/bin/env bash
# Assembles .devbuild/ (git-ignored) from a CUDA build for the lent GPU machine: binaries, kiln's
# libraries, and the few system libraries that machine lacks (toml++, Boost.program_options,
# libgomp, utf8proc). Carry it with the device tool and run `bash bench/gpu_suite.sh .devbuild`.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-build-cuda}
rm -rf .devbuild
mkdir -p .devbuild/bin .devbuild/lib .devbuild/syslib
cp "$SRC"/bin/* .devbuild/bin/
cp -P "$SRC"/lib/*.so* .devbuild/lib/
for lib in libtomlplusplus.so.3 libboost_program_options.so.1.81.0 libgomp.so.1 libutf8proc.so.2; do
  cp -L "/usr/lib/x86_64-linux-gnu/$lib" .devbuild/syslib/
done
# CUPTI for bench/trace's libkiln_trace.so (the GPU machines have it off the library path).
if [ -f "$SRC/lib/libkiln_trace.so" ]; then
  cp -L /usr/local/cuda/lib64/libcupti.so.13 .devbuild/syslib/
fi
strip --strip-unneeded .devbuild/bin/* .devbuild/lib/*.so* 2>/dev/null || true
du -sh .devbuild
