#!/usr/bin/env bash
# kiln's libFuzzer targets (fuzz/): build them if needed and run them.
#
# usage: scripts/fuzz.sh TARGET SECONDS   run one target (fuzz_pipeline, fuzz_token_shard, ...)
#        scripts/fuzz.sh all SECONDS      every target for SECONDS each, one after the other
#        scripts/fuzz.sh list             the targets
#        scripts/fuzz.sh dist DIR         a self-contained copy for another Linux x86-64 machine:
#                                         DIR/fuzz.sh, the binaries, the shared libraries they load
#                                         (glibc excepted), the seed corpora and dictionaries
#   JOBS=N       run N fuzzing processes at once (libFuzzer -fork=N; 1 = a single process)
#   KILN_FUZZ_BUILD  the build folder (default build-fuzz: clang, ASan + UBSan + libFuzzer coverage,
#                    only the libraries and the fuzz targets)
#
# Each target starts from its seeds (fuzz/corpus/TARGET, never written to) and keeps what it finds
# in a working corpus (BUILD/fuzz-work/TARGET/corpus), so a later run continues from there. A crash,
# a sanitizer report, a leak or a timeout leaves its input in BUILD/fuzz-work/TARGET/ (crash-*,
# leak-*, timeout-*) and makes this script exit 1; rerun it with `BINARY INPUT` to see the report.
# A summary line per run (executions, coverage) goes to BUILD/fuzz-work/summary.txt.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
TARGETS=(fuzz_pipeline fuzz_token_shard fuzz_manifest fuzz_checkpoint_reader fuzz_safetensors fuzz_tokenizer
         fuzz_hf_tokenizer)
JOBS=${JOBS:-1}

if [ -f "$here/KILN_FUZZ_DIST" ]; then  # running from a copy made by `fuzz.sh dist`
  bin_dir="$here/fuzz"
  seed_dir="$here/corpus"
  dict_dir="$here/dict"
  work_dir="$here/work"
  # kiln's libraries find each other through the build tree's absolute RUNPATH, absent here.
  export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  build() { :; }
else
  root="$(cd "$here/.." && pwd)"
  cd "$root"
  BUILD=${KILN_FUZZ_BUILD:-build-fuzz}
  bin_dir="$root/$BUILD/fuzz"
  seed_dir="$root/fuzz/corpus"
  dict_dir="$root/fuzz"
  work_dir="$root/$BUILD/fuzz-work"
  build() {
    if [ ! -f "$BUILD/CMakeCache.txt" ]; then
      # clang (libFuzzer and its sanitizer runtimes) and LLVM's OpenMP runtime, from Debian's packages.
      local missing=() p
      for p in clang libomp-dev; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
      done
      if [ ${#missing[@]} -gt 0 ]; then
        echo "kiln fuzz: installing ${missing[*]}"
        local sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        $sudo apt-get update -q
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
      fi
      cmake -S . -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DKILN_ENABLE_CUDA=OFF -DKILN_FUZZ=ON -DKILN_UNITY_BUILD=ON \
        -DKILN_BUILD_TESTS=OFF -DKILN_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 >/dev/null
    fi
    cmake --build "$BUILD" -j "$(nproc)" --target fuzzers
  }
fi

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 2; }

run_one() {
  local target=$1 seconds=$2
  local work="$work_dir/$target"
  mkdir -p "$work/corpus"
  local args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
              -artifact_prefix="$work/")
  [ -f "$dict_dir/$target.dict" ] && args+=(-dict="$dict_dir/$target.dict")
  if [ "$JOBS" -gt 1 ]; then args+=(-fork="$JOBS" -ignore_crashes=1); fi
  local before
  before=$(find "$work" -maxdepth 1 \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
  echo "== $target: ${seconds}s, $JOBS job(s)"
  local log="$work/last.log" rc=0
  touch "$log.start"
  "$bin_dir/$target" "${args[@]}" "$work/corpus" "$seed_dir/$target" >"$log" 2>&1 || rc=$?
  # The last status line: "#N ... cov: C ft: F corp: ..." (single process) or the fork mode's.
  local last execs
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  [ -n "$execs" ] || execs=$(sed -n 's/^#\([0-9]*\).*/\1/p' <<<"$last")
  local after
  after=$(find "$work" -maxdepth 1 \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
  local line
  line="$(date -u +%FT%TZ) $target ${seconds}s jobs=$JOBS executions=${execs:-?} rc=$rc findings=$((after - before)) | $last"
  echo "$line" | tee -a "$work_dir/summary.txt"
  if [ "$rc" != 0 ] || [ "$after" -gt "$before" ]; then
    # Each new input run again alone, for its report (fork mode keeps the reports in its jobs' logs).
    echo "kiln fuzz: $target found a problem" >&2
    find "$work" -maxdepth 1 -newer "$log.start" \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) |
      head -5 | while read -r input; do
        echo "--- input $input:" >&2
        "$bin_dir/$target" -timeout=10 -rss_limit_mb=2048 "$input" 2>&1 |
          grep -E -A20 'runtime error|broken promise|ERROR: ' | grep -vE '^INFO|^\*\*\*' | head -30 >&2 || true
      done
    return 1
  fi
}

dist() {
  local out=$1
  build
  mkdir -p "$out/fuzz" "$out/lib" "$out/corpus" "$out/dict"
  for t in "${TARGETS[@]}"; do cp "$bin_dir/$t" "$out/fuzz/"; done
  # Every shared library they load (ldd lists them transitively), kiln's and the system's, except
  # glibc's own: the target machine has those (glibc 2.36 or newer is needed).
  ldd "$out"/fuzz/* | awk '/=> \// {print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libresolv.so*|libutil.so*) ;;
      *) cp -L "$lib" "$out/lib/" ;;
    esac
  done
  cp -r "$seed_dir"/. "$out/corpus/"
  cp "$dict_dir"/*.dict "$out/dict/" 2>/dev/null || true
  cp "$0" "$out/fuzz.sh"
  touch "$out/KILN_FUZZ_DIST"
  echo "kiln fuzz: $out holds ${TARGETS[*]}; run e.g. JOBS=16 $out/fuzz.sh fuzz_manifest 3600"
  echo "shared libraries copied: $(ls "$out/lib" | tr '\n' ' ')"
}

[ $# -ge 1 ] || usage
case "$1" in
  list) printf '%s\n' "${TARGETS[@]}" ;;
  dist) [ $# -eq 2 ] || usage; dist "$2" ;;
  all)
    [ $# -eq 2 ] || usage
    build
    failed=0
    for t in "${TARGETS[@]}"; do run_one "$t" "$2" || failed=1; done
    exit $failed
    ;;
  *)
    [ $# -eq 2 ] || usage
    printf '%s\n' "${TARGETS[@]}" | grep -qx "$1" || { echo "unknown target '$1' (scripts/fuzz.sh list)" >&2; exit 2; }
    build
    run_one "$1" "$2"
    ;;
esac
