#!/usr/bin/env bash
# tsan.sh - softverbs, the engine, the glue and their tests built with
# ThreadSanitizer, and run: every data race or lock-order inversion TSan
# sees in them fails.
#   1. the engine's and softverbs' test binaries;
#   2. Debian's RDMA programs (tests/thirdparty/run_thirdparty.sh, every
#      case) on the instrumented softverbs: they are not instrumented
#      themselves, softverbs-run preloads TSan's runtime into them, so what
#      TSan checks there is softverbs as those programs drive it (its
#      threads, locks and memory, and the programs' pthread calls);
#   3. the gRPC-level tests (CTest label grpc: end to end, gRPC's endpoint
#      suite, the interop cases across processes and namespaces, both
#      soaks) with the instrumented libgrpc_rdma.so on Debian's gRPC.
#
# Debian's abseil is not built with TSan, and TSan cannot see through an
# uninstrumented absl::Mutex (it reports the accesses the mutex orders as
# races), so abseil is rebuilt instrumented, as shared libraries with
# Debian's sonames, from Debian's own source package
# (scripts/fetch-grpc-source.sh --abseil) into the cache, once per
# version. Every process here runs with it first on LD_LIBRARY_PATH, so
# Debian's libgrpc, which locks absl::Mutex for all its locks, takes the
# instrumented one too and TSan sees gRPC's locking. gRPC's own code is
# not instrumented: what it orders with atomics of its own (closures,
# combiners, slice refcounts) TSan cannot see. The glue says so where it
# hands objects to gRPC (src/glue/handoff.h); gRPC's own interceptor
# calls, and races between gRPC's own threads on gRPC's objects, are
# suppressed, each explained (tests/tsan/suppressions.txt);
# docs/reliability.md says what stays unseen.
#
# Usage: scripts/tsan.sh [BUILD_DIR]   (default: build-tsan in the repo)
#   Needs what scripts/setup.sh installs (it is run by scripts/test.sh after
#   the other suites). Exit 0 iff every test passed with no report.
#
# Environment:
#   GRPC_RDMA_CACHE   as for setup.sh (where abseil's source and build go)
#   TSAN_TESTS        test binaries of step 1 (default: all of them, below)
#   TSAN_THIRDPARTY   0: leave out step 2 (default 1)
#   TSAN_GRPC         0: leave out step 3 (default 1)
set -euo pipefail

prog=tsan
log() { echo "$prog: $*" >&2; }
die() { echo "$prog: error: $*" >&2; exit 1; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$repo/build-tsan}
jobs=2
tsan_flags="-fsanitize=thread -g -O1"

# --- abseil, instrumented -----------------------------------------------------
absl_src=$("$repo/scripts/fetch-grpc-source.sh" --abseil | tail -n 1)
[[ -f "$absl_src/absl/base/config.h" ]] || die "no abseil source tree ('$absl_src')"
absl_prefix=$(dirname "$absl_src")/abseil-tsan-shared-$(basename "$absl_src" | sed 's/^abseil-src-//')
if [[ ! -f "$absl_prefix/.complete" ]]; then
  log "building abseil (shared) with ThreadSanitizer into $absl_prefix (once per version)"
  start=$SECONDS
  rm -rf "$absl_prefix"
  cmake -S "$absl_src" -B "$absl_prefix/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS=$tsan_flags" -DCMAKE_CXX_STANDARD=17 -DABSL_PROPAGATE_CXX_STD=ON \
    -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF -DABSL_BUILD_TESTING=OFF \
    "-DCMAKE_INSTALL_PREFIX=$absl_prefix" >"$absl_prefix.configure.log" 2>&1 ||
    { tail -n 30 "$absl_prefix.configure.log"; die "abseil did not configure"; }
  cmake --build "$absl_prefix/build" -j "$jobs" >"$absl_prefix.build.log" 2>&1 ||
    { tail -n 30 "$absl_prefix.build.log"; die "abseil did not build"; }
  cmake --install "$absl_prefix/build" >/dev/null
  rm -rf "$absl_prefix/build"
  touch "$absl_prefix/.complete"
  log "abseil built in $((SECONDS - start)) s"
fi

