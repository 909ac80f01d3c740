#!/usr/bin/env bash
# run_fuzzers.sh - builds the libFuzzer targets (tests/fuzz, with clang) and
# runs each for a bounded time from the seed corpus in the repository.
#
# usage: run_fuzzers.sh BUILD_DIR SECONDS [TARGET...]
#   BUILD_DIR  where to build them (made if absent)
#   SECONDS    how long each target runs
#   TARGET     hello, options, size, receive (default: all four; receive
#              needs SOFTVERBS_LIB_DIR)
#
# SOFTVERBS_LIB_DIR (environment): the main build's softverbs/lib. The
# receive target (the engine's receive path fed by a rogue peer) runs over
# those libraries; it is built only with them, and only when they are not
# themselves built with a sanitizer (two ASan runtimes cannot share a
# process): the plain build's run covers it.
#
# Prints each target's executions and coverage (libFuzzer's final stats) and
# one line per target: "ok NAME: N runs in S s" or "FAIL NAME: ..." with the
# input that broke an invariant, kept in BUILD_DIR/crashes/NAME/. The seed
# corpus is read, never written: new inputs go to BUILD_DIR/corpus/NAME/.
# Exit 0 iff every target ran clean.
set -u
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR SECONDS [TARGET...]" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
build=$1 seconds=$2
shift 2
targets=("$@")
svlib=${SOFTVERBS_LIB_DIR:-}
if [ -n "$svlib" ] && ldd "$svlib/libibverbs.so.1" 2>/dev/null | grep -q 'libasan\|libubsan'; then
  echo "note: $svlib is built with sanitizers: the receive target runs in the plain build's run"
  svlib=""
fi
if [ ${#targets[@]} -eq 0 ]; then
  targets=(hello options size)
  [ -n "$svlib" ] && targets+=(receive)
fi
for t in "${targets[@]}"; do
  if [ "$t" = receive ] && [ -z "$svlib" ]; then
    echo "FAIL receive: needs SOFTVERBS_LIB_DIR (the main build's softverbs/lib, without sanitizers)"
    exit 1
  fi
done

if ! command -v clang++ >/dev/null; then
  echo "FAIL: clang++ not found (scripts/setup.sh installs clang and libclang-rt-14-dev)"
  exit 1
fi
mkdir -p "$build"
if ! { CXX=clang++ cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
         "-DSOFTVERBS_LIB_DIR=$svlib" >"$build/configure.log" 2>&1 &&
       cmake --build "$build" -j 2 >"$build/build.log" 2>&1; }; then
  echo "FAIL: the fuzzers did not build:"
  tail -n 30 "$build/configure.log" "$build/build.log"
  exit 1
fi

failed=0
for t in "${targets[@]}"; do
  corpus="$build/corpus/$t" crashes="$build/crashes/$t"
  mkdir -p "$corpus" "$crashes"
  log="$build/$t.log"
  extra=()
  # The receive target connects a peer per input over softverbs (one
  # device on loopback) and waits for the engine: milliseconds per input,
  # but its waits for the engine allow 20 s to connect and 20 s for the
  # handover (receive_fuzz.cc) next to a loaded CPU: the timeout is above.
  [ "$t" = receive ] && extra=(-timeout=60)
  SOFTVERBS_DEVICES=mlx5_0:127.0.0.1 \
  "$build/${t}_fuzz" -max_total_time="$seconds" -print_final_stats=1 -timeout=10 "${extra[@]}" \
    -artifact_prefix="$crashes/" "$corpus" "$here/corpus/$t" >"$log" 2>&1
  rc=$?
  runs=$(awk '/stat::number_of_executed_units/{print $2}' "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
  if [ $rc -eq 0 ]; then
    echo "ok $t: ${runs:-?} runs in $seconds s, ${cov:-cov: ?}, corpus $(ls "$corpus" | wc -l) inputs"
  else
    failed=1
    # The invariant, and what the target said just before it (why a step failed).
    echo "FAIL $t (exit $rc): $(grep -m1 -B1 -E 'invariant broken|ERROR: (AddressSanitizer|libFuzzer)|runtime error' "$log" | tr '\n' ' ')"
    echo "  input kept in $crashes/; the log: $log"
    tail -n 20 "$log" | sed 's/^/  /'
  fi
done
exit $failed