# --- this project's device, engine and tests -------------------------------------
grpc_src=$("$repo/scripts/fetch-grpc-source.sh" | tail -n 1)
targets=(softverbs_test verbs_test buffer_pool_test flow_test config_test engine_test
         engine_peer_test)
mkdir -p "$build"
log "configuring $build (ThreadSanitizer, abseil from $absl_prefix)"
cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_C_FLAGS=$tsan_flags" "-DCMAKE_CXX_FLAGS=$tsan_flags" \
  -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread \
  "-Dabsl_DIR=$absl_prefix/lib/cmake/absl" "-DGRPC_RDMA_GRPC_SOURCE_DIR=$grpc_src" \
  -DGRPC_RDMA_SANITIZER_RUNTIMES=libtsan.so \
  -DGRPC_RDMA_BUILD_BENCHMARKS=OFF -DGRPC_RDMA_BUILD_EXAMPLES=OFF >"$build/tsan-configure.log" 2>&1 ||
  { tail -n 30 "$build/tsan-configure.log"; die "configure failed"; }
log "building everything the tests need"
cmake --build "$build" -j "$jobs" >"$build/tsan-build.log" 2>&1 ||
  { grep -E 'error|Error' "$build/tsan-build.log" | head -n 30; die "build failed"; }

# --- run -----------------------------------------------------------------------
# The instrumented abseil before Debian's, for Debian's libgrpc too (the
# test binaries' own run path does not reach a library's dependencies).
export LD_LIBRARY_PATH="$absl_prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# halt_on_error: the first report fails the binary. Suppressions
# (tests/tsan/suppressions.txt) are for code not ours only, each with why.
user_tsan_options=${TSAN_OPTIONS:-}
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 history_size=4 suppressions=$repo/tests/tsan/suppressions.txt $user_tsan_options"
export SOFTVERBS_DEVICES=mlx5_0:127.0.0.1
# The storm test's full size is a CI-length run of its own under TSan.
export STORM_CYCLES=${STORM_CYCLES:-200} STORM_AT_ONCE=${STORM_AT_ONCE:-50}
failed=()
for t in ${TSAN_TESTS:-"${targets[@]}"}; do
  bin=$(find "$build/src" -type f -name "$t" -perm -u+x | head -n 1)
  [[ -n "$bin" ]] || die "$t was not built"
  out=$build/$t.tsan.log
  args=()
  # TSan cannot start threads in the child of a multi-threaded fork (it
  # dies on purpose), and that test's child must start softverbs' agent:
  # it runs in the other suites.
  [[ $t == softverbs_test ]] && args=(--gtest_filter=-VerbsTest.AChildOfForkGetsARuntimeOfItsOwn)
  start=$SECONDS
  if timeout 1800 "$bin" "${args[@]}" >"$out" 2>&1; then
    log "ok $t ($((SECONDS - start)) s): $(grep -E '^\[  PASSED  \]' "$out" | tail -n 1)"
  else
    failed+=("$t")
    log "FAIL $t ($((SECONDS - start)) s), log: $out"
    grep -m1 -A30 'WARNING: ThreadSanitizer' "$out" >&2 || tail -n 30 "$out" >&2
  fi
done

# --- Debian's RDMA programs on the instrumented softverbs ---------------------------
# Each process's reports go to a file of its own (log_path): a report in a
# server the case then stops, or one the program's exit status hides, still
# fails the run. handle_segv=0: a program's crash stays a plain SIGSEGV,
# which run_thirdparty.sh judges (it re-runs perftest's known -R crash);
# TSan's handler would turn it into a report file.
ran_thirdparty=0
if [[ ${TSAN_THIRDPARTY:-1} != 0 ]]; then
  ran_thirdparty=1
  reports=$build/thirdparty-tsan
  rm -rf "$reports" && mkdir -p "$reports"
  start=$SECONDS
  if TSAN_OPTIONS="$TSAN_OPTIONS handle_segv=0 log_path=$reports/report" \
      "$repo/tests/thirdparty/run_thirdparty.sh" --launcher "$build/softverbs/softverbs-run" \
      >"$build/thirdparty.tsan.log" 2>&1; then
    tp_ok=1
  else
    tp_ok=0
  fi
  summary=$(tail -n 1 "$build/thirdparty.tsan.log")
  if [[ $tp_ok == 1 ]] && ! compgen -G "$reports/report*" >/dev/null; then
    log "ok Debian's RDMA programs ($((SECONDS - start)) s): $summary"
  else
    failed+=("thirdparty")
    log "FAIL Debian's RDMA programs ($((SECONDS - start)) s): $summary; log: $build/thirdparty.tsan.log"
    grep -E '^FAIL' "$build/thirdparty.tsan.log" | head -n 10 >&2 || true
    for r in "$reports"/report*; do
      [[ -e $r ]] || continue
      log "report $r:"
      head -n 40 "$r" >&2
      break
    done
  fi
fi
# --- the gRPC-level tests ---------------------------------------------------------
# CTest's grpc label (the package test aside: it builds against the
# installed library, not this build). Many of them start several
# processes (servers, clients, tools, in namespaces), so every process
# reports to a file of its own and any report fails the run, as above (a
# crash too: TSan's SEGV handler writes one). Debian's gRPC libraries are
# not instrumented: the suppressions files leave the interceptor calls
# made from them unchecked (called_from_lib), and the glue marks
# where it hands objects to gRPC (src/glue/handoff.h). softverbs-run
# preloads libgrpc_rdma.so ahead of TSan's runtime so that gRPC's poller
# calls the glue's epoll_wait directly: reached through TSan's interceptor
# from uninstrumented code, what the glue does there would not be checked.
ran_grpc=0
if [[ ${TSAN_GRPC:-1} != 0 ]]; then
  ran_grpc=1
  reports=$build/grpc-tsan
  rm -rf "$reports" && mkdir -p "$reports"
  listed=$(ctest --test-dir "$build" -N -L grpc -E '^package\.' | sed -n 's/^Total Tests: //p' || true)
  # Step 3's suppressions add those in grpc-suppressions.txt (libstdc++).
  cat "$repo/tests/tsan/suppressions.txt" "$repo/tests/tsan/grpc-suppressions.txt" \
    >"$build/grpc-tsan-suppressions.txt"
  start=$SECONDS
  # The user's options first: ours (where reports go) win.
  # SOAK_THREAD_SLACK: run_soak.sh says why.
  if SOAK_THREAD_SLACK=${SOAK_THREAD_SLACK:-2} \
      TSAN_OPTIONS="$user_tsan_options second_deadlock_stack=1 history_size=4 suppressions=$build/grpc-tsan-suppressions.txt log_path=$reports/report" \
      ctest --test-dir "$build" -L grpc -E '^package\.' --no-tests=error >"$build/grpc.tsan.log" 2>&1; then
    grpc_ok=1
  else
    grpc_ok=0
  fi
  summary=$(grep -E 'tests passed' "$build/grpc.tsan.log" | tail -n 1 || true)
  ran=$(sed -n 's/.* out of \([0-9]*\)$/\1/p' <<<"$summary")
  if [[ -z $listed || $listed -lt 30 || $ran != "$listed" ]]; then
    grpc_ok=0
    summary="${summary:-no summary}; ${ran:-no} tests ran of ${listed:-none} listed (30 or more expected)"
  fi
  if [[ $grpc_ok == 1 ]] && ! compgen -G "$reports/report*" >/dev/null; then
    log "ok the gRPC-level tests ($((SECONDS - start)) s): $summary"
  else
    failed+=("grpc")
    log "FAIL the gRPC-level tests ($((SECONDS - start)) s): $summary; log: $build/grpc.tsan.log"
    grep -E '\*\*\*|Failed' "$build/grpc.tsan.log" | head -n 10 >&2 || true
    for r in "$reports"/report*; do
      [[ -e $r ]] || continue
      log "report $r:"
      head -n 40 "$r" >&2
      break
    done
  fi
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  log "failed under ThreadSanitizer: ${failed[*]}"
  exit 1
fi
what="all ${#targets[@]} test binaries"
[[ $ran_thirdparty == 1 ]] && what+=", Debian's RDMA programs"
[[ $ran_grpc == 1 ]] && what+=", the gRPC-level tests"
log "$what passed under ThreadSanitizer, no reports"
